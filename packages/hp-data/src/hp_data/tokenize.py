"""Load a `tokenizers` model and turn texts into token ids exactly as `tokenizers` does."""

from __future__ import annotations

import functools
import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import orjson
import xxhash
from tokenizers import Tokenizer

from hp_data import recipe_cache
from hp_data.errors import PreprocessError
from hp_data.fast_bpe import (
    FastBPE,
    NotConvertible,
    NotProven,
    TiktokenEngine,
    compare,
    probe_texts,
)
from hp_data.fs import first_line
from hp_data.tokenizer_hub import _HUB_NAME, _from_hub

# Tried in order when neither --eod-token nor tokenizer_config.json names the token.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|bos|>")
ENGINES = ("auto", "hf", "tiktoken")


@dataclass(frozen=True)
class TokenizerFiles:
    """Where a tokenizer lives: its `tokenizer.json` and, for a HF directory, its config."""

    tokenizer_json: str  # the file, or what the model was built from (for messages)
    config: dict[str, object]
    config_path: str | None = None  # the tokenizer_config.json that `config` was read from
    gpt2: tuple[str, str] | None = None  # vocab.json and merges.txt, when no tokenizer.json
    sentencepiece: bool = False  # tokenizer_json is a SentencePiece .model
    source: str = ""  # what the user named: a path, a hub name, vocab + merges

    @classmethod
    def locate(cls, path: str | os.PathLike[str], allow_download: bool = False) -> TokenizerFiles:
        """A `tokenizer.json` file; a directory with `tokenizer.json` (or GPT-2's `vocab.json`
        and `merges.txt`) and optionally `tokenizer_config.json` (whose `eos_token` and
        `bos_token` then name EOD and BOS); or a Hugging Face hub name (`gpt2`,
        `meta-llama/Llama-3.1-8B`), found in the local hub cache, or fetched if
        `allow_download` (tokenizer files only)."""
        path = source = os.fspath(path)
        if not os.path.exists(path) and _HUB_NAME.fullmatch(path):
            path = _from_hub(path, allow_download)
        if os.path.isdir(path):
            file = os.path.join(path, "tokenizer.json")
            config_path = os.path.join(path, "tokenizer_config.json")
            vocab, merges = (os.path.join(path, n) for n in ("vocab.json", "merges.txt"))
            if not os.path.isfile(file) and os.path.isfile(vocab) and os.path.isfile(merges):
                files = cls.from_gpt2_files(vocab, merges)
                return replace(files, **_config(config_path), source=source)
            model = os.path.join(path, "tokenizer.model")
            if not os.path.isfile(file) and os.path.isfile(model):
                return cls(model, **_config(config_path), source=source, sentencepiece=True)
        else:
            file, config_path = path, None
            if file.endswith(".model") and os.path.isfile(file):
                return cls(file, {}, source=source, sentencepiece=True)
        if not os.path.isfile(file):
            raise PreprocessError(
                f"{file}: no such tokenizer file; pass a tokenizer.json, a directory with one, "
                "or a Hugging Face hub name"
            )
        return cls(file, **_config(config_path), source=source)

    @classmethod
    def from_gpt2_files(cls, vocab: str, merges: str) -> TokenizerFiles:
        """GPT-2's `vocab.json` + `merges.txt`, as Megatron's GPT2BPETokenizer reads them:
        byte-level BPE with GPT-2's regex; `<|endoftext|>` is the EOD token and, as in
        Megatron, text that spells it is tokenized as text."""
        for name in (vocab, merges):
            if not os.path.isfile(name):
                raise PreprocessError(f"{name}: no such file")
        files = cls(f"{vocab} + {merges}", {}, gpt2=(vocab, merges))
        files.load()  # bad files fail here, named
        return files

    def read(self) -> bytes:
        """The tokenizer.json text (built from vocab.json + merges.txt for GPT-2 files)."""
        if self.gpt2 is None:
            with open(self.tokenizer_json, "rb") as stream:
                return stream.read()
        from tokenizers import decoders, models, pre_tokenizers

        vocab, merges = self.gpt2
        try:
            model = models.BPE.from_file(vocab, merges)
        except Exception as exc:  # tokenizers raises plain Exception for bad files
            raise PreprocessError(
                f"{vocab}, {merges}: not GPT-2 BPE files: {first_line(exc)}"
            ) from None
        tokenizer = Tokenizer(model)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer.to_str().encode()

    def content_hash(self) -> str:
        """xxh3-128 of the tokenizer.json bytes: what changes the ids, for cache keys."""
        return xxhash.xxh3_128_hexdigest(self.read())

    def absolute(self) -> TokenizerFiles:
        """The same files by absolute paths: for processes that start in another directory
        (Ray tasks), and for records read from anywhere."""
        if self.gpt2 is None:
            tokenizer_json, gpt2 = os.path.abspath(self.tokenizer_json), None
        else:
            gpt2 = (os.path.abspath(self.gpt2[0]), os.path.abspath(self.gpt2[1]))
            tokenizer_json = f"{gpt2[0]} + {gpt2[1]}"
        config_path = os.path.abspath(self.config_path) if self.config_path else None
        return replace(self, tokenizer_json=tokenizer_json, gpt2=gpt2, config_path=config_path)

    def describe(self, content_hash: str) -> dict[str, str]:
        """What a summary prints and a dataset's metadata records: what was named, the files
        used (absolute, so that the record holds from any directory) and their xxh3-128."""
        record = {"source": self.source or self.tokenizer_json, "xxh3_128": content_hash}
        files = self.absolute()
        record["path"] = files.tokenizer_json
        if files.gpt2 is not None:
            record |= {"vocab_file": files.gpt2[0], "merge_file": files.gpt2[1]}
        return record

    @classmethod
    def recorded(
        cls, record: Mapping[str, Any], where: str, allow_download: bool = False
    ) -> TokenizerFiles:
        """The tokenizer that `record` (`describe()`'s, read from `where`) names: its files
        where they were, else what was named again (a hub name through the local HF cache, or
        fetched if `allow_download`), and only while its bytes are the ones recorded."""
        attempts: list[Callable[[], TokenizerFiles]] = []
        if isinstance(record.get("vocab_file"), str) and isinstance(record.get("merge_file"), str):
            attempts.append(lambda: cls.from_gpt2_files(record["vocab_file"], record["merge_file"]))
        else:
            for name in dict.fromkeys((record.get("path"), record.get("source"))):
                if isinstance(name, str):
                    attempts.append(lambda name=name: cls.locate(name, allow_download))
        tried = []
        for attempt in attempts:
            try:
                files = attempt()
            except PreprocessError as exc:
                tried.append(str(exc))
                continue
            found = files.content_hash()
            if found == record.get("xxh3_128"):
                return files
            tried.append(
                f"{files.tokenizer_json} has changed since (xxh3 {found[:16]}, "
                f"recorded {str(record.get('xxh3_128'))[:16]})"
            )
        raise PreprocessError(
            f"{where}: its tokenizer {record.get('source')!r} is not here as it was "
            f"({'; '.join(tried) or 'no file recorded'}); pass --tokenizer"
        )

    def load(self) -> Tokenizer:
        """The tokenizer (a `SentencePieceModel` for a .model, with the same methods)."""
        if self.sentencepiece:
            return SentencePieceModel(self.tokenizer_json)  # type: ignore[return-value]
        try:
            if self.gpt2 is not None:
                return Tokenizer.from_str(self.read().decode())
            return Tokenizer.from_file(self.tokenizer_json)
        except Exception as exc:  # tokenizers raises plain Exception for bad JSON
            raise PreprocessError(
                f"{self.tokenizer_json}: not a valid tokenizers model: {first_line(exc)}"
            ) from None

    def special_id(self, tokenizer: Tokenizer, role: str, token: str | None) -> int:
        """The id of the end (`role="eos"`) or start (`"bos"`) token: `token` if given, else
        the config's `{role}_token`, else the first known candidate in the vocabulary."""
        option = "--eod-token" if role == "eos" else "--bos-token"
        if isinstance(tokenizer, SentencePieceModel) and token is None:
            return tokenizer.special(role)  # as Megatron's SentencePiece tokenizers take it
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


