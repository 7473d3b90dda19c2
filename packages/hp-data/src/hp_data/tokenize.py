"""Load a `tokenizers` model and turn texts into token ids exactly as `tokenizers` does."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
from tokenizers import Tokenizer

from hp_data.errors import PreprocessError

# Tried in order when neither --eod-token nor tokenizer_config.json names the token.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|bos|>")


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


def encode_documents(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    dtype: np.dtype,
    bos: int | None = None,
    eod: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of every text back to back, and each text's token count.

    Ids are `tokenizer.encode(text, add_special_tokens=False).ids`, with `bos` before and `eod`
    after every text that yields any token (Megatron adds neither to an empty document).
    """
    ids = [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    content = int(lengths.sum())
    body = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=content)
    extra = (bos is not None) + (eod is not None)
    if extra == 0 or content == 0:
        return body.astype(dtype), lengths
    # Spread each document's ids apart to make room for BOS/EOD, vectorised.
    nonempty = lengths > 0
    out_lengths = lengths + extra * nonempty
    ends = np.cumsum(out_lengths)
    starts = ends - out_lengths
    tokens = np.empty(int(ends[-1]), dtype=np.int64)
    shift = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    tokens[np.arange(content) + shift + (bos is not None)] = body
    if bos is not None:
        tokens[starts[nonempty]] = bos
    if eod is not None:
        tokens[ends[nonempty] - 1] = eod
    return tokens.astype(dtype), out_lengths
