"""Corpus files -> tokens -> `.bin`/`.idx`: the parallel, resumable pipeline.

The main process cuts every work unit (an input, or a part of one: plan.py) into chunks, in
order; a pool of worker processes parses, checks and tokenizes chunks (one single-threaded
tokenizer each); the main process takes the results back in order, drops exact duplicates,
and appends them to the unit's own dataset in a work directory beside the output. A finished
unit is finalized and recorded in a manifest; a rerun with the same arguments reuses every
finished unit up to the first unfinished one. When all units are done they are concatenated
into the final output, atomically, and the work directory is removed.

The output depends only on the inputs and the options: not on `--workers`, the chunking,
or where an earlier run was killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import shutil
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xxhash

from hp_data.dedup import HashSet, hash_texts
from hp_data.errors import PreprocessError
from hp_data.fast_bpe import compare, pick
from hp_data.format.builder import IndexedDatasetBuilder, finalize_together
from hp_data.format.dtypes import DTypeLike, as_token_dtype, optimal_dtype
from hp_data.format.header import bin_path, idx_path, prefix_of
from hp_data.format.metadata import SCHEMA as METADATA_SCHEMA
from hp_data.fs import AtomicFile, committing, write_json
from hp_data.plan import plan_units
from hp_data.progress import Progress, human
from hp_data.provenance import (
    BLANK,
    DUPLICATE,
    EMPTY,
    FIRST_RECORD,
    INVALID,
    UNKNOWN,
    Provenance,
    input_entry,
)
from hp_data.readers import (
    KEYS_OPTION,
    MAX_DOCUMENT_CHARS,
    STDIN,
    Chunk,
    Parsed,
    WorkUnit,
    chunks,
    discover,
    location,
    read_chunk,
)
from hp_data.redact import redact_data
from hp_data.remote import DEFAULT_TIMEOUT, check_unchanged, set_timeout
from hp_data.shards import ShardTask
from hp_data.tokenize import TokenizerFiles, VerifiedEngine, frame_documents, vocab_size
from hp_data.version import __version__

MANIFEST_VERSION = 1
INVALID_EXAMPLES = 5
VERIFY_EVERY = 1000  # the fast engine's ids are checked on one document in this many
VERIFY_FIRST = 200  # and on each of the run's first documents


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class PreprocessOptions:
    """Everything besides inputs, output and tokenizer; the defaults are the CLI's."""

    json_keys: tuple[str, ...] = ("text",)
    keys_option: str = KEYS_OPTION  # how messages name the setting of json_keys
    append_eod: bool = False
    eod_token: str | None = None
    add_bos: bool = False
    bos_token: str | None = None
    dtype: DTypeLike | None = None
    workers: int = field(default_factory=default_workers)
    skip_invalid: bool = False
    keep_empty: bool = False
    dedup: str | None = None  # None or "exact"
    input_format: str | None = None
    hf_split: str = "train"  # which split of an HF dataset (the CLI's --split)
    chunk_bytes: int = 1 << 20
    show_progress: bool = True
    unit_bytes: int | None = None  # work-unit size (plan.py); None: its default
    units: int | None = None  # or about this many work units
    num_shards: int = 1  # with shard_index: process one of num_shards groups of units
    shard_index: int | None = None
    tokenizer_engine: str = "auto"  # auto, hf or tiktoken (tokenize.ENGINES)
    allow_download: bool = False  # a hub tokenizer not in the local cache may be fetched
    megatron_names: bool = False  # PREFIX_{key}_document for every key, as Megatron names them
    verify: bool = False  # check the fast engine on every document, not one in VERIFY_EVERY
    max_document_chars: int | None = MAX_DOCUMENT_CHARS  # a longer text is invalid; None: any
    remote_timeout: float = DEFAULT_TIMEOUT  # seconds a remote request may wait (remote.py)


def megatron_keys(values: Sequence[str]) -> tuple[str, ...]:
    """`json_keys` from Megatron's `--json-keys text title` (a key a value) and hp's
    `--json-keys text,title` (several a value, by commas or spaces) alike, in order."""
    return tuple(key for value in values for key in value.replace(",", " ").split())


