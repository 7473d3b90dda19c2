"""The worker side of a preprocess run: each worker process parses, checks and tokenizes
chunks; `_results` runs them (a process pool, or one worker in this process) and gives
the results back in order."""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hp_data.dedup import hash_texts
from hp_data.errors import PreprocessError
from hp_data.fast_bpe import compare, pick
from hp_data.provenance import (
    BLANK,
    EMPTY,
    INVALID,
)
from hp_data.readers.parsing import read_chunk
from hp_data.readers.units import KEYS_OPTION, MAX_DOCUMENT_CHARS, Chunk, Parsed
from hp_data.remote import DEFAULT_TIMEOUT, set_timeout
from hp_data.tokenize import VerifiedEngine, frame_documents

VERIFY_EVERY = 1000  # the fast engine's ids are checked on one document in this many

VERIFY_FIRST = 200  # and on each of the run's first documents


@dataclass(frozen=True)
class _WorkerSpec:
    # Small on purpose: a spawned worker that dies before reading all of its start-up data
    # (a script re-run without a __main__ guard) would block the parent's write forever.
    engine: VerifiedEngine  # with the tokenizer's files; each worker builds its encoders
    keys: tuple[str, ...]
    dtype: str
    bos: int | None
    eod: int | None
    keep_empty: bool
    dedup: bool
    stop_at_invalid: bool
    keys_option: str = KEYS_OPTION
    verify_every: int = VERIFY_EVERY
    max_chars: int | None = MAX_DOCUMENT_CHARS
    remote_timeout: float = DEFAULT_TIMEOUT


class EngineMismatch(PreprocessError):
    """The fast engine gave other ids than tokenizers on a document of the run."""


@dataclass
class _Result:
    unit: int
    last: bool
    lines: int
    records: int
    input_bytes: int
    invalid: list[tuple[int, str, str]]
    empty: int = 0
    tokens: list[np.ndarray] = field(default_factory=list)  # per key
    lengths: list[np.ndarray] = field(default_factory=list)  # per key, per kept record
    hashes: np.ndarray | None = None  # (kept records, 2) uint64
    verified: int = 0  # documents whose fast-engine ids were checked against tokenizers
    mismatch: tuple[int, str] | None = None  # (line offset, what differs), when one did not
    dropped: np.ndarray | None = None  # line offsets that made no document (before dedup)
    reasons: np.ndarray | None = None  # and why (provenance.REASONS)


_worker: dict[str, Any] = {}


def _init_worker(spec: _WorkerSpec, tokenizer: Any = None) -> None:
    # One tokenizer thread per worker process: the pool is the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    _worker["spec"] = spec
    set_timeout(spec.remote_timeout)
    tokenizer = tokenizer or spec.engine.files.load()
    _worker["engine"], _worker["reference"] = spec.engine.engines(tokenizer)


def _encode(
    parsed: Parsed, spec: _WorkerSpec, dtype: np.dtype, chosen: np.ndarray | None
) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[int, str] | None]:
    """Each key's (tokens, lengths), and where the fast engine's ids part from tokenizers' on
    the `chosen` texts (text index, what differs), if they do; then the chunk is encoded
    again with tokenizers, so that what is returned is always tokenizers' ids."""
    engine, reference = _worker["engine"], _worker["reference"]
    raw = [engine.encode(texts) for texts in parsed.texts]
    if chosen is not None and engine is not reference:
        for texts, (ids, lengths) in zip(parsed.texts, raw, strict=True):
            sample = [texts[i] for i in chosen]
            found = compare(sample, reference.encode(sample), pick(ids, lengths, chosen))
            if found is not None:
                raw = [reference.encode(texts) for texts in parsed.texts]
                return _frame(raw, spec, dtype), (int(chosen[found.index]), found.describe())
    return _frame(raw, spec, dtype), None


def _frame(
    raw: list[tuple[np.ndarray, np.ndarray]], spec: _WorkerSpec, dtype: np.dtype
) -> list[tuple[np.ndarray, np.ndarray]]:
    return [frame_documents(ids, lengths, dtype, spec.bos, spec.eod) for ids, lengths in raw]


def _sample(chunk: Chunk, count: int, every: int) -> np.ndarray:
    """Which of a chunk's `count` texts to check: one in `every`, from a position drawn
    for this chunk, so that over a run every position in a chunk is checked."""
    if every == 1:
        return np.arange(count)
    first = np.random.default_rng([chunk.unit, chunk.start, count]).integers(every)
    return np.arange(first, count, every)