def _config(path: str | None) -> dict[str, Any]:
    """`config` and `config_path` of a tokenizer_config.json, if there is one."""
    config: dict[str, object] = {}
    if path and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as stream:
                config = json.load(stream)
        except (OSError, ValueError) as exc:
            raise PreprocessError(f"{path}: unreadable tokenizer config: {exc}") from None
        if not isinstance(config, dict):
            raise PreprocessError(f"{path}: expected a JSON object")
    return {"config": config, "config_path": path if config else None}


# Megatron's --tokenizer-type values hp reads, and what each needs.
MEGATRON_TOKENIZER_TYPES = {
    "HuggingFaceTokenizer": "--tokenizer-model (a hub name or a directory)",
    "GPT2BPETokenizer": "--vocab-file and --merge-file",
    "GPTSentencePieceTokenizer": "--tokenizer-model (a SentencePiece .model)",
    "Llama2Tokenizer": "--tokenizer-model (a SentencePiece .model)",
}


def resolve_tokenizer(
    tokenizer: str | None,
    tokenizer_type: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    allow_download: bool = False,
) -> TokenizerFiles:
    """The tokenizer named by the command line: hp's `--tokenizer`, or Megatron's
    `--tokenizer-type` with `--tokenizer-model` or `--vocab-file`/`--merge-file`."""
    if tokenizer_type is not None and tokenizer_type not in MEGATRON_TOKENIZER_TYPES:
        known = ", ".join(f"{k} ({v})" for k, v in MEGATRON_TOKENIZER_TYPES.items())
        raise PreprocessError(f"--tokenizer-type {tokenizer_type}: hp-data reads {known}")
    if tokenizer_type not in (None, "GPT2BPETokenizer") and (vocab_file or merge_file):
        raise PreprocessError(
            f"--tokenizer-type {tokenizer_type} reads {MEGATRON_TOKENIZER_TYPES[tokenizer_type]}"
            ", not --vocab-file/--merge-file (GPT2BPETokenizer's)"
        )
    gpt2 = tokenizer_type == "GPT2BPETokenizer" or vocab_file or merge_file
    if gpt2:
        if not (vocab_file and merge_file) or tokenizer:
            raise PreprocessError(
                "a GPT-2 BPE tokenizer is --vocab-file vocab.json and --merge-file merges.txt, "
                "without --tokenizer"
            )
        return TokenizerFiles.from_gpt2_files(vocab_file, merge_file)
    if not tokenizer:
        raise PreprocessError(
            "name the tokenizer: --tokenizer (a tokenizer.json, a directory or a hub name), "
            "or --vocab-file and --merge-file"
        )
    files = TokenizerFiles.locate(tokenizer, allow_download)
    if tokenizer_type in ("GPTSentencePieceTokenizer", "Llama2Tokenizer") and not (
        files.sentencepiece
    ):
        raise PreprocessError(
            f"--tokenizer-type {tokenizer_type} reads a SentencePiece .model; "
            f"{files.tokenizer_json} is not one"
        )
    return files


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


