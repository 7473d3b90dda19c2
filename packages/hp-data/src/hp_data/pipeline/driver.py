"""The preprocess run from start to end: check the options, plan the inputs, choose the
engine and take up an earlier run (`_prepare`); tokenize every unit not done yet
(`_tokenize`); concatenate the units into the outputs with their provenance (`_commit`)."""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hp_data.dedup import HashSet
from hp_data.errors import PreprocessError
from hp_data.format.builder import IndexedDatasetBuilder, finalize_together
from hp_data.format.dtypes import as_token_dtype, optimal_dtype
from hp_data.format.header import bin_path, idx_path
from hp_data.format.metadata import SCHEMA as METADATA_SCHEMA
from hp_data.pipeline.options import PreprocessOptions, output_prefixes
from hp_data.pipeline.summary import PreprocessSummary
from hp_data.pipeline.unit_writer import INVALID_EXAMPLES, _UnitWriter
from hp_data.pipeline.workdir import _config_hash, _UnitStats, _WorkDir
from hp_data.pipeline.worker import (
    VERIFY_EVERY,
    EngineMismatch,
    Workers,
    _WorkerSpec,
    refuse_reentry,
)
from hp_data.plan import plan_units
from hp_data.progress import Progress
from hp_data.provenance import (
    FIRST_RECORD,
    UNKNOWN,
    Provenance,
    input_entry,
)
from hp_data.readers.chunking import chunks
from hp_data.readers.discovery import discover
from hp_data.readers.units import STDIN, Chunk, WorkUnit
from hp_data.remote import set_timeout
from hp_data.shards import ShardTask
from hp_data.tokenize import TokenizerFiles, VerifiedEngine, vocab_size
from hp_data.version import __version__


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
    with Workers(options.workers) as workers:
        job = _prepare(inputs, out_prefix, tokenizer_path, options, workers)
        if isinstance(job, PreprocessSummary):  # a shard that an earlier run finished
            return job
        run = _tokenize(job, workers)
    return _commit(job, run, started)


@dataclass
class _Prepared:
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
    workers: Workers,
) -> _Prepared | PreprocessSummary:
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
    workers.start()  # they start up while the tokenizer loads and the engine is chosen
    tokenizer = files.load()
    vocabulary = vocab_size(tokenizer)
    dtype = optimal_dtype(vocabulary) if options.dtype is None else as_token_dtype(options.dtype)
    if dtype.kind in "iu" and vocabulary - 1 > np.iinfo(dtype).max:
        raise PreprocessError(
            f"--dtype {dtype} cannot hold ids of a {vocabulary}-token vocabulary; "
            f"use {optimal_dtype(vocabulary)} or wider"
        )
    tokenizer_hash = files.content_hash()  # read once: the engine, the config key, the metadata
    engine = VerifiedEngine.choose(files, tokenizer, options.tokenizer_engine, tokenizer_hash)
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
    job = _Prepared(
        options, mine, outputs, dtype, tokenizer, spec, metadata, work_prefix, config, task
    )
    job.resume()
    return job


def _tokenize(job: _Prepared, workers: Workers) -> _UnitWriter:
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
        run = _UnitWriter(
            job.workdir, units, spec.keys, job.dtype, job.seen, progress, not spec.stop_at_invalid
        )
        try:
            results = workers.results(job.chunks(), spec, job.tokenizer)
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


def _commit(job: _Prepared, run: _UnitWriter, started: float) -> PreprocessSummary:
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


def _provenance(job: _Prepared, stats: list[_UnitStats], key: str) -> Provenance:
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


def _summarize(
    stats: list[_UnitStats], job: _Prepared, run: _UnitWriter, started: float
) -> PreprocessSummary:
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
