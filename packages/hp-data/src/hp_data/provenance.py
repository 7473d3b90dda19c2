"""Where each document of a dataset came from: the `PREFIX.hp.sources` sidecar, and samples
back to documents.

`preprocess` works in units (plan.py: a file, a line-aligned byte range of one, or a run of
Parquet row groups), and a unit's documents are its records in order, less those that made
none. So a unit is recorded by its input, the records of the input before it, its first
document id, its record count and the sorted record offsets that made no document (with
why: blank, invalid, empty, duplicate). Document id -> (input, line) is then one
searchsorted over the units and one over the unit's skipped offsets: no object per document.

The sidecar joins the dataset's atomic commit (format/commit.py) and records the size and
xxh3-128 of the `.idx` it describes and of its own arrays, so a sidecar that does not match
its `.idx` (copied from another dataset) or is damaged is refused by name and never gives a
wrong source. Layout
(little-endian; docs/datasets.md, "Provenance", keeps it stable)::

    8 bytes   magic b"HPSRC\\x00\\x00\\x01"
    <Q        H, the length of the JSON header
    H bytes   JSON header (UTF-8), zero-padded to a multiple of 8
    int64[U, 7]  units: input, first_document, first_record, start, end, records,
                 first_skipped
    int64[K]     skipped record offsets, within their unit, sorted per unit
    uint8[K]     why each made no document (REASONS)
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import xxhash

from hp_data.errors import HpDataError
from hp_data.format.blocks import file_record
from hp_data.format.header import idx_path, prefix_of, sources_path
from hp_data.redact import redact

MAGIC = b"HPSRC\x00\x00\x01"
VERSION = 1
UNIT_FIELDS = ("input", "first_document", "first_record", "start", "end", "records", "skipped")
INPUT, FIRST_DOCUMENT, FIRST_RECORD, START, END, RECORDS, FIRST_SKIPPED = range(7)
REASONS = ("blank", "invalid", "empty", "duplicate")
BLANK, INVALID, EMPTY, DUPLICATE = range(4)
NO_INPUT = -1  # a unit of documents from a dataset without provenance (Megatron-made)
UNKNOWN = -1  # first_record of a byte range whose earlier lines no run counted
_READ = 16 << 20


class ProvenanceError(HpDataError):
    """A sidecar that cannot be read, or does not describe its `.idx`."""


def idx_record(path: str) -> dict[str, Any]:
    """`{"bytes", "xxh3_128"}` of an `.idx` file: what binds a sidecar to it."""
    return file_record(path)


def input_entry(path: str, fmt: str, identity: Sequence[object], key: str, split: str) -> dict:
    """One input as the header names it: a local path made absolute (a source opens from
    any directory), a URL redacted of credentials; what identifies its contents; the
    key (column) this dataset holds; the split of an HF dataset."""
    shown = path if "://" in path or path == "-" else os.path.abspath(path)
    entry = {"path": redact(shown), "format": fmt, "identity": list(identity[:4]), "key": key}
    return entry | ({"split": split} if fmt.startswith("hf") else {})


@dataclass
class Provenance:
    """The units of one dataset (an int64 [U, 7] table, UNIT_FIELDS) over `inputs`, and the
    records of each that made no document. `documents` is the dataset's document count."""

    inputs: list[dict[str, Any]]
    units: np.ndarray
    skipped: np.ndarray  # int64 offsets within their unit
    reasons: np.ndarray  # uint8, REASONS
    documents: int

    @classmethod
    def empty(cls) -> Provenance:
        return cls([], np.zeros((0, 7), np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint8), 0)

    @classmethod
    def anonymous(cls, documents: int) -> Provenance:
        """`documents` documents of no known input: a dataset without a sidecar, merged."""
        units = np.array([[NO_INPUT, 0, UNKNOWN, 0, -1, documents, 0]], np.int64)
        return cls([], units, np.zeros(0, np.int64), np.zeros(0, np.uint8), documents)

    # -- lookup -------------------------------------------------------------------------

    def unit_documents(self) -> np.ndarray:
        return np.diff(self.units[:, FIRST_DOCUMENT], append=self.documents)

    def unit_skipped(self) -> np.ndarray:
        return np.diff(self.units[:, FIRST_SKIPPED], append=len(self.skipped))

    def locate(self, documents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unit, record offset within the unit) of each document id."""
        documents = np.asarray(documents, np.int64).reshape(-1)
        if len(documents) and (documents.min() < 0 or documents.max() >= self.documents):
            bad = documents[(documents < 0) | (documents >= self.documents)][0]
            raise IndexError(f"document {bad} out of range for {self.documents} documents")
        unit = np.searchsorted(self.units[:, FIRST_DOCUMENT], documents, "right") - 1
        within = documents - self.units[unit, FIRST_DOCUMENT]
        record = within.copy()
        starts, counts = self.units[:, FIRST_SKIPPED], self.unit_skipped()
        order = np.argsort(unit, kind="stable")  # the ids of each unit, one slice each
        grouped = unit[order]
        touched = np.unique(grouped)
        lows = np.searchsorted(grouped, touched, "left")
        highs = np.searchsorted(grouped, touched, "right")
        for u, low, high in zip(touched.tolist(), lows.tolist(), highs.tolist(), strict=True):
            if not counts[u]:
                continue
            offsets = np.asarray(self.skipped[starts[u] : starts[u] + counts[u]])
            # The i-th skipped offset has i skipped before it: a document lands after every
            # skipped offset whose offset - i is at most its place among the documents.
            shifted = offsets - np.arange(len(offsets))
            mine = order[low:high]
            record[mine] += np.searchsorted(shifted, within[mine], "right")
        return unit, record

    def sources(self, documents: np.ndarray) -> list[dict[str, Any] | None]:
        """The source of each document: `{"file", "line"}` (JSON lines, from 1),
        `{"file", "row"}` (Parquet, from 1) or `{"dataset", "index"}` (HF, from 0); None for
        a document of no known input."""
        unit, record = self.locate(documents)
        found: list[dict[str, Any] | None] = []
        for u, r in zip(unit.tolist(), record.tolist(), strict=True):
            row = self.units[u]
            if row[INPUT] == NO_INPUT:
                found.append(None)
                continue
            entry = self.inputs[row[INPUT]]
            before = int(row[FIRST_RECORD])
            if before == UNKNOWN:
                before = _lines_before(entry["path"], int(row[START]))
            if entry["format"].startswith("hf"):
                found.append({"dataset": entry["path"], "index": before + r})
            elif entry["format"] == "parquet":
                found.append({"file": entry["path"], "row": before + r + 1})
            else:
                found.append({"file": "<stdin>" if entry["path"] == "-" else entry["path"],
                              "line": before + r + 1})  # fmt: skip
        return found

    # -- building -----------------------------------------------------------------------

    def drop(self, keep: np.ndarray, reason: int = DUPLICATE) -> Provenance:
        """The provenance once the documents `keep` marks False are dropped (a merge's
        cross-shard duplicates): each becomes a skipped record of its unit."""
        keep = np.asarray(keep, bool)
        if len(keep) != self.documents:
            raise ProvenanceError(f"{len(keep)} flags for {self.documents} documents")
        if keep.all():
            return self
        unit, record = self.locate(np.flatnonzero(~keep))
        if (self.units[unit, INPUT] == NO_INPUT).any():
            raise ProvenanceError("cannot drop documents of no known input from provenance")
        owner = np.repeat(np.arange(len(self.units)), self.unit_skipped())
        units_of = np.concatenate([owner, unit])
        offsets = np.concatenate([self.skipped, record])
        reasons = np.concatenate([self.reasons, np.full(len(record), reason, np.uint8)])
        order = np.lexsort((offsets, units_of))
        units = self.units.copy()
        dropped = np.bincount(unit, minlength=len(units))
        units[:, FIRST_DOCUMENT] -= np.concatenate(([0], np.cumsum(dropped)[:-1]))
        units[:, FIRST_SKIPPED] += np.concatenate(([0], np.cumsum(dropped)[:-1]))
        return Provenance(
            self.inputs, units, offsets[order], reasons[order], self.documents - len(record)
        )

    @classmethod
    def concatenate(cls, parts: Sequence[Provenance]) -> Provenance:
        """One provenance for datasets concatenated in order: document ids and skipped
        offsets shifted, inputs shared by identity, and a unit whose earlier lines are
        unknown resolved from the unit before it when that is the same input's range just
        before (the shards of one run, merged)."""
        inputs: list[dict[str, Any]] = []
        where: dict[str, int] = {}
        tables, skipped, reasons = [], [], []
        documents = count = 0
        for part in parts:
            mapping = []
            for entry in part.inputs:
                name = json.dumps(entry, sort_keys=True)
                if name not in where:
                    where[name] = len(inputs)
                    inputs.append(entry)
                mapping.append(where[name])
            table = part.units.copy()
            named = table[:, INPUT] != NO_INPUT
            table[named, INPUT] = np.asarray(mapping, np.int64)[table[named, INPUT]]
            table[:, FIRST_DOCUMENT] += documents
            table[:, FIRST_SKIPPED] += count
            tables.append(table)
            skipped.append(part.skipped)
            reasons.append(part.reasons)
            documents += part.documents
            count += len(part.skipped)
        if not tables:
            return cls.empty()
        units = np.concatenate(tables)
        for u in range(1, len(units)):
            row, before = units[u], units[u - 1]
            if (
                row[FIRST_RECORD] == UNKNOWN
                and row[INPUT] != NO_INPUT
                and before[INPUT] == row[INPUT]
                and before[FIRST_RECORD] != UNKNOWN
                and before[END] == row[START]
            ):
                row[FIRST_RECORD] = before[FIRST_RECORD] + before[RECORDS]
        return cls(inputs, units, np.concatenate(skipped), np.concatenate(reasons), documents)

    # -- the file -----------------------------------------------------------------------

    def write(self, path: str, idx: str) -> None:
        """Write the sidecar for the `.idx` at `idx` (its size and checksum bind them; the
        arrays' own checksum finds a damaged byte)."""
        arrays = [
            np.ascontiguousarray(self.units, "<i8").tobytes(),
            np.ascontiguousarray(self.skipped, "<i8").tobytes(),
            np.ascontiguousarray(self.reasons, np.uint8).tobytes(),
        ]
        digest = xxhash.xxh3_128()
        for array in arrays:
            digest.update(array)
        header = {
            "version": VERSION,
            "documents": self.documents,
            "units": len(self.units),
            "skipped": len(self.skipped),
            "unit_fields": list(UNIT_FIELDS),
            "reasons": list(REASONS),
            "inputs": self.inputs,
            "idx": idx_record(idx),
            "xxh3_128": digest.hexdigest(),
        }
        text = json.dumps(header, sort_keys=True).encode()
        text += b"\x00" * (-len(text) % 8)
        with open(path, "wb") as stream:
            stream.write(MAGIC + struct.pack("<Q", len(text)) + text)
            for array in arrays:
                stream.write(array)
            stream.flush()
            os.fsync(stream.fileno())


def read_provenance(prefix: str, path: str | None = None) -> Provenance | None:
    """The provenance of the dataset at `prefix`, or None when it has no sidecar. A sidecar
    that is damaged or does not match the `.idx` raises ProvenanceError naming it. `path`:
    the sidecar where it is not beside the `.idx` (a URL prefix's, copied into the cache)."""
    index = idx_path(prefix_of(prefix))
    path = sources_path(prefix_of(prefix)) if path is None else path
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        if not os.path.exists(index):
            raise ProvenanceError(f"{prefix}: no dataset here ({index} does not exist)") from None
        return None
    try:
        idx_stat = os.stat(index)
    except FileNotFoundError:
        raise ProvenanceError(f"{path}: no {index} beside it; it describes no dataset") from None
    return _read(path, (stat.st_size, stat.st_mtime_ns, stat.st_ino), index,
                 (idx_stat.st_size, idx_stat.st_mtime_ns, idx_stat.st_ino))  # fmt: skip


@functools.lru_cache(maxsize=16)
def _read(path: str, _stat: tuple, index: str, _idx_stat: tuple) -> Provenance:
    """The sidecar at `path`, checked whole (cached while neither file changes)."""

    def damaged(why: str) -> ProvenanceError:
        return ProvenanceError(
            f"{path}: damaged provenance sidecar ({why}); delete it (the dataset stays usable, "
            "with document ids only) or preprocess again"
        )

    size = os.path.getsize(path)
    with open(path, "rb") as stream:
        start = stream.read(16)
        if start[:8] != MAGIC:
            raise damaged("not an hp-data sources file")
        if len(start) < 16:
            raise damaged("cut short")
        (length,) = struct.unpack("<Q", start[8:16])
        if length % 8 or 16 + length > size:
            raise damaged("its header runs past the end")
        text = stream.read(length)
    try:
        header = json.loads(text.rstrip(b"\x00"))
        units_count, skipped_count = int(header["units"]), int(header["skipped"])
        documents, inputs = int(header["documents"]), list(header["inputs"])
        recorded, checksum = header["idx"], str(header["xxh3_128"])
        if header["version"] != VERSION:
            raise damaged(f"version {header['version']!r}, this hp-data reads {VERSION}")
    except (ValueError, KeyError, TypeError) as exc:
        raise damaged(f"unreadable header: {exc}") from None
    body = 16 + length
    if units_count < 0 or skipped_count < 0 or size != body + 56 * units_count + 9 * skipped_count:
        raise damaged(f"{size} bytes, not what {units_count} units and {skipped_count} "
                      "skipped records take")  # fmt: skip
    if idx_record(index) != recorded:
        raise ProvenanceError(
            f"{path}: describes another .idx than {index} (its recorded size and xxh3-128 "
            "differ); delete it, or preprocess again to record where documents came from"
        )
    # The skipped records stay mapped: a heavily deduplicated corpus has many.
    data = np.memmap(path, np.uint8, "r")
    digest = xxhash.xxh3_128()
    for start in range(body, size, _READ):
        digest.update(data[start : min(start + _READ, size)])
    if digest.hexdigest() != checksum:
        raise damaged("its units or skipped records differ from their recorded xxh3-128")
    units = np.frombuffer(data, "<i8", 7 * units_count, body).reshape(-1, 7).astype(np.int64)
    at = body + 56 * units_count
    skipped = np.frombuffer(data, "<i8", skipped_count, at)
    reasons = np.frombuffer(data, np.uint8, skipped_count, at + 8 * skipped_count)
    found = Provenance(inputs, units, skipped, reasons, documents)
    problem = _problem(found)
    if problem is not None:
        raise damaged(problem)
    return found


def _problem(found: Provenance) -> str | None:
    """What is inconsistent in a provenance, or None: every record of a unit is one of its
    documents or one of its skipped records, exactly."""
    units = found.units
    if not len(units):
        return None if found.documents == 0 else "documents but no units"
    if units[0, FIRST_DOCUMENT] != 0 or units[0, FIRST_SKIPPED] != 0:
        return "the first unit does not start at document 0"
    documents, skipped = found.unit_documents(), found.unit_skipped()
    if (documents < 0).any() or (skipped < 0).any():
        return "units out of order"
    if (units[:, RECORDS] != documents + skipped).any():
        return "a unit's records are not its documents and skipped records"
    named = units[:, INPUT]
    if ((named < NO_INPUT) | (named >= len(found.inputs))).any():
        return "a unit names no input"
    if len(found.reasons) and found.reasons.max() >= len(REASONS):
        return "an unknown reason"
    starts, block = units[:, FIRST_SKIPPED], 1 << 22
    for first in range(0, len(found.skipped), block):  # in blocks: a corpus may skip billions
        ahead = max(first - 1, 0)  # the record before the block, for the order across it
        offsets = np.asarray(found.skipped[ahead : first + block])
        owner = np.searchsorted(starts, np.arange(ahead, ahead + len(offsets)), "right") - 1
        if (offsets < 0).any() or (offsets >= units[owner, RECORDS]).any():
            return "a skipped record outside its unit"
        same = owner[1:] == owner[:-1]
        if (offsets[1:][same] <= offsets[:-1][same]).any():
            return "skipped records not sorted"
    return None


def merged_provenance(prefixes: Sequence[str], layouts: Sequence[Any]) -> Provenance | None:
    """The provenance of `prefixes` concatenated with document-id offsets (an input without a
    sidecar gives documents of no source; `layouts`, the inputs' `IndexLayout`s, count them),
    or None when no input has any: what `hp_data.merge_datasets` records."""
    found = [read_provenance(prefix) for prefix in prefixes]
    if all(part is None for part in found):
        return None
    return Provenance.concatenate(
        [
            Provenance.anonymous(layout.document_count - 1) if part is None else part
            for part, layout in zip(found, layouts, strict=True)
        ]
    )


def has_provenance(prefix: str) -> bool:
    """Whether `prefix` has a sidecar (checked: a damaged one raises)."""
    return read_provenance(prefix) is not None


def document_source(prefix: str, document_ids: Sequence[int] | np.ndarray) -> list[Any]:
    """The source of each document id of the dataset at `prefix` (`Provenance.sources`);
    None for each when the dataset has no provenance (Megatron-made)."""
    ids = np.asarray(document_ids, np.int64).reshape(-1)
    found = read_provenance(prefix)
    if found is None:
        return [None] * len(ids)
    return found.sources(ids)


def document_input(prefix: str, document_id: int) -> dict[str, Any] | None:
    """The header entry of the input a document came from (its key, an HF split), or None."""
    found = read_provenance(prefix)
    if found is None:
        return None
    unit, _ = found.locate(np.array([document_id]))
    named = int(found.units[unit[0], INPUT])
    return None if named == NO_INPUT else found.inputs[named]


# -- the raw records --------------------------------------------------------------------


def source_text(
    source: dict[str, Any], limit: int = 200, key: str = "text", split: str = "train"
) -> str:
    """The first `limit` characters of the text (`key`) of the raw record `source` names,
    read from the input itself: one line (streamed to, for compressed JSON lines), one
    Parquet row group's column, one HF row. Bounded memory. A record whose `key` holds no
    text gives its raw line."""
    from hp_data.readers import suffix_format

    shapes = ({"dataset", "index"}, {"file", "row"}, {"file", "line"})
    if not isinstance(source, dict) or not any(shape <= source.keys() for shape in shapes):
        raise HpDataError(
            f"source {source!r}: give a source as document_source returns it: "
            '{"file", "line"}, {"file", "row"} or {"dataset", "index"}'
        )
    if "dataset" in source:
        return _clip(_hf_text(source["dataset"], int(source["index"]), key, split), limit)
    path = source["file"]
    if "row" in source:
        return _clip(_parquet_text(path, int(source["row"]) - 1, key), limit)
    fmt = suffix_format(path.split("?", 1)[0]) or "jsonl"
    line = _nth_line(path, fmt, int(source["line"]))
    try:
        record = orjson.loads(line)
        text = record[key] if isinstance(record, dict) else None
    except (orjson.JSONDecodeError, KeyError):
        text = None
    if not isinstance(text, str):
        text = line.decode("utf-8", "replace")
    return _clip(text, limit)


def _clip(text: str, limit: int) -> str:
    return text[: max(limit, 0)]


def _open(path: str, expected: str) -> Any:
    from hp_data.remote import open_pinned

    return open_pinned(path, None, expected)


def _nth_line(path: str, fmt: str, number: int) -> bytes:
    """Line `number` (from 1) of a JSON lines file, streamed to in blocks."""
    with _open(path, "a .jsonl file") as raw:
        stream: Any = raw
        if fmt == "jsonl.gz":
            stream = gzip.GzipFile(fileobj=raw)
        elif fmt == "jsonl.zst":
            import zstandard

            stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        for at, line in enumerate(_lines(stream), 1):
            if at == number:
                return line
    raise HpDataError(f"{path}: has no line {number}; the input changed since it was read")


def _lines(stream: Any) -> Iterator[bytes]:
    carry = b""
    while block := stream.read(1 << 20):
        parts = (carry + block).split(b"\n")
        carry = parts.pop()
        yield from parts
    if carry:
        yield carry


def _lines_before(path: str, offset: int) -> int:
    """Lines of `path` before byte `offset`: a shard's byte range, looked up unmerged."""
    from hp_data.readers import lines_before as count

    return count(path, offset, None)


def _parquet_text(path: str, row: int, key: str) -> str:
    from hp_data.readers import require

    parquet = require("pyarrow.parquet", "parquet")
    with _open(path, "a Parquet file") as stream:
        table = parquet.ParquetFile(stream)
        first = 0
        for group in range(table.metadata.num_row_groups):
            rows = table.metadata.row_group(group).num_rows
            if row < first + rows:
                column = table.read_row_group(group, columns=[key]).column(key)
                return str(column[row - first].as_py())
            first += rows
    raise HpDataError(f"{path}: has no row {row + 1}; the input changed since it was read")


def _hf_text(path: str, index: int, key: str, split: str) -> str:
    from hp_data.readers import HF_SAVED_MARKERS, WorkUnit, load_hf_dataset

    saved = any(os.path.exists(os.path.join(path, m)) for m in HF_SAVED_MARKERS)
    unit = WorkUnit(path, "hf-saved" if saved else "hf", 0, 0)
    return str(load_hf_dataset(unit, split, None, quiet=True)[index][key])


# -- samples to documents ---------------------------------------------------------------


def sample_pieces(dataset: Any, sample_index: int) -> list[dict[str, Any]]:
    """Which documents, and which of their tokens (`[START, END)` within the document), the
    sample `sample_index` of a GPTDataset, a BlendableDataset or a PhasedDataset is cut from,
    in order: the walk `GPTDataset.sample_parts` does for `sample_tokens`, mapped from
    sequences to documents through the IndexedDataset's boundaries."""
    while hasattr(dataset, "part_of"):  # a blend or a phased run: to the GPTDataset it reads
        dataset, sample_index = dataset.part_of(sample_index)
    parts = list(dataset.sample_parts(int(sample_index)))
    corpus = dataset.dataset
    sequences = np.array([part[0] for part in parts], np.int64)
    offsets = np.array([part[1] for part in parts], np.int64)
    counts = np.array([part[2] for part in parts], np.int64)
    boundaries = corpus.document_indices
    documents = np.searchsorted(boundaries, sequences, "right") - 1
    pointers = corpus.sequence_pointers
    itemsize = corpus.dtype.itemsize
    # Tokens before the sequence inside its document (a document of several sequences).
    before = (pointers[sequences] - pointers[boundaries[documents]]) // itemsize
    lengths = corpus.sequence_lengths[sequences].astype(np.int64)
    ends = np.minimum(offsets + counts, lengths)  # the padded tail of a last sample
    return [
        {"corpus": corpus.path_prefix, "document": int(d), "tokens": [int(b + o), int(b + e)]}
        for d, b, o, e in zip(documents, before, offsets, ends, strict=True)
    ]
