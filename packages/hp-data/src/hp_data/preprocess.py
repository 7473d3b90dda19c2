"""Corpus files -> tokens -> one `.bin`/`.idx` pair: the single-process first version.

Each JSON line becomes one document of one sequence, as Megatron's `preprocess_data.py`
writes it. Documents that tokenize to nothing are skipped and counted, not written as empty
documents. The output appears at its final path only when the whole run succeeded.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from hp_data.errors import PreprocessError
from hp_data.format.builder import IndexedDatasetBuilder
from hp_data.format.dtypes import DTypeLike, as_token_dtype, optimal_dtype
from hp_data.format.header import bin_path, idx_path
from hp_data.progress import Progress
from hp_data.readers import read_jsonl, total_size
from hp_data.tokenize import encode_batch, eod_id, load_tokenizer, vocab_size


@dataclass
class PreprocessSummary:
    """What a preprocessing run read and wrote."""

    output_prefix: str
    dtype: str
    documents_in: int
    documents_written: int
    empty_skipped: int
    tokens: int
    output_bytes: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "tokens_per_second": round(self.tokens_per_second, 1)}


def preprocess(
    inputs: list[str],
    out_prefix: str,
    tokenizer_path: str,
    json_key: str = "text",
    append_eod: bool = False,
    eod_token: str | None = None,
    dtype: DTypeLike | None = None,
    batch_size: int = 1024,
    show_progress: bool = True,
) -> PreprocessSummary:
    """Tokenize the JSONL `inputs` in order into `out_prefix.bin`/`.idx`."""
    started = time.perf_counter()
    if not inputs:
        raise PreprocessError("no input files given")
    tokenizer = load_tokenizer(tokenizer_path)
    vocabulary = vocab_size(tokenizer)
    token_dtype = optimal_dtype(vocabulary) if dtype is None else as_token_dtype(dtype)
    if token_dtype.kind in "iu" and vocabulary - 1 > np.iinfo(token_dtype).max:
        raise PreprocessError(
            f"--dtype {token_dtype} cannot hold ids of a {vocabulary}-token vocabulary; "
            f"use {optimal_dtype(vocabulary)} or wider"
        )
    eod = eod_id(tokenizer, eod_token) if append_eod else None

    progress = Progress(total_size(inputs), "preprocess", enabled=show_progress)
    documents_in = written = empty = tokens = 0
    bytes_before = 0
    with IndexedDatasetBuilder(out_prefix, token_dtype) as builder:
        for path in inputs:
            for texts, bytes_read in read_jsonl(path, json_key, batch_size):
                ids = [doc for doc in encode_batch(tokenizer, texts) if doc]
                documents_in += len(texts)
                empty += len(texts) - len(ids)
                if eod is not None:
                    for doc in ids:
                        doc.append(eod)
                lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
                count = int(lengths.sum())
                flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=count)
                builder.add_documents(flat, lengths)
                written += len(ids)
                tokens += count
                progress.update(bytes_before + bytes_read, docs=documents_in, tokens=tokens)
            bytes_before += os.path.getsize(path)
    progress.close()
    output_bytes = os.path.getsize(bin_path(out_prefix)) + os.path.getsize(idx_path(out_prefix))
    return PreprocessSummary(
        output_prefix=builder.prefix,
        dtype=str(token_dtype),
        documents_in=documents_in,
        documents_written=written,
        empty_skipped=empty,
        tokens=tokens,
        output_bytes=output_bytes,
        seconds=round(time.perf_counter() - started, 3),
    )