@dataclass(frozen=True)
class VerifiedEngine:
    """The engine a run tokenizes with, chosen and checked once (`choose`): the tiktoken
    engine only where it gives `tokenizers`' ids, else the tokenizer's own encoder. The
    pipeline asks it for the engine, its notice and, after a document that the two engines
    part on, what to do (`fall_back`). A worker builds its tiktoken engine from it
    (`fast_engine`); the main process checks that engine's ids against `tokenizers`."""

    files: TokenizerFiles
    name: str  # the engine that runs: hf (tokenizers), sentencepiece or tiktoken
    requested: str = "auto"  # --tokenizer-engine
    probes: int = 0  # probe texts the tiktoken engine passed before the run
    notice: str | None = None  # the one line to warn with: why tiktoken is not used
    recipe: FastBPE | None = field(default=None, repr=False, compare=False)
    tokenizer_hash: str = ""  # xxh3-128 of the tokenizer.json: what a kept recipe must match
    recipe_file: str | None = None  # where the proven recipe is kept, for the workers

    @classmethod
    def choose(
        cls,
        files: TokenizerFiles,
        tokenizer: Tokenizer,
        requested: str = "auto",
        tokenizer_hash: str | None = None,
    ) -> VerifiedEngine:
        """`auto` takes `tiktoken` only for a tokenizer it converts, proves exact
        (`fast_bpe.prove`) and that gives the same ids on the probe set; `tiktoken` makes any
        failure an error; `hf` skips all three. Any engine refuses a tokenizer whose own ids
        are random (BPE dropout)."""
        if requested not in ENGINES:
            raise PreprocessError(f"--tokenizer-engine {requested!r}: choose {', '.join(ENGINES)}")
        dropout = getattr(getattr(tokenizer, "model", None), "dropout", None)
        if dropout:
            raise PreprocessError(
                f"{files.tokenizer_json}: model.dropout is {dropout:g}: BPE dropout gives other "
                "ids on every run; set it to null in the tokenizer file to preprocess with it"
            )
        reference = cls(files, reference_engine(tokenizer).name, requested)
        if requested == "hf":
            return reference
        source = files.tokenizer_json
        tokenizer_hash = tokenizer_hash or files.content_hash()  # the caller's, if it has it
        try:
            prove = functools.partial(fast_recipe, files, proven=True)
            recipe, kept = recipe_cache.proven_recipe(prove, tokenizer_hash)
            engine = recipe.engine()
        except (NotConvertible, ValueError, KeyError, TypeError, AttributeError) as exc:
            # Beyond NotConvertible: a description of an unexpected shape, or tiktoken refusing.
            if requested == "tiktoken":
                raise PreprocessError(
                    f"{source}: --tokenizer-engine tiktoken cannot reproduce this tokenizer: "
                    f"{exc}; use --tokenizer-engine auto or hf"
                ) from None
            if isinstance(exc, NotProven):  # byte-level BPE that looked fast: say why it is not
                notice = f"{source}: tiktoken is not exact for it: {exc}; using tokenizers"
                return replace(reference, notice=notice)
            return reference
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
            return replace(reference, notice=f"{message}; using tokenizers")
        return cls(
            files,
            "tiktoken",
            requested,
            probes=len(probes),
            recipe=recipe,
            tokenizer_hash=tokenizer_hash,
            recipe_file=kept,
        )

    @property
    def fast(self) -> bool:
        return self.name == "tiktoken"

    def fast_engine(self) -> TiktokenEngine:
        """The tiktoken engine in this process: a worker reads the recipe `choose` kept, or
        converts the tokenizer again (without the proof, which `choose` did for the run)."""
        recipe = self.recipe or recipe_cache.load(self.recipe_file, self.tokenizer_hash)
        return (recipe or fast_recipe(self.files)).engine()

    def fall_back(self, mismatch: str, rereadable: bool) -> VerifiedEngine:
        """`tokenizers` for a run whose tiktoken engine gave other ids on a document
        (`mismatch` says where), when the inputs can be read again and tiktoken was not
        asked for by name; else the one line that stops the run."""
        if self.requested == "tiktoken" or not rereadable:
            raise PreprocessError(f"{mismatch}; run again with --tokenizer-engine hf") from None
        notice = f"{mismatch}; tokenizing everything again with tokenizers"
        return VerifiedEngine(self.files, HFEngine.name, "hf", notice=notice)

    def __getstate__(self) -> dict[str, Any]:
        # Sent to workers without the recipe: their start-up data stays small (_WorkerSpec).
        return {**self.__dict__, "recipe": None}


