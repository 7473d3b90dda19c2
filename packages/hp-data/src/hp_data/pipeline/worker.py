"""The worker side of a preprocess run: each worker process parses, checks and tokenizes
chunks; `Workers` runs them (a process pool, or one worker in this process) and gives
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
from hp_data.tokenize import Engine, VerifiedEngine, frame_documents, reference_engine

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


_Sample = tuple[list[str], tuple[np.ndarray, np.ndarray]]  # texts, and their (ids, lengths)


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
    # The fast engine's ids of a sample of the chunk's texts, per key, and the sample's line
    # offsets; the main process checks them against tokenizers' (`_verify`) and drops them.
    samples: list[_Sample] = field(default_factory=list)
    sample_lines: list[int] = field(default_factory=list)
    verified: int = 0  # documents whose fast-engine ids were checked against tokenizers
    mismatch: tuple[int, str] | None = None  # (line offset, what differs), when one did not
    dropped: np.ndarray | None = None  # line offsets that made no document (before dedup)
    reasons: np.ndarray | None = None  # and why (provenance.REASONS)


_worker: dict[str, Any] = {}


def _start_worker() -> None:
    # One tokenizer thread per worker process: the pool is the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tiktoken  # noqa: F401  (while the main process prepares the run)


def _init_worker(spec: _WorkerSpec, tokenizer: Any = None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker["spec"] = spec
    set_timeout(spec.remote_timeout)
    if spec.engine.fast:  # checked in the main process, which holds the tokenizer (_verify)
        _worker["engine"] = spec.engine.fast_engine()
    else:
        _worker["engine"] = reference_engine(tokenizer or spec.engine.files.load())


def _encode(
    parsed: Parsed, spec: _WorkerSpec, dtype: np.dtype, chosen: np.ndarray
) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[_Sample]]:
    """Each key's (tokens, lengths), and, from the fast engine, each key's `chosen` texts
    with their ids, for the main process to check against tokenizers'."""
    engine = _worker["engine"]
    raw = [engine.encode(texts) for texts in parsed.texts]
    samples = []
    if spec.engine.fast:
        for texts, (ids, lengths) in zip(parsed.texts, raw, strict=True):
            samples.append(([texts[i] for i in chosen], pick(ids, lengths, chosen)))
    return _frame(raw, spec, dtype), samples


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


def _work(chunk: Chunk, first: bool = False, spec: _WorkerSpec | None = None) -> _Result:
    if spec is not None and spec != _worker.get("spec"):  # a worker's first chunk of a run
        _init_worker(spec)
    spec = _worker["spec"]

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
        encoded, result.samples = _encode(parsed, spec, dtype, chosen)
    except (TypeError, UnicodeEncodeError):  # a text that is not valid Unicode is refused
        parsed = read(spec.stop_at_invalid, check_unicode=True)
        result.invalid = parsed.invalid
        if spec.stop_at_invalid:
            return result
        chosen = chosen[chosen < len(parsed.texts[0])]
        encoded, result.samples = _encode(parsed, spec, dtype, chosen)
    if result.samples:
        result.sample_lines = [parsed.offsets[i] for i in chosen]  # type: ignore[index]
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


class Workers:
    """The run's worker processes, started (`start`) before the main process loads the
    tokenizer and chooses the engine, so that each one's start-up (a fresh interpreter
    importing hp-data, about 0.4 s) overlaps that; each takes the run's spec with every
    chunk and builds its engine for the first. With one worker, chunks run in this process."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the processes, without waiting for them."""
        if self.count > 1 and self.pool is None:
            # An executor, not multiprocessing.Pool: a worker that dies (killed, out of memory,
            # or failing to start) breaks it, where a Pool would wait for its result forever.
            context = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(self.count, context, initializer=_start_worker)
            for _ in range(self.count):  # the executor starts a process per task not taken
                self.pool.submit(int)

    def results(
        self, work: Iterator[Chunk], spec: _WorkerSpec, tokenizer: Any
    ) -> Iterator[_Result]:
        """Results of every chunk, in order; at most a few chunks in flight per worker. The
        fast engine's ids are checked here, with the main process's `tokenizer`, on the first
        documents of the first chunk and on a sample of every chunk."""
        reference = reference_engine(tokenizer)
        if self.count <= 1:
            _init_worker(spec, tokenizer)
            for number, chunk in enumerate(work):
                yield _verify(_work(chunk, number == 0), reference)
            return
        self.start()
        assert self.pool is not None
        pending: deque[Future[_Result]] = deque()
        try:
            for number, chunk in enumerate(work):
                pending.append(self.pool.submit(_work, chunk, number == 0, spec))
                if len(pending) >= 2 * self.count + 1:
                    yield _verify(pending.popleft().result(), reference)
            while pending:
                yield _verify(pending.popleft().result(), reference)
        except BrokenProcessPool:
            raise PreprocessError(
                "a tokenizer worker process died (killed, out of memory, or unable to start: "
                "spawned workers re-run the calling script, so call hp-data under "
                "`if __name__ == '__main__':`, or use one worker)"
            ) from None
        finally:  # a run that stops, or starts over with tokenizers, drops what is queued
            for future in pending:
                future.cancel()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _verify(result: _Result, reference: Engine) -> _Result:
    """`result` with its sample checked against `reference`: how many documents were, and
    the first that the fast engine gave other ids for (line offset, what differs)."""
    for texts, ids in result.samples:
        found = compare(texts, reference.encode(texts), ids)
        if found is not None:
            result.mismatch = (result.sample_lines[found.index], found.describe())
            break
    result.verified = len(result.sample_lines)
    result.samples, result.sample_lines = [], []
    return result


def refuse_reentry() -> None:
    """Refuse a call made while this process, a spawned worker, re-runs the parent's script:
    a script without a `__main__` guard would otherwise start a run inside every worker."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise PreprocessError(
            "hp-data was called while a worker process started: spawned workers re-run the "
            "calling script, so call hp-data under `if __name__ == '__main__':`"
        )