def output_prefixes(
    out_prefix: str, keys: tuple[str, ...], megatron_names: bool = False
) -> dict[str, str]:
    """`PREFIX` for one key; Megatron's `PREFIX_{key}_document` for each of several, or for
    every key with `megatron_names` (what `--output-prefix` gives)."""
    if not os.path.basename(prefix_of(out_prefix)):
        raise PreprocessError(
            f"--out {out_prefix!r}: the prefix needs a file name, e.g. out/corpus "
            "(writes out/corpus.bin and out/corpus.idx)"
        )
    out_prefix = prefix_of(out_prefix)
    if len(keys) == 1 and not megatron_names:
        return {keys[0]: out_prefix}
    return {key: f"{out_prefix}_{key}_document" for key in keys}


# -- the workers ----------------------------------------------------------------------------


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


# -- the main process -----------------------------------------------------------------------


@dataclass
class _UnitStats:
    records: int = 0
    written: int = 0
    empty: int = 0
    duplicates: int = 0
    invalid: dict[str, int] = field(default_factory=dict)
    invalid_examples: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    max_token_id: dict[str, int] = field(default_factory=dict)  # per key with any token
    lines: int = 0
    verified: int = 0  # documents whose fast-engine ids were checked against tokenizers


class _WorkDir:
    """The hidden directory beside the output: finished units, their hashes, a manifest (its
    `shard000000_KEY` names and `"shards"` list are a stored format, read by a resumed run)."""

    def __init__(self, out_prefix: str, config: str) -> None:
        directory, name = os.path.split(os.path.abspath(out_prefix))
        self.path = os.path.join(directory, f".{name}.hp-preprocess")
        os.makedirs(self.path, exist_ok=True)
        self._lock = open(os.path.join(self.path, "lock"), "w")  # noqa: SIM115
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PreprocessError(
                f"{out_prefix}: another hp-data preprocess is writing this output"
            ) from None
        self.config = config
        self.manifest = self._read_manifest()

    def _read_manifest(self) -> dict[str, Any]:
        fresh = {"version": MANIFEST_VERSION, "config": self.config, "shards": []}
        try:
            with open(os.path.join(self.path, "manifest.json"), encoding="utf-8") as stream:
                manifest = json.load(stream)
        except (OSError, ValueError):
            return fresh
        if manifest.get("version") != MANIFEST_VERSION or manifest.get("config") != self.config:
            return fresh
        return manifest

    def unit_prefix(self, index: int, key: str) -> str:
        return os.path.join(self.path, f"shard{index:06d}_{key}")

    def hashes_path(self, index: int) -> str:
        """Raw (n, 2) uint64 hashes of the records a finished unit kept."""
        return os.path.join(self.path, f"shard{index:06d}.hashes")

    def skipped_path(self, index: int) -> str:
        """Raw int64 line offsets of a finished unit's records that made no document, then
        a uint8 reason each (provenance.py)."""
        return os.path.join(self.path, f"shard{index:06d}.skipped")

    def reusable(self, units: list[WorkUnit], keys: tuple[str, ...]) -> int:
        """How many leading units a previous run finished with these same inputs."""
        done = 0
        for unit, record in zip(units, self.manifest["shards"], strict=False):
            complete = os.path.exists(self.skipped_path(done)) and all(
                os.path.exists(path(self.unit_prefix(done, k)))
                for k in keys
                for path in (bin_path, idx_path)
            )
            if record["identity"] != unit.identity or not unit.reusable or not complete:
                break
            done += 1
        self.manifest["shards"] = self.manifest["shards"][:done]
        return done

    def record(self, unit: WorkUnit, stats: _UnitStats) -> None:
        self.manifest["shards"].append({"identity": unit.identity, "stats": stats.__dict__})
        target = os.path.join(self.path, "manifest.json")
        write_json(target, redact_data(self.manifest))  # no credential is ever stored

    def remove(self) -> None:
        # The manifest goes first: a kill inside rmtree leaves nothing a rerun would reuse.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, "manifest.json"))
        self._lock.close()
        shutil.rmtree(self.path, ignore_errors=True)

    def release(self) -> None:
        self._lock.close()