def fast_recipe(files: TokenizerFiles, proven: bool = False) -> FastBPE:
    """The tiktoken engine's recipe for this tokenizer (raises NotConvertible); `proven`:
    only if `fast_bpe.prove` shows it exact (once per run, in `VerifiedEngine.choose`)."""
    if files.sentencepiece:
        raise NotConvertible("it is a SentencePiece model")
    return FastBPE.from_description(orjson.loads(files.read()), proven)


class SentencePieceModel:
    """A SentencePiece .model behind the part of `tokenizers.Tokenizer` hp uses. Text is
    encoded with `encode_as_ids`, as Megatron's GPTSentencePieceTokenizer and
    Llama2Tokenizer do; EOD and BOS are the model's eos and bos ids."""

    def __init__(self, path: str) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise PreprocessError(
                f"{path}: a SentencePiece model needs sentencepiece: "
                "pip install 'hp-data[sentencepiece]'"
            ) from None
        self.path = path
        try:
            self.processor = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as exc:
            raise PreprocessError(f"{path}: not a SentencePiece model: {first_line(exc)}") from None

    def __getstate__(self) -> dict[str, str]:  # sent to workers as its path
        return {"path": self.path}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.processor.get_piece_size()

    def token_to_id(self, token: str) -> int | None:
        found = self.processor.piece_to_id(token)
        return found if self.processor.id_to_piece(found) == token else None

    def special(self, role: str) -> int:
        found = self.processor.eos_id() if role == "eos" else self.processor.bos_id()
        if found < 0:
            option = "--eod-token" if role == "eos" else "--bos-token"
            raise PreprocessError(
                f"{self.path}: the model has no {role} piece; name one with {option}"
            )
        return found

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return {}

    def decode(self, ids: list[int]) -> str:
        return self.processor.decode(ids)


class SentencePieceEngine:
    """SentencePiece's own batch encoder, on one thread."""

    name = "sentencepiece"

    def __init__(self, model: SentencePieceModel) -> None:
        self.processor = model.processor

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.processor.encode(list(texts), out_type=int, num_threads=1)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        count = int(lengths.sum())
        return np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=count), lengths


def reference_engine(tokenizer: Tokenizer | SentencePieceModel) -> Engine:
    """The tokenizer's own encoder: what every other engine is held to."""
    if isinstance(tokenizer, SentencePieceModel):
        return SentencePieceEngine(tokenizer)
    return HFEngine(tokenizer)


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
