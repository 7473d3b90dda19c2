"""Every broken invariant, made in a real file, raises IndexedDatasetError naming the file."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hp_data import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from hp_data.format.validate import dataset_problems

# A fixed dataset: 3 documents over 4 sequences of lengths 3, 0, 1, 3 (uint16).
LENGTHS = [3, 0, 1, 3]
BOUNDARIES = [0, 2, 2, 4]
HEADER = 34
S, D = len(LENGTHS), len(BOUNDARIES)
POINTERS_AT = HEADER + 4 * S
BOUNDARIES_AT = HEADER + 12 * S


@pytest.fixture
def prefix(tmp_path: Path) -> str:
    prefix = str(tmp_path / "ds")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_item([1, 2, 3])
        builder.add_item([])
        builder.end_document()
        builder.end_document()
        builder.add_document([5, 6, 7, 8], [1, 3])
    return prefix


def test_fixture_is_what_the_constants_say(prefix):
    ds = IndexedDataset(prefix)
    assert ds.sequence_lengths.tolist() == LENGTHS
    assert ds.document_indices.tolist() == BOUNDARIES
    assert ds.sequence_pointers.tolist() == [0, 6, 6, 8]
    assert Path(prefix + ".idx").stat().st_size == HEADER + 12 * S + 8 * D
    assert dataset_problems(prefix) == []


def _patch(path: str, offset: int, data: bytes) -> None:
    raw = bytearray(Path(path).read_bytes())
    raw[offset : offset + len(data)] = data
    Path(path).write_bytes(bytes(raw))


def _truncate(path: str, size: int) -> None:
    Path(path).write_bytes(Path(path).read_bytes()[:size])


Corruption = Callable[[str], None]
CASES: list[tuple[str, Corruption, str, str]] = [
    ("magic", lambda p: _patch(p + ".idx", 0, b"X"), ".idx", "wrong magic b'XMIDIDX"),
    ("empty idx", lambda p: _truncate(p + ".idx", 0), ".idx", "wrong magic b''"),
    (
        "short header",
        lambda p: _truncate(p + ".idx", 20),
        ".idx",
        "truncated header (20 of 34 bytes)",
    ),
    (
        "version",
        lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)),
        ".idx",
        "unsupported version 2",
    ),
    ("dtype code", lambda p: _patch(p + ".idx", 17, bytes([9])), ".idx", "unknown dtype code 9"),
    (
        "truncated idx",
        lambda p: _truncate(p + ".idx", HEADER + 12 * S + 8 * D - 1),
        ".idx",
        f"size {HEADER + 12 * S + 8 * D - 1} bytes does not match its header",
    ),
    (
        "sequence count",
        lambda p: _patch(p + ".idx", 18, struct.pack("<Q", S + 1)),
        ".idx",
        f"({S + 1} sequences, {D} document boundaries need",
    ),
    (
        "huge count",
        lambda p: _patch(p + ".idx", 26, struct.pack("<Q", 2**64 - 1)),
        ".idx",
        "does not match its header",
    ),
    (
        "document count zero",
        lambda p: _patch(p + ".idx", 26, struct.pack("<Q", 0)),
        ".idx",
        "document count is 0",
    ),
    (
        "bin too short",
        lambda p: _truncate(p + ".bin", 12),
        ".bin",
        "size 12 bytes, but the index's sequence lengths add up to 7 tokens x 2 bytes = 14",
    ),
    (
        "bin too long",
        lambda p: Path(p + ".bin").write_bytes(Path(p + ".bin").read_bytes() + b"\0\0"),
        ".bin",
        "size 16 bytes",
    ),
    ("bin missing", lambda p: Path(p + ".bin").unlink(), ".bin", "no such file"),
    ("idx missing", lambda p: Path(p + ".idx").unlink(), ".idx", "no such file"),
    (
        "negative length",
        lambda p: _patch(p + ".idx", HEADER + 4, struct.pack("<i", -1)),
        ".idx",
        "1 sequence length(s) are negative (first: sequence 1 has -1)",
    ),
    (
        "pointer",
        lambda p: _patch(p + ".idx", POINTERS_AT + 8 * 3, struct.pack("<q", 10)),
        ".idx",
        "1 sequence pointer(s) are not the running sum of lengths "
        "(first: sequence 3 points at byte 10, expected 8)",
    ),
    (
        "boundary order",
        lambda p: _patch(p + ".idx", BOUNDARIES_AT + 8, struct.pack("<q", 3)),
        ".idx",
        "document boundaries are not monotonic: 1 decrease(s) (first: boundary 2 is 2 after 3)",
    ),
    (
        "first boundary",
        lambda p: _patch(p + ".idx", BOUNDARIES_AT, struct.pack("<q", 1)),
        ".idx",
        "document boundaries must start at 0, found 1",
    ),
    (
        "last boundary",
        lambda p: _patch(p + ".idx", BOUNDARIES_AT + 8 * 3, struct.pack("<q", 3)),
        ".idx",
        f"document boundaries must end at the sequence count {S}, found 3",
    ),
]


@pytest.mark.parametrize(
    ("corrupt", "suffix", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("mmap", [True, False])
def test_corruption_is_reported_with_file_and_reason(prefix, corrupt, suffix, message, mmap):
    corrupt(prefix)
    with pytest.raises(IndexedDatasetError) as caught:
        IndexedDataset(prefix, mmap=mmap)
    text = str(caught.value)
    assert text.startswith(prefix + suffix + ": "), text
    assert message in text
    assert "\n" not in text
    # The full check reports the same problem.
    assert any(message in problem for problem in dataset_problems(prefix))


def test_check_lists_every_problem(prefix):
    _patch(prefix + ".idx", POINTERS_AT + 8 * 3, struct.pack("<q", 10))
    _patch(prefix + ".idx", BOUNDARIES_AT + 8, struct.pack("<q", 3))
    _truncate(prefix + ".bin", 12)
    problems = dataset_problems(prefix)
    assert len(problems) == 3
    assert "sequence pointer" in problems[0]
    assert "not monotonic" in problems[1]
    assert problems[2].startswith(prefix + ".bin: size 12 bytes")


def test_multimodal_read_of_a_file_without_modes(prefix):
    with pytest.raises(IndexedDatasetError, match="with modes need"):
        IndexedDataset(prefix, multimodal=True)


def test_accepts_bin_and_idx_paths(prefix):
    for path in (prefix, prefix + ".idx", prefix + ".bin"):
        assert IndexedDataset(path).path_prefix == prefix


def test_validate_false_still_checks_sizes(prefix):
    _patch(prefix + ".idx", BOUNDARIES_AT + 8, struct.pack("<q", 3))
    IndexedDataset(prefix, validate=False)  # array checks skipped on request
    _truncate(prefix + ".bin", 12)
    with pytest.raises(IndexedDatasetError, match="size 12 bytes"):
        IndexedDataset(prefix, validate=False)
