"""The invariants a `.bin`/`.idx` pair must hold, checked in bounded memory.

The reader stops at the first problem; `hp-data inspect --check` lists them all. Both walk
the arrays in fixed-size chunks, so checking a billion-sequence index costs time, not memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from hp_data.errors import IndexedDatasetError
from hp_data.format.blocks import record_problems
from hp_data.format.header import bin_path, idx_path, map_index_arrays, read_layout
from hp_data.format.metadata import read_metadata

CHUNK = 1 << 20


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def array_problems(
    lengths: np.ndarray,
    pointers: np.ndarray,
    documents: np.ndarray,
    itemsize: int,
    bin_size: int,
    idx_name: str,
    bin_name: str,
) -> Iterator[str]:
    """Yield one line per broken invariant of the index arrays and the `.bin` size."""
    for problem in _index_problems(lengths, pointers, documents, itemsize):
        yield f"{idx_name}: {problem}"
    if len(lengths) == 0 or lengths.min() >= 0:
        total = int(lengths.sum(dtype=np.int64)) * itemsize
        problem = bin_size_problem(total, itemsize, bin_size, bin_name)
        if problem:
            yield problem


def _index_problems(
    lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray, itemsize: int
) -> Iterator[str]:
    sequence_count = len(lengths)

    negative, first_negative = 0, -1
    bad_pointers, first_bad_pointer = 0, (-1, 0, 0)
    running = 0  # byte pointer the next sequence must start at
    ends = np.empty(CHUNK, dtype=np.int64)  # reused: byte ends of the chunk's sequences
    for start in range(0, sequence_count, CHUNK):
        chunk_lengths = lengths[start : start + CHUNK]
        count = len(chunk_lengths)
        if chunk_lengths.min() < 0:  # rare: count them, then carry on with the pointers
            below = chunk_lengths < 0
            if negative == 0:
                first_negative = start + _first(below)
            negative += int(below.sum())
        chunk_ends = ends[:count]
        np.cumsum(chunk_lengths, dtype=np.int64, out=chunk_ends)
        chunk_ends *= itemsize
        chunk_ends += running
        chunk_pointers = pointers[start : start + count]
        # Sequence i must start where sequence i - 1 ends; the first where the last chunk did.
        if chunk_pointers[0] != running or not np.array_equal(chunk_pointers[1:], chunk_ends[:-1]):
            expected = np.concatenate(([running], chunk_ends[:-1]))
            wrong = chunk_pointers != expected
            if bad_pointers == 0:
                at = _first(wrong)
                first_bad_pointer = (start + at, int(chunk_pointers[at]), int(expected[at]))
            bad_pointers += int(wrong.sum())
        running = int(chunk_ends[-1])
    if negative:
        yield (
            f"{negative} sequence length(s) are negative "
            f"(first: sequence {first_negative} has {int(lengths[first_negative])})"
        )
    if bad_pointers:
        index, got, want = first_bad_pointer
        yield (
            f"{bad_pointers} sequence pointer(s) are not the running sum of lengths "
            f"(first: sequence {index} points at byte {got}, expected {want})"
        )

    if documents[0] != 0:
        yield f"document boundaries must start at 0, found {int(documents[0])}"
    if documents[-1] != sequence_count:
        yield (
            f"document boundaries must end at the sequence count {sequence_count}, "
            f"found {int(documents[-1])}"
        )
    decreasing, first_decrease = 0, -1
    for start in range(0, len(documents) - 1, CHUNK):
        chunk = documents[start : start + CHUNK + 1]
        down = chunk[1:] < chunk[:-1]  # not np.diff: a difference can overflow int64
        if down.any():
            if decreasing == 0:
                first_decrease = start + _first(down) + 1
            decreasing += int(down.sum())
    if decreasing:
        yield (
            f"document boundaries are not monotonic: {decreasing} decrease(s) "
            f"(first: boundary {first_decrease} is {int(documents[first_decrease])} "
            f"after {int(documents[first_decrease - 1])})"
        )


def bin_size_problem(expected: int, itemsize: int, bin_size: int, bin_name: str) -> str | None:
    """A line when the `.bin` is not exactly as long as the index says, else None."""
    if bin_size == expected:
        return None
    return (
        f"{bin_name}: size {bin_size} bytes, but the index's sequence lengths add up to "
        f"{expected // itemsize} tokens x {itemsize} bytes = {expected} bytes; "
        f"the .bin and .idx do not belong together, or one is truncated"
    )


def dataset_problems(prefix: str, multimodal: bool = False) -> list[str]:
    """Every broken invariant of the local dataset at `prefix`, one line each; empty when
    sound (a URL prefix's: `hp_data.dataset.dataset_problems`)."""
    try:
        layout = read_layout(idx_path(prefix), multimodal)
    except IndexedDatasetError as exc:
        return [str(exc)]
    data = bin_path(prefix)
    if not os.path.isfile(data):
        return [f"{data}: no such file"]
    lengths, pointers, documents, _ = map_index_arrays(layout, with_modes=False)
    problems = list(
        array_problems(
            lengths,
            pointers,
            documents,
            layout.dtype.itemsize,
            os.path.getsize(data),
            layout.path,
            data,
        )
    )
    try:
        metadata = read_metadata(prefix)
    except IndexedDatasetError as exc:
        return [*problems, str(exc)]
    # The record is read only of a .bin that is sound so far: one of the wrong size is named.
    return problems or record_problems(prefix, metadata, data)
