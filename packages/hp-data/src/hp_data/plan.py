"""Inputs into work units, and work units into the groups of a run split over machines.

A *unit* is a part of one input that is read on its own: a byte range of a plain JSONL file
that starts and ends on line starts (a record belongs to the range its first byte is in), a
run of Parquet row groups, or a whole file (compressed files and HF datasets cannot be cut).
Units keep the documented input order, so the concatenation of their outputs is the output
of the whole run: a run split into N groups of contiguous units, one per machine, merges into
exactly the bytes of a one-machine run. A one-machine run uses units too, which lets a killed
run over one huge file resume from its last finished unit.

The plan depends only on the inputs (paths, sizes, modification times) and the unit size, so
every machine of a Slurm array or Ray cluster computes the same plan on its own.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import xxhash

from hp_data.errors import PreprocessError
from hp_data.readers.units import STDIN, WorkUnit
from hp_data.redact import redact
from hp_data.remote import is_url, open_pinned

DEFAULT_UNIT_BYTES = 256 << 20
MIN_UNIT_BYTES = 1 << 20


def _unit_bytes_for(total: int, units: int | None, shard_count: int) -> int:
    """The unit size for about `units` units, or by default 256 MiB but small enough for four
    units a shard when a run is split in `shard_count` shards (never under 1 MiB)."""
    if units is not None:
        return max(math.ceil(total / units), 1)
    if shard_count > 1:
        return max(min(DEFAULT_UNIT_BYTES, math.ceil(total / (4 * shard_count))), MIN_UNIT_BYTES)
    return DEFAULT_UNIT_BYTES


def plan_units(
    sources: Sequence[WorkUnit],
    unit_bytes: int | None = None,
    units_wanted: int | None = None,
    shard_count: int = 1,
) -> list[WorkUnit]:
    """The work units of `sources` (whole inputs from `readers.discover`), in input order: of
    `unit_bytes` each, else about `units_wanted` of them, else the default for a run split
    in `shard_count` shards."""
    if unit_bytes is None:
        unit_bytes = _unit_bytes_for(sum(s.size for s in sources), units_wanted, shard_count)
    units: list[WorkUnit] = []
    for source in sources:
        if source.format == "jsonl" and source.path != STDIN and source.size > unit_bytes:
            units.extend(_byte_ranges(source, unit_bytes))
        elif source.format == "parquet":
            units.extend(_row_group_runs(source, unit_bytes))
        else:
            units.append(source)
    return units


def _byte_ranges(source: WorkUnit, unit_bytes: int) -> list[WorkUnit]:
    starts = [0]
    with open_pinned(source.path, source.pin, "a .jsonl file") as stream:
        for cut in range(unit_bytes, source.size, unit_bytes):
            stream.seek(cut - 1)
            stream.readline()  # to the first line start at or after the cut
            if stream.tell() > starts[-1] and stream.tell() < source.size:
                starts.append(stream.tell())
    ends = [*starts[1:], source.size]
    return [
        replace(source, start=start, end=end, part_bytes=end - start)
        for start, end in zip(starts, ends, strict=True)
    ]


def _row_group_runs(source: WorkUnit, unit_bytes: int) -> list[WorkUnit]:
    from hp_data.readers import require

    parquet = require("pyarrow.parquet", "parquet")
    with open_pinned(source.path, source.pin, "a Parquet file") as stream:
        try:
            metadata = parquet.ParquetFile(stream if is_url(source.path) else source.path).metadata
        except PreprocessError:
            raise  # a remote read that failed (remote.py)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise PreprocessError(f"{source.path}: not a readable Parquet file: {exc}") from None
    groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
    total = max(sum(g.total_byte_size for g in groups), 1)
    units: list[WorkUnit] = []
    first = rows = size = 0
    for index, group in enumerate(groups):
        size += group.total_byte_size
        if size >= unit_bytes or index == len(groups) - 1:
            share = source.size * size // total  # the file's bytes, shared by data size
            units.append(
                replace(source, start=first, end=index + 1, first_row=rows, part_bytes=share)
            )
            rows += sum(groups[g].num_rows for g in range(first, index + 1))
            first, size = index + 1, 0
    return units or [source]


def shard_groups(units: Sequence[WorkUnit], count: int) -> list[range]:
    """Which units each of `count` shards processes: contiguous, balanced by bytes (a unit
    goes to the shard its middle byte falls in; a shard may get none)."""
    total = max(sum(unit.nbytes for unit in units), 1)
    owners, before = [], 0
    for unit in units:
        owners.append(min((2 * before + unit.nbytes) * count // (2 * total), count - 1))
        before += unit.nbytes
    # Owners never decrease along the units, so each shard's units are one contiguous run.
    return [range(bisect_left(owners, g), bisect_left(owners, g + 1)) for g in range(count)]


def plan_fingerprint(units: Sequence[WorkUnit]) -> str:
    """What a shard's output covers, comparable across machines."""
    return xxhash.xxh3_128_hexdigest(json.dumps([u.identity for u in units]).encode())


def describe(units: Sequence[WorkUnit], groups: list[range] | None = None) -> dict[str, Any]:
    """The plan as JSON-ready data: every unit with its kind, range, bytes and shard. API:
    what `hp-data plan` prints (its --json keys: docs/cli.md)."""
    owner = {i: g for g, members in enumerate(groups or []) for i in members}
    rows = []
    for index, unit in enumerate(units):
        kind = "file"
        if unit.end is not None:
            kind = "bytes" if unit.format == "jsonl" else "row groups"
        row = {"unit": index, "path": redact(unit.path), "format": unit.format, "kind": kind}
        if unit.end is not None:
            row |= {"start": unit.start, "end": unit.end}
        row["bytes"] = unit.nbytes
        if groups is not None:
            row["shard"] = owner.get(index)
        rows.append(row)
    return {
        "units": rows,
        "total_bytes": sum(unit.nbytes for unit in units),
        "fingerprint": plan_fingerprint(units),
        "shards": None if groups is None else [[g.start, g.stop] for g in groups],
    }


def shard_name(prefix: str, index: int, count: int) -> str:
    """`PREFIX.shard-0000I-of-0000N`: where shard I of N writes."""
    return f"{prefix}.shard-{index:05d}-of-{count:05d}"
