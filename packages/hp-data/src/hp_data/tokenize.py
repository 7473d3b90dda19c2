"""Load a `tokenizers` model and turn texts into token ids exactly as `tokenizers` does."""

from __future__ import annotations

import itertools
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash
from tokenizers import Tokenizer

from hp_data.errors import PreprocessError
from hp_data.fast_bpe import FastBPE, NotConvertible, compare, probe_texts

# Tried in order when neither --eod-token nor tokenizer_config.json names the token.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|bos|>")
ENGINES = ("auto", "hf", "tiktoken")


@dataclass(frozen=True)
class TokenizerFiles:
    """Where a tokenizer lives: its `tokenizer.json` and, for a HF directory, its config."""

    tokenizer_json: str
    config: dict[str, object]
    config_path: str | None = None  # the tokenizer_config.json that `config` was read from

    @classmethod
    def locate(cls, path: str | os.PathLike[str]) -> TokenizerFiles:
        """A `tokenizer.json` file, or a directory with `tokenizer.json` and optionally
        `tokenizer_config.json` (whose `eos_token`/`bos_token` then name EOD and BOS)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            file = os.path.join(path, "tokenizer.json")
            config_path = os.path.join(path, "tokenizer_config.json")
        else:
            file, config_path = path, None
        if not os.path.isfile(file):
            raise PreprocessError(
                f"{file}: no such tokenizer file; pass a tokenizer.json or a directory with one"
            )
        config: dict[str, object] = {}
        if config_path and os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as stream:
                    config = json.load(stream)
            except (OSError, ValueError) as exc:
                raise PreprocessError(
                    f"{config_path}: unreadable tokenizer config: {exc}"
                ) from None
            if not isinstance(config, dict):
                raise PreprocessError(f"{config_path}: expected a JSON object")
        return cls(file, config, config_path if config else None)

    def content_hash(self) -> str:
        """xxh3-128 of the tokenizer.json bytes: what changes the ids, for cache keys."""
        with open(self.tokenizer_json, "rb") as stream:
            return xxhash.xxh3_128_hexdigest(stream.read())

    def load(self) -> Tokenizer:
        try:
            return Tokenizer.from_file(self.tokenizer_json)
        except Exception as exc:  # tokenizers raises plain Exception for bad JSON
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise PreprocessError(
                f"{self.tokenizer_json}: not a valid tokenizers model: {reason}"
            ) from None

    def special_id(self, tokenizer: Tokenizer, role: str, token: str | None) -> int:
        """The id of the end (`role="eos"`) or start (`"bos"`) token: `token` if given, else
        the config's `{role}_token`, else the first known candidate in the vocabulary."""
        option = "--eod-token" if role == "eos" else "--bos-token"
        if token is not None:
            found = tokenizer.token_to_id(token)
            if found is None:
                raise PreprocessError(f"{option} {token!r} is not in the tokenizer's vocabulary")
            return found
        configured = self.config.get(f"{role}_token")
        if isinstance(configured, dict):
            configured = configured.get("content")
        if isinstance(configured, str):
            found = tokenizer.token_to_id(configured)
            if found is None:
                # A silent substitute would end every document with another token than the
                # model was trained to see.
                raise PreprocessError(
                    f"{self.config_path}: {role}_token {configured!r} is not in the vocabulary "
                    f"of {self.tokenizer_json}; correct it or name the token with {option}"
                )
            return found
        candidates = EOD_CANDIDATES if role == "eos" else BOS_CANDIDATES
        for candidate in candidates:
            found = tokenizer.token_to_id(candidate)
            if found is not None:
                return found
        raise PreprocessError(
            f"the tokenizer has none of {', '.join(candidates)}; name its token with {option}"
        )


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A tokenizer from a `tokenizer.json` file or a directory that holds one."""
    return TokenizerFiles.locate(path).load()


def decode_ids(tokenizer: Tokenizer, ids: np.ndarray) -> str:
    """Text of `ids` as stored (any dtype); an id the tokenizer cannot decode (negative, beyond
    the vocabulary, not an integer) is shown as `<id>` in its place rather than dropped."""
    ids = np.asarray(ids)
    if ids.dtype.kind == "f":
        valid = np.isfinite(ids) & (ids == np.floor(ids))
    else:
        valid = np.ones(len(ids), dtype=bool)
    valid &= (ids >= 0) & (ids < vocab_size(tokenizer))
    if valid.all():
        return tokenizer.decode(ids.astype(np.int64).tolist())
    # Runs of decodable ids are decoded whole (so that multi-byte characters join up).
    edges = np.flatnonzero(np.diff(valid)) + 1
    parts = []
    for run in np.split(np.arange(len(ids)), edges):
        if valid[run[0]]:
            parts.append(tokenizer.decode(ids[run].astype(np.int64).tolist()))
        else:
            parts.extend(f"<{ids[i].item()}>" for i in run)
    return "".join(parts)


def vocab_size(tokenizer: Tokenizer) -> int:
    """The number of ids the tokenizer can produce, added tokens included."""
    return tokenizer.get_vocab_size(with_added_tokens=True)


class HFEngine:
    """`tokenizers`' own `encode_batch_fast`: the reference every other engine is held to."""

    name = "hf"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids of all texts back to back, each text's count), as
        `tokenizer.encode(text, add_special_tokens=False).ids`."""
        ids = [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        count = int(lengths.sum())
        return np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=count), lengths


class Engine(Protocol):
    name: str

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]: ...


def choose_engine(
    files: TokenizerFiles, tokenizer: Tokenizer, requested: str = "auto"
) -> tuple[FastBPE | None, int]:
    """The fast engine's recipe (None: use `tokenizers`) and how many probe texts proved it.

    `auto` takes `tiktoken` only for a tokenizer it converts exactly and that gives the same
    ids on the probe set; `tiktoken` makes either failure an error; `hf` skips both."""
    if requested not in ENGINES:
        raise PreprocessError(f"--tokenizer-engine {requested!r}: choose {', '.join(ENGINES)}")
    if requested == "hf":
        return None, 0
    source = files.tokenizer_json
    try:
        recipe = FastBPE.from_tokenizer_json(source)
        engine = recipe.engine()
    except (NotConvertible, ValueError) as exc:  # ValueError: tiktoken refused the recipe
        if requested == "tiktoken":
            raise PreprocessError(
                f"{source}: --tokenizer-engine tiktoken cannot reproduce this tokenizer: "
                f"{exc}; use --tokenizer-engine auto or hf"
            ) from None
        return None, 0
    added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
    probes = probe_texts(added)
    mismatch = compare(probes, HFEngine(tokenizer).encode(probes), engine.encode(probes))
    if mismatch is not None:
        message = (
            f"{source}: the tiktoken engine differs from tokenizers on probe text "
            f"{probes[mismatch.index]!r} ({mismatch.describe()})"
        )
        if requested == "tiktoken":
            raise PreprocessError(f"{message}; use --tokenizer-engine auto or hf")
        warnings.warn(f"{message}; using tokenizers", stacklevel=2)
        return None, 0
    return recipe, len(probes)


def encode_documents(
    engine: Engine,
    texts: Sequence[str],
    dtype: np.dtype,
    bos: int | None = None,
    eod: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of every text back to back, and each text's token count.

    Ids are `engine.encode`'s (those of `tokenizer.encode(text, add_special_tokens=False)`),
    with `bos` before and `eod` after every text that yields any token (Megatron adds
    neither to an empty document).
    """
    return frame_documents(*engine.encode(texts), dtype, bos, eod)


def frame_documents(
    body: np.ndarray,
    lengths: np.ndarray,
    dtype: np.dtype,
    bos: int | None = None,
    eod: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`encode_documents` of ids already encoded: `body` (all texts' ids back to back) and
    each text's count, with `bos`/`eod` around each text that has any, as `dtype`."""
    content = len(body)
    extra = (bos is not None) + (eod is not None)
    if extra == 0 or content == 0:
        return body.astype(dtype), lengths
    # Spread each document's ids apart to make room for BOS/EOD, vectorised.
    nonempty = lengths > 0
    out_lengths = lengths + extra * nonempty
    ends = np.cumsum(out_lengths)
    starts = ends - out_lengths
    tokens = np.empty(int(ends[-1]), dtype=dtype)
    shift = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    tokens[np.arange(content) + shift + (bos is not None)] = body
    if bos is not None:
        tokens[starts[nonempty]] = bos
    if eod is not None:
        tokens[ends[nonempty] - 1] = eod
    return tokens, out_lengths
