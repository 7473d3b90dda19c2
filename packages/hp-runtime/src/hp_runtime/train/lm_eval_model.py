"""hp's model as an lm-evaluation-harness model (`hp-runtime[eval]`): lm-eval builds a task's
requests, this answers them through `Scorer` on the run's layout, lm-eval scores them.

It follows lm-eval's HF backend (`lm_eval/models/huggingface.py`) wherever a choice changes a
number: the tokens of a context and its continuation (lm-eval's `TemplateLM`), the prefix of an
empty context (BOS, else EOD), the truncation to the model's length, the rolling windows of a
perplexity task, and greedy generation's stop sequences (EOD's text among them), so that a
checkpoint scores as its HF export does under `lm_eval --model hf`.

lm-eval sees one process (rank 0 of 1) on every rank: each rank builds every request, and
`Scorer` splits the work among the data-parallel ranks itself (lm-eval's own split pads ranks
with copies of requests and gathers Python objects; the layout needs every rank in every
forward anyway).
"""

from __future__ import annotations

from typing import Any

import torch
from hp_data.tokenize import TokenizerFiles, vocab_size
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from hp_runtime.parallel import Assembly
from hp_runtime.train.config import Config
from hp_runtime.train.downstream import MAX_GEN_TOKS
from hp_runtime.train.errors import ConfigError
from hp_runtime.train.scorer import Scorer


class Text:
    """A tokenizer as lm-eval's HF backend uses it: its ids with the special tokens its
    post-processor adds (a Llama 3 tokenizer's BOS) unless the text starts with BOS already,
    its text, its end (EOD) and start (BOS, when its config names one, as `bos_token_id` is
    for HF)."""

    def __init__(self, files: TokenizerFiles) -> None:
        self.files = files
        self.tokenizer = files.load()
        self.sentencepiece = hasattr(self.tokenizer, "processor")
        self.size = vocab_size(self.tokenizer)
        self.eod = files.special_id(self.tokenizer, "eos", None)
        named = files.config.get("bos_token")
        self.bos = files.special_id(self.tokenizer, "bos", None) if named else None
        self.bos_text = None if self.bos is None else self.decode([self.bos], False)
        self.name = files.source or files.tokenizer_json

    def encode(self, text: str, special: bool | None = None) -> list[int]:
        """`special`: None adds them unless `text` starts with BOS (HF's `tok_encode`)."""
        if special is None:
            special = not (self.bos_text and text.startswith(self.bos_text))
        if self.sentencepiece:  # HF's Llama 2 tokenizer: BOS first, by its config's default
            ids = list(self.tokenizer.processor.encode(text))
            first = (
                special and self.bos is not None and self.files.config.get("add_bos_token", True)
            )
            return [self.bos, *ids] if first else ids
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.size]  # a model's padded vocabulary's extra ids
        if self.sentencepiece:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class HpLM(TemplateLM):
    """lm-eval's `LM` over `Scorer`: loglikelihood, rolling loglikelihood, greedy generation."""

    def __init__(self, scorer: Scorer, text: Text) -> None:
        super().__init__()
        self.scorer, self.text = scorer, text
        self.max_length = scorer.max_length

    @classmethod
    def of(cls, assembly: Assembly, autocast_dtype: torch.dtype | None, config: Config) -> HpLM:
        """The run's model as `config` evaluates it: its length, `eval.batch_size`, and
        `eval.tokenizer` (else `data.tokenizer`)."""
        name = config.eval.tokenizer or config.data.tokenizer
        assert name is not None  # `config.check_eval` requires one
        text = Text(TokenizerFiles.locate(name))
        if text.size > config.model.vocab_size:
            raise ConfigError(
                f"eval.tokenizer: {name} has {text.size} ids, model.vocab_size is "
                f"{config.model.vocab_size}: give the tokenizer the model was trained with"
            )
        scorer = Scorer(assembly, autocast_dtype, config.model.max_seq_len, config.eval.batch_size)
        return cls(scorer, text)

    @property
    def eot_token_id(self) -> int:
        return self.text.eod

    @property
    def prefix_token_id(self) -> int:
        return self.text.bos if self.text.bos is not None else self.text.eod

    @property
    def tokenizer_name(self) -> str:
        return self.text.name

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        return self.text.encode(string, add_special_tokens)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """As HF's: the whole is cut to the model's length plus one from the left, the last
        token is not an input, and the continuation's tokens are scored."""
        inputs, targets = [], []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1) :]
            inputs.append(whole[:-1])
            targets.append(whole[-len(continuation) :])
        sums, greedy = self.scorer.logprobs(inputs, targets)
        for (key, *_), answer in zip(requests, zip(sums, greedy, strict=True), strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return list(zip(sums, greedy, strict=True))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            pieces = utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(utils.make_disjoint_window, pieces):
                windows.append((None, *window))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (value, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += value
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy, as HF's with do_sample false: the context cut from the left to the model's
        length less the tokens to generate, the tokens cut at EOD and the text at the first
        stop sequence."""
        eos = self.text.decode([self.eot_token_id], skip_special_tokens=False)
        plans = []
        for context, gen_kwargs in (req.args for req in requests):
            settings = normalize_gen_kwargs(dict(gen_kwargs), MAX_GEN_TOKS)
            until = handle_stop_sequences(settings.pop("until", None), eos=eos)
            limit = int(settings.pop("max_gen_toks"))
            room = self.max_length - limit
            if room <= 0:  # `Tasks.check_length` refuses such a task before it runs
                raise ConfigError(
                    f"eval.tasks: a task generates up to {limit} tokens (max_gen_toks), the "
                    f"model has {self.max_length} positions"
                )
            plans.append((self.tok_encode(context)[-room:], until, limit))
        out: list[str] = [""] * len(requests)
        for limit in sorted({plan[2] for plan in plans}):  # HF groups by generation settings
            group = [i for i, plan in enumerate(plans) if plan[2] == limit]

            def stop(i: int, tokens: list[int], group: list[int] = group) -> bool:
                if tokens[-1] == self.eot_token_id:  # HF's generate ends at EOS
                    return True
                text = self.text.decode(tokens, skip_special_tokens=False)  # as HF's criteria
                return any(s and s in text for s in plans[group[i]][1])

            found = self.scorer.generate([plans[i][0] for i in group], limit, stop)
            for i, tokens in zip(group, found, strict=True):
                if self.eot_token_id in tokens:
                    tokens = tokens[: tokens.index(self.eot_token_id)]
                text = postprocess_generated_text(self.text.decode(tokens), plans[i][1], None)
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out