def _work(chunk: Chunk, first: bool = False) -> _Result:
    spec: _WorkerSpec = _worker["spec"]

    def read(stop_at_invalid: bool, check_unicode: bool = False, **more: bool) -> Parsed:
        """The chunk read (again) with the run's keys, their option's name and length limit."""
        return read_chunk(
            chunk, spec.keys, stop_at_invalid, check_unicode, keys_option=spec.keys_option,
            max_chars=spec.max_chars, with_offsets=True, **more,
        )  # fmt: skip

    parsed = read(spec.stop_at_invalid)
    result = _Result(
        chunk.unit, chunk.last, parsed.lines, parsed.records, chunk.input_bytes, parsed.invalid
    )
    if spec.stop_at_invalid and parsed.invalid:
        # The run stops here: read again to report the first problem, a lone surrogate too.
        result.invalid = read(True, check_unicode=True).invalid
        return result
    dtype = np.dtype(spec.dtype)
    count = len(parsed.texts[0]) if parsed.texts else 0
    chosen = _sample(chunk, count, spec.verify_every)
    if first:
        chosen = np.union1d(np.arange(min(count, VERIFY_FIRST)), chosen)
    try:
        encoded, mismatch = _encode(parsed, spec, dtype, chosen)
    except (TypeError, UnicodeEncodeError):  # a text that is not valid Unicode is refused
        parsed = read(spec.stop_at_invalid, check_unicode=True)
        result.invalid = parsed.invalid
        if spec.stop_at_invalid:
            return result
        chosen = chosen[chosen < len(parsed.texts[0])]
        encoded, mismatch = _encode(parsed, spec, dtype, chosen)
    if _worker["engine"] is not _worker["reference"]:
        result.verified = len(chosen)
    if mismatch is not None:
        result.mismatch = (parsed.offsets[mismatch[0]], mismatch[1])  # type: ignore[index]
    keep = np.ones(len(parsed.texts[0]), dtype=bool)
    if not spec.keep_empty:
        keep = np.logical_or.reduce([lengths > 0 for _, lengths in encoded]) if encoded else keep
    result.empty = int((~keep).sum())
    result.dropped, result.reasons = _dropped(parsed, keep)
    for tokens, lengths in encoded:
        if result.empty:
            tokens, lengths = tokens[np.repeat(keep, lengths)], lengths[keep]
        result.tokens.append(tokens)
        result.lengths.append(lengths)
    if spec.dedup:
        result.hashes = hash_texts(parsed.texts)[keep]
    return result


def _dropped(parsed: Parsed, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The line offsets of a chunk that made no document, sorted, and why: blank, invalid
    (skipped), or empty (`keep` False); what provenance needs to map documents to lines."""
    offsets = np.asarray(parsed.offsets, dtype=np.int64)
    if len(offsets) == parsed.lines and keep.all():
        return np.zeros(0, np.int64), np.zeros(0, np.uint8)
    reasons = np.full(parsed.lines, BLANK, np.uint8)
    reasons[[offset for offset, _, _ in parsed.invalid]] = INVALID
    reasons[offsets[~keep]] = EMPTY
    made = np.zeros(parsed.lines, dtype=bool)
    made[offsets[keep]] = True
    dropped = np.flatnonzero(~made)
    return dropped, reasons[dropped]


def _results(
    work: Iterator[Chunk], spec: _WorkerSpec, workers: int, tokenizer: Any
) -> Iterator[_Result]:
    """Results of every chunk, in order; at most a few chunks in flight per worker. One
    worker runs here, with the main process's `tokenizer`. The fast engine is checked on
    the first documents of the first chunk, and on a sample of every chunk."""
    if workers <= 1:
        _init_worker(spec, tokenizer)
        for number, chunk in enumerate(work):
            yield _work(chunk, number == 0)
        return
    # An executor, not multiprocessing.Pool: a worker that dies (killed, out of memory, or
    # failing to start) breaks it, where a Pool would wait for its result forever.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, context, initializer=_init_worker, initargs=(spec,))
    try:
        pending: deque[Future[_Result]] = deque()
        for number, chunk in enumerate(work):
            pending.append(pool.submit(_work, chunk, number == 0))
            if len(pending) >= 2 * workers + 1:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise PreprocessError(
            "a tokenizer worker process died (killed, out of memory, or unable to start: "
            "spawned workers re-run the calling script, so call hp-data under "
            "`if __name__ == '__main__':`, or use one worker)"
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def refuse_reentry() -> None:
    """Refuse a call made while this process, a spawned worker, re-runs the parent's script:
    a script without a `__main__` guard would otherwise start a run inside every worker."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise PreprocessError(
            "hp-data was called while a worker process started: spawned workers re-run the "
            "calling script, so call hp-data under `if __name__ == '__main__':`"
        )