def _config_hash(tokenizer_hash: str, spec: _WorkerSpec, options: PreprocessOptions) -> str:
    """Everything besides the inputs that changes the output; a mismatch starts over."""
    described = {
        "tokenizer": tokenizer_hash,
        "keys": spec.keys,
        "dtype": spec.dtype,
        "bos": spec.bos,
        "eod": spec.eod,
        "keep_empty": spec.keep_empty,
        "dedup": spec.dedup,
        "skip_invalid": not spec.stop_at_invalid,
        "input_format": options.input_format,
        "split": options.hf_split,  # the stored key stays
        "max_chars": spec.max_chars,
    }
    return xxhash.xxh3_128_hexdigest(json.dumps(described, sort_keys=True).encode())


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


@dataclass
class PreprocessSummary:
    """What a run read and wrote; `as_dict()` is the `--json` form."""

    outputs: dict[str, str]
    dtype: str
    workers: int
    shards: int  # the work units of this run (the --json name stays)
    resumed_shards: int  # of them, finished by an earlier run
    documents_in: int
    documents_written: int
    skipped: dict[str, Any]
    invalid_examples: list[str]
    tokens: int
    tokens_by_key: dict[str, int]
    output_bytes: int
    input_bytes: int
    seconds: float
    dedup_hash_set_bytes: int | None = None
    engine: str = "hf"  # the engine that ran: hf (tokenizers), tiktoken or sentencepiece
    probe_texts: int = 0  # texts the fast engine was checked on before the run
    verified_documents: int = 0  # and documents during it
    tokenizer: dict[str, str] | None = None  # what was named, the file used, its xxh3-128

    def as_dict(self) -> dict[str, Any]:
        seconds = max(self.seconds, 1e-9)
        return {
            **self.__dict__,
            "tokens_per_second": round(self.tokens / seconds, 1),
            "documents_per_second": round(self.documents_in / seconds, 1),
            "mb_per_second": round(self.input_bytes / seconds / 1e6, 2),
        }


def check_shardable(found: Sequence[WorkUnit]) -> None:
    """Refuse inputs that a run split over machines cannot share: each machine reads and pins
    the inputs for itself, and only a strong validator (`Pin.strong`) shows that all of them
    read the same version of an object; else shards of two versions would merge unnoticed."""
    if any(s.path == STDIN for s in found):
        raise PreprocessError("standard input (-) cannot be split over shards; give files")
    for source in found:
        if not source.reusable:
            raise PreprocessError(
                f"{source.path}: no ETag, version id or content hash, so the machines of a "
                "split run cannot tell that they all read the same version of it; run it "
                "in one piece (no --num-shards, --ray), or serve it from a store that gives ETags"
            )


def preprocess(
    inputs: list[str],
    out_prefix: str,
    tokenizer_path: str | TokenizerFiles,
    options: PreprocessOptions | None = None,
) -> PreprocessSummary:
    """Tokenize `inputs` into `out_prefix` (see the module docstring for the guarantees).
    The tokenizer is a path or hub name (`TokenizerFiles.locate`) or one already located."""
    options = options or PreprocessOptions()
    refuse_reentry()
    started = time.perf_counter()
    job = _prepare(inputs, out_prefix, tokenizer_path, options)
    if isinstance(job, PreprocessSummary):  # a shard that an earlier run finished
        return job
    run = _tokenize(job)
    return _commit(job, run, started)


