"""The main process's side of a preprocess run: takes the workers' results in order, drops
exact duplicates, and writes each unit's dataset into the work directory."""

from __future__ import annotations

import numpy as np

from hp_data.dedup import HashSet
from hp_data.errors import PreprocessError
from hp_data.format.builder import IndexedDatasetBuilder
from hp_data.fs import AtomicFile, committing
from hp_data.pipeline.workdir import _UnitStats, _WorkDir
from hp_data.pipeline.worker import EngineMismatch, _Result
from hp_data.progress import Progress
from hp_data.provenance import (
    DUPLICATE,
)
from hp_data.readers.parsing import location
from hp_data.readers.units import WorkUnit
from hp_data.remote import check_unchanged

INVALID_EXAMPLES = 5


class _UnitWriter:
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
