"""Load a `tokenizers` model and turn texts into token ids exactly as `tokenizers` does."""

from __future__ import annotations

import os
from collections.abc import Sequence

from tokenizers import Tokenizer

from hp_data.errors import PreprocessError

# Tried in order when no --eod-token is given: GPT-2/NeoX, Llama-3, SentencePiece-style.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A tokenizer from a `tokenizer.json` file or a directory that holds one."""
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise PreprocessError(f"{file}: no such tokenizer file; pass a tokenizer.json or its dir")
    try:
        return Tokenizer.from_file(file)
    except Exception as exc:  # tokenizers raises plain Exception for bad JSON
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PreprocessError(f"{file}: not a valid tokenizers model: {reason}") from None


def vocab_size(tokenizer: Tokenizer) -> int:
    """The number of ids the tokenizer can produce, added tokens included."""
    return tokenizer.get_vocab_size(with_added_tokens=True)


def eod_id(tokenizer: Tokenizer, token: str | None = None) -> int:
    """The id of `token`, or of the first known end-of-document token in the vocabulary."""
    candidates = (token,) if token else EOD_CANDIDATES
    for candidate in candidates:
        found = tokenizer.token_to_id(candidate)
        if found is not None:
            return found
    if token:
        raise PreprocessError(f"--eod-token {token!r} is not in the tokenizer's vocabulary")
    raise PreprocessError(
        f"the tokenizer has none of {', '.join(EOD_CANDIDATES)}; "
        "name its end token with --eod-token"
    )


def encode_batch(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Ids of each text, without the tokenizer's own special tokens (as Megatron tokenizes)."""
    return [
        encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    ]