@dataclass
class _Job:
    """What `_prepare` decided, for `_tokenize` and `_commit`: the units, the outputs, the
    tokenizer and its engine, and how much of an earlier run is taken up."""

    options: PreprocessOptions
    units: list[WorkUnit]  # the units this run tokenizes, in order
    outputs: dict[str, str]  # key -> final prefix
    dtype: np.dtype
    tokenizer: Any  # loaded once here; the in-process worker uses it too
    spec: _WorkerSpec
    metadata: dict[str, Any]  # what made the outputs, for their PREFIX.hp.json
    work_prefix: str  # what the work directory is named after: the output, or the shard
    config: str  # _config_hash
    task: ShardTask | None = None  # one shard of a run split over machines
    workdir: _WorkDir = field(init=False)
    resumed: int = 0  # leading units an earlier run finished
    seen: HashSet | None = None  # hashes of the records kept so far, with --dedup exact

    def resume(self) -> None:
        """Open the work directory and take up the units an earlier run finished there."""
        self.workdir = _WorkDir(self.work_prefix, self.config)
        self.resumed = self.workdir.reusable(self.units, self.spec.keys)
        self.seen = seen = HashSet() if self.spec.dedup else None
        for index in range(self.resumed if seen is not None else 0):
            with open(self.workdir.hashes_path(index), "rb") as stream:
                while len(block := np.fromfile(stream, dtype=np.uint64, count=2 << 20)):
                    seen.add_new(block.reshape(-1, 2))

    def chunks(self) -> Iterator[Chunk]:
        """The chunks of every unit not done yet, in order."""
        options, units = self.options, self.units
        cache = os.path.join(self.workdir.path, "hf-cache")
        quiet = not options.show_progress
        for i in range(self.resumed, len(units)):
            yield from chunks(
                i, units[i], self.spec.keys, options.chunk_bytes, options.hf_split, cache, quiet,
                options.keys_option,
            )  # fmt: skip


def _check_options(options: PreprocessOptions) -> tuple[str, ...]:
    """The run's keys, once the options that need no input are checked."""
    keys = tuple(options.json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise PreprocessError(
            f"{options.keys_option} needs distinct keys, got {' '.join(keys) or 'none'}"
        )
    if options.dedup not in (None, "exact"):
        raise PreprocessError(f"--dedup {options.dedup!r} is not supported; use 'exact'")
    if options.workers < 1:
        raise PreprocessError("--workers must be at least 1")
    return keys


def _plan(inputs: list[str], options: PreprocessOptions) -> list[WorkUnit]:
    """The inputs found, pinned and cut into the plan's units (plan.py)."""
    set_timeout(options.remote_timeout)
    found = discover(inputs, options.input_format)
    sharded = options.shard_index is not None
    if options.num_shards < 1 or (sharded and not 0 <= options.shard_index < options.num_shards):
        raise PreprocessError(
            f"--shard-index {options.shard_index} of --num-shards {options.num_shards}: "
            "give 0 <= index < shards"
        )
    if (options.unit_bytes is not None and options.unit_bytes < 1) or (
        options.units is not None and options.units < 1
    ):
        raise PreprocessError("--units and --unit-mb must be positive")
    if sharded:
        check_shardable(found)
    return plan_units(found, options.unit_bytes, options.units, options.num_shards)


def _warn(engine: VerifiedEngine) -> None:
    """The engine's notice, as a warning from the caller of `preprocess`."""
    if engine.notice is not None:
        warnings.warn(engine.notice, stacklevel=4)


def _prepare(
    inputs: list[str],
    out_prefix: str,
    tokenizer_path: str | TokenizerFiles,
    options: PreprocessOptions,
) -> _Job | PreprocessSummary:
    """Check the options, plan the inputs, choose the engine and take up an earlier run's
    work: whatever refuses the run does so before its first token. A shard that an earlier
    run finished is not done again: its summary is returned."""
    keys = _check_options(options)
    units = _plan(inputs, options)
    files = (
        tokenizer_path
        if isinstance(tokenizer_path, TokenizerFiles)
        else TokenizerFiles.locate(tokenizer_path, options.allow_download)
    )
    tokenizer = files.load()
    vocabulary = vocab_size(tokenizer)
    dtype = optimal_dtype(vocabulary) if options.dtype is None else as_token_dtype(options.dtype)
    if dtype.kind in "iu" and vocabulary - 1 > np.iinfo(dtype).max:
        raise PreprocessError(
            f"--dtype {dtype} cannot hold ids of a {vocabulary}-token vocabulary; "
            f"use {optimal_dtype(vocabulary)} or wider"
        )
    engine = VerifiedEngine.choose(files, tokenizer, options.tokenizer_engine)
    _warn(engine)
    spec = _WorkerSpec(
        engine=engine,
        keys=keys,
        dtype=str(dtype),
        bos=files.special_id(tokenizer, "bos", options.bos_token) if options.add_bos else None,
        eod=files.special_id(tokenizer, "eos", options.eod_token) if options.append_eod else None,
        keep_empty=options.keep_empty,
        dedup=options.dedup == "exact",
        stop_at_invalid=not options.skip_invalid,
        keys_option=options.keys_option,
        verify_every=1 if options.verify else VERIFY_EVERY,
        max_chars=options.max_document_chars,
        remote_timeout=options.remote_timeout,
    )
    outputs = output_prefixes(out_prefix, keys, options.megatron_names)
    tokenizer_hash = files.content_hash()  # read once: the config key and the metadata
    config = _config_hash(tokenizer_hash, spec, options)
    metadata = {
        "schema": METADATA_SCHEMA,
        "written_by": f"hp-data {__version__}",
        "tokenizer": files.describe(tokenizer_hash),
        "vocab_size": vocabulary,
        "eod": spec.eod,
        "bos": spec.bos,
    }
    task, mine, work_prefix = None, units, out_prefix
    if options.shard_index is not None:
        task = ShardTask.of(out_prefix, options.shard_index, options.num_shards, units, config)
        mine = units[task.units.start : task.units.stop]
        outputs = {key: task.name_for(prefix) for key, prefix in outputs.items()}
        done = task.finished(outputs)  # every input strongly pinned: check_shardable
        if done is not None:
            return PreprocessSummary(**{**done, "resumed_shards": done["shards"]})
        work_prefix = task.prefix
    job = _Job(options, mine, outputs, dtype, tokenizer, spec, metadata, work_prefix, config, task)
    job.resume()
    return job


def _tokenize(job: _Job) -> _Run:
    """Every unit not done yet, through the workers into the work directory. Where the
    tiktoken engine gave other ids than tokenizers on a document, what it wrote is suspect:
    the work directory goes, and every unit is tokenized again with tokenizers, or the run
    stops (`VerifiedEngine.fall_back`)."""
    options, units, spec = job.options, job.units, job.spec
    stdin = any(u.path == STDIN for u in units)
    while True:
        progress = Progress(
            0 if stdin else sum(u.nbytes for u in units),
            "preprocess",
            enabled=options.show_progress,
            already=sum(u.nbytes for u in units[: job.resumed]),
        )
        run = _Run(
            job.workdir, units, spec.keys, job.dtype, job.seen, progress, not spec.stop_at_invalid
        )
        try:
            results = _results(job.chunks(), spec, options.workers, job.tokenizer)
            with contextlib.closing(results):
                for result in results:
                    run.take(result)
        except EngineMismatch as exc:
            run.abort()
            job.workdir.remove()  # units the fast engine wrote are suspect: none is reused
            progress.close()
            spec = job.spec = replace(spec, engine=spec.engine.fall_back(str(exc), not stdin))
            _warn(spec.engine)
            job.resume()
            continue
        except BaseException:
            run.abort()
            if not job.workdir.manifest["shards"]:
                job.workdir.remove()
            else:
                job.workdir.release()
            raise
        progress.close()
        return run


def _commit(job: _Job, run: _Run, started: float) -> PreprocessSummary:
    """Every key's output complete, with what made it, before any is renamed into place; a
    shard's hashes and manifest after its datasets; the work directory last."""
    workdir, outputs = job.workdir, job.outputs
    stats = [_UnitStats(**record["stats"]) for record in workdir.manifest["shards"]]
    finals = [
        IndexedDatasetBuilder(
            final,
            job.dtype,
            metadata={**job.metadata, **_max_token_id(stats, key)},
            sources=_provenance(job, stats, key),
        )
        for key, final in outputs.items()
    ]
    try:
        for key, builder in zip(outputs, finals, strict=True):
            for index in range(len(job.units)):
                builder.add_index(workdir.unit_prefix(index, key))
    except BaseException:
        for builder in finals:
            builder.abort()
        raise
    finalize_together(finals)
    summary = _summarize(stats, job, run, started)
    if job.task is not None:  # the shard's hashes and manifest, after its datasets
        count = len(job.units)
        hashes = [workdir.hashes_path(i) for i in range(count)] if job.spec.dedup else None
        job.task.commit(outputs, hashes, summary.__dict__)
    workdir.remove()
    return summary


def _max_token_id(stats: list[_UnitStats], key: str) -> dict[str, int]:
    """`{"max_token_id": N}` over every unit of `key` (None: no token), or nothing when a
    unit does not say (one written by an older hp-data, resumed)."""
    found = [s.max_token_id.get(key) for s in stats if s.tokens.get(key)]
    if any(value is None for value in found):
        return {}
    return {"max_token_id": max(found, default=None)}  # type: ignore[type-var]


class _Run:
    """The main process's side of a run: takes results in order, writes each unit's dataset."""

    def __init__(
        self,
        workdir: _WorkDir,
        units: list[WorkUnit],
        keys: tuple[str, ...],
        dtype: np.dtype,
        seen: HashSet | None,
        progress: Progress,
        skip_invalid: bool,
    ) -> None:
        self.workdir, self.units, self.keys, self.dtype = workdir, units, keys, dtype
        self.seen, self.progress, self.skip_invalid = seen, progress, skip_invalid
        self.current: int | None = None
        self.builders: list[IndexedDatasetBuilder] = []
        self.hashes: AtomicFile | None = None  # kept hashes of the current unit, spilled
        self.skipped: list[tuple[np.ndarray, np.ndarray]] = []  # the unit's, per chunk
        self.stats = _UnitStats()
        self.done_bytes = progress.already
        self.input_bytes = 0
        self.documents = 0
        self.tokens = 0

    def _open(self, index: int) -> None:
        self.current = index
        self.builders = [
            IndexedDatasetBuilder(self.workdir.unit_prefix(index, key), self.dtype)
            for key in self.keys
        ]
        if self.seen is not None:
            self.hashes = AtomicFile(self.workdir.hashes_path(index))
        self.stats = _UnitStats(tokens=dict.fromkeys(self.keys, 0))
        self.skipped = []

    def take(self, result: _Result) -> None:
        if self.current != result.unit:
            self._open(result.unit)
        unit, stats = self.units[result.unit], self.stats
        if result.mismatch is not None:
            offset, what = result.mismatch
            raise EngineMismatch(
                f"{location(unit, stats.lines + offset + 1)}: the tiktoken engine gave other "
                f"ids than tokenizers ({what})"
            )
        stats.verified += result.verified
        for offset, kind, why in result.invalid:
            where = location(unit, stats.lines + offset + 1)
            if not self.skip_invalid:
                check_unchanged(unit.path, unit.pin)  # not a bad line: a changed input
                raise PreprocessError(f"{where}: {why}")
            stats.invalid[kind] = stats.invalid.get(kind, 0) + 1
            if len(stats.invalid_examples) < INVALID_EXAMPLES:
                stats.invalid_examples.append(f"{where}: {why}")
        before = stats.lines
        stats.lines += result.lines
        stats.records += result.records
        stats.empty += result.empty
        tokens, lengths = result.tokens, result.lengths
        dropped, reasons = result.dropped, result.reasons
        if self.seen is not None and result.hashes is not None:
            fresh = self.seen.add_new(result.hashes)
            stats.duplicates += int((~fresh).sum())
            if not fresh.all():
                tokens = [t[np.repeat(fresh, n)] for t, n in zip(tokens, lengths, strict=True)]
                lengths = [n[fresh] for n in lengths]
                dropped, reasons = _with_duplicates(dropped, reasons, result.lines, fresh)
            self.hashes.file.write(result.hashes[fresh].tobytes())  # type: ignore[union-attr]
        if dropped is not None and len(dropped):
            self.skipped.append((dropped + before, reasons))  # type: ignore[arg-type]
        for key, builder, key_tokens, key_lengths in zip(
            self.keys, self.builders, tokens, lengths, strict=True
        ):
            present = key_lengths > 0  # an empty text (other keys not empty): no sequences
            builder.add_batch(key_tokens, key_lengths[present], present)
            stats.tokens[key] += len(key_tokens)
            if len(key_tokens):  # one pass over ids just made: PREFIX.hp.json's max_token_id
                largest = int(key_tokens.max())
                stats.max_token_id[key] = max(stats.max_token_id.get(key, largest), largest)
            self.tokens += len(key_tokens)
        stats.written += len(lengths[0]) if lengths else 0
        self.documents += result.records
        self.input_bytes += result.input_bytes
        self.done_bytes += result.input_bytes
        self.progress.update(
            self.done_bytes, docs=self.documents, tokens=self.tokens, bytes=self.input_bytes
        )
        if result.last:
            self._finish(unit, result.unit)

    def _finish(self, unit: WorkUnit, index: int) -> None:
        for builder in self.builders:
            builder.finalize()
        target = self.workdir.skipped_path(index)
        with committing(target) as stream:
            for offsets, _ in self.skipped:
                stream.write(offsets.astype("<i8").tobytes())
            for _, reasons in self.skipped:
                stream.write(reasons.tobytes())
        self.skipped = []
        if self.hashes is not None:
            self.hashes.commit()
            self.hashes = None
        self.workdir.record(unit, self.stats)
        self.builders = []
        self.current = None

    def abort(self) -> None:
        for builder in self.builders:
            builder.abort()
        if self.hashes is not None:
            self.hashes.discard()


def _with_duplicates(
    dropped: np.ndarray | None, reasons: np.ndarray | None, lines: int, fresh: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's dropped line offsets and reasons with the duplicates among the records that
    made documents (`fresh` False) added, still sorted."""
    assert dropped is not None and reasons is not None
    made = np.ones(lines, dtype=bool)
    made[dropped] = False
    duplicates = np.flatnonzero(made)[~fresh]
    offsets = np.concatenate([dropped, duplicates])
    order = np.argsort(offsets, kind="stable")
    every = np.concatenate([reasons, np.full(len(duplicates), DUPLICATE, np.uint8)])
    return offsets[order], every[order]


def _provenance(job: _Job, stats: list[_UnitStats], key: str) -> Provenance:
    """The units of this run as the sidecar of `key`'s output records them (provenance.py):
    a JSON lines byte range's earlier lines are counted from the units before it in this
    run, else left unknown (a shard: its merge resolves them)."""
    inputs: list[dict[str, Any]] = []
    where: dict[str, int] = {}
    rows, offsets, reasons = [], [], []
    documents = skipped = 0
    for index, (unit, unit_stats) in enumerate(zip(job.units, stats, strict=True)):
        entry = input_entry(unit.path, unit.format, unit.identity, key, job.options.hf_split)
        name = json.dumps(entry, sort_keys=True)
        where.setdefault(name, len(inputs))
        if where[name] == len(inputs):
            inputs.append(entry)
        first = unit.first_row if unit.format == "parquet" else 0
        if unit.format == "jsonl" and unit.start > 0:
            first = UNKNOWN
            previous = job.units[index - 1] if index else None
            if previous is not None and previous.path == unit.path and previous.end == unit.start:
                first = rows[-1][FIRST_RECORD]
                first = UNKNOWN if first == UNKNOWN else first + stats[index - 1].lines
        end = -1 if unit.end is None else unit.end
        rows.append([where[name], documents, first, unit.start, end, unit_stats.lines, skipped])
        data = np.fromfile(job.workdir.skipped_path(index), np.uint8)
        count = len(data) // 9
        offsets.append(data[: 8 * count].view("<i8"))
        reasons.append(data[8 * count :])
        documents += unit_stats.written
        skipped += count
    return Provenance(
        inputs,
        np.array(rows, np.int64).reshape(-1, 7),
        np.concatenate(offsets) if offsets else np.zeros(0, np.int64),
        np.concatenate(reasons) if reasons else np.zeros(0, np.uint8),
        documents,
    )


def _summarize(stats: list[_UnitStats], job: _Job, run: _Run, started: float) -> PreprocessSummary:
    outputs, seen = job.outputs, job.seen
    invalid: dict[str, int] = {}
    for unit_stats in stats:
        for kind, count in unit_stats.invalid.items():
            invalid[kind] = invalid.get(kind, 0) + count
    tokens_by_key = {key: sum(s.tokens.get(key, 0) for s in stats) for key in outputs}
    return PreprocessSummary(
        outputs=outputs,
        dtype=str(job.dtype),
        workers=job.options.workers,
        shards=len(job.units),
        resumed_shards=job.resumed,
        documents_in=sum(s.records for s in stats),
        documents_written=sum(s.written for s in stats),
        skipped={
            "empty": sum(s.empty for s in stats),
            "duplicate": sum(s.duplicates for s in stats),
            "invalid": invalid,
        },
        invalid_examples=[e for s in stats for e in s.invalid_examples][:INVALID_EXAMPLES],
        tokens=sum(tokens_by_key.values()),
        tokens_by_key=tokens_by_key,
        output_bytes=sum(
            os.path.getsize(bin_path(p)) + os.path.getsize(idx_path(p)) for p in outputs.values()
        ),
        input_bytes=run.input_bytes,
        seconds=round(time.perf_counter() - started, 3),
        dedup_hash_set_bytes=seen.nbytes if seen is not None else None,
        engine=job.spec.engine.name,
        probe_texts=job.spec.engine.probes,
        verified_documents=sum(s.verified for s in stats),
        tokenizer=job.metadata["tokenizer"],
    )


def format_summary(summary: PreprocessSummary) -> str:
    """The human-readable end-of-run report."""
    data = summary.as_dict()
    skipped = summary.skipped
    invalid = ", ".join(f"{count:,} {kind}" for kind, count in skipped["invalid"].items())
    lines = [
        "wrote "
        + ", ".join(f"{p}.bin/.idx" for p in summary.outputs.values())
        + f" ({summary.dtype}, {human(summary.output_bytes, 'B')})",
        f"documents: {summary.documents_in:,} in, {summary.documents_written:,} written; "
        f"skipped {skipped['empty']:,} empty, {skipped['duplicate']:,} duplicate, "
        f"{sum(skipped['invalid'].values()):,} invalid" + (f" ({invalid})" if invalid else ""),
    ]
    lines += [f"  invalid: {example}" for example in summary.invalid_examples]
    lines.append(
        f"tokens: {summary.tokens:,}"
        + (
            " (" + ", ".join(f"{k} {v:,}" for k, v in summary.tokens_by_key.items()) + ")"
            if len(summary.tokens_by_key) > 1
            else ""
        )
    )
    if summary.dedup_hash_set_bytes is not None:
        lines.append(f"dedup hash set: {human(summary.dedup_hash_set_bytes, 'B')}")
    if summary.tokenizer:
        named = summary.tokenizer["source"]
        path = summary.tokenizer["path"]
        lines.append(
            f"tokenizer: {named}"
            + (f" = {path}" if path != named else "")
            + f" (xxh3 {summary.tokenizer['xxh3_128'][:16]})"
        )
    if summary.engine == "tiktoken":
        lines.append(
            f"engine: tiktoken, ids checked against tokenizers on {summary.probe_texts:,} "
            f"probe texts and {summary.verified_documents:,} documents"
        )
    if summary.resumed_shards:
        lines.append(f"resumed: {summary.resumed_shards} of {summary.shards} shards were done")
    lines.append(
        f"time: {summary.seconds:.2f} s with {summary.workers} worker(s): "
        f"{human(data['tokens_per_second'])} tokens/s, "
        f"{human(data['documents_per_second'])} docs/s, {data['mb_per_second']:.2f} MB/s"
    )
    return "\n".join(lines)
