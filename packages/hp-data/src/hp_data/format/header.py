"""Paths and the fixed-size header of the `.idx` file, and where each array lies after it.

Layout (Megatron IndexedDataset v1, little-endian, no padding)::

    9 bytes  magic  b"MMIDIDX\\x00\\x00"
    <Q       version (1)
    <B       dtype code of the tokens in .bin
    <Q       sequence count S
    <Q       document-boundary count D (documents + 1)
    int32[S] sequence lengths, in tokens
    int64[S] sequence pointers, in bytes into .bin
    int64[D] document boundaries, sequence indices starting at 0 and ending at S
    int8[S]  sequence modes (multimodal datasets only)
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from hp_data.errors import IndexedDatasetError, open_input
from hp_data.format.dtypes import code_from_dtype, dtype_from_code

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34


def prefix_of(path: str | os.PathLike[str]) -> str:
    """The dataset prefix for a prefix or a path ending in `.bin` or `.idx`."""
    text = os.fspath(path)
    if text.endswith((".bin", ".idx")):
        return text[:-4]
    return text


def idx_path(prefix: str | os.PathLike[str]) -> str:
    return prefix_of(prefix) + ".idx"


def bin_path(prefix: str | os.PathLike[str]) -> str:
    return prefix_of(prefix) + ".bin"


METADATA_SUFFIX = ".hp.json"


def metadata_path(prefix: str | os.PathLike[str]) -> str:
    """hp's `.hp.json` beside the two files (format/metadata.py)."""
    return prefix_of(prefix) + METADATA_SUFFIX


SOURCES_SUFFIX = ".hp.sources"


def sources_path(prefix: str | os.PathLike[str]) -> str:
    """hp's provenance sidecar beside the two files (provenance.py)."""
    return prefix_of(prefix) + SOURCES_SUFFIX


def pack_header(dtype: np.dtype, sequence_count: int, document_count: int) -> bytes:
    """The 34 header bytes for a dataset of `sequence_count` sequences and `document_count`
    boundaries (documents + 1)."""
    return _HEADER.pack(MAGIC, VERSION, code_from_dtype(dtype), sequence_count, document_count)


@dataclass(frozen=True)
class IndexLayout:
    """What the header of one `.idx` file says, checked against the file's size."""

    path: str
    dtype: np.dtype
    sequence_count: int
    document_count: int
    has_modes: bool

    @property
    def lengths_offset(self) -> int:
        return HEADER_SIZE

    @property
    def pointers_offset(self) -> int:
        return HEADER_SIZE + 4 * self.sequence_count

    @property
    def documents_offset(self) -> int:
        return HEADER_SIZE + 12 * self.sequence_count

    @property
    def modes_offset(self) -> int:
        return HEADER_SIZE + 12 * self.sequence_count + 8 * self.document_count


def expected_idx_size(sequence_count: int, document_count: int, with_modes: bool) -> int:
    return HEADER_SIZE + 12 * sequence_count + 8 * document_count + (sequence_count * with_modes)


def read_layout(path: str | os.PathLike[str], multimodal: bool = False) -> IndexLayout:
    """Read and check the header of an `.idx` file.

    Raises IndexedDatasetError naming the file for a missing file, a wrong magic, version or
    dtype code, or counts that do not match the file's size. A non-multimodal read accepts a
    file that also carries modes (as Megatron does) and ignores them.
    """
    path = os.fspath(path)
    with open_input(path, IndexedDatasetError, "an .idx file") as stream:
        raw = stream.read(HEADER_SIZE)
        size = os.fstat(stream.fileno()).st_size

    if len(raw) < 9 or raw[:9] != MAGIC:
        raise IndexedDatasetError(
            f"{path}: wrong magic {raw[:9]!r}, expected {MAGIC!r}; this is not a Megatron .idx file"
        )
    if len(raw) < HEADER_SIZE:
        raise IndexedDatasetError(
            f"{path}: truncated header ({len(raw)} of {HEADER_SIZE} bytes); rebuild the dataset"
        )
    _, version, code, sequence_count, document_count = _HEADER.unpack(raw)
    if version != VERSION:
        raise IndexedDatasetError(f"{path}: unsupported version {version} (hp reads version 1)")
    try:
        dtype = dtype_from_code(code)
    except IndexedDatasetError as exc:
        raise IndexedDatasetError(f"{path}: {exc}") from None
    if document_count < 1:
        raise IndexedDatasetError(
            f"{path}: document count is 0, but a valid index holds at least the boundary 0"
        )

    plain = expected_idx_size(sequence_count, document_count, with_modes=False)
    with_modes = expected_idx_size(sequence_count, document_count, with_modes=True)
    if size == with_modes and (multimodal or sequence_count > 0):
        has_modes = True
    elif size == plain and not multimodal:
        has_modes = False
    else:
        expected = with_modes if multimodal else plain
        raise IndexedDatasetError(
            f"{path}: size {size} bytes does not match its header "
            f"({sequence_count} sequences, {document_count} document boundaries"
            f"{', with modes' if multimodal else ''} need {expected} bytes); "
            f"the file is truncated or corrupt, rebuild it"
        )
    return IndexLayout(path, dtype, sequence_count, document_count, has_modes)


def map_file(stream: Any, size: int) -> np.ndarray | bytes:
    """A read-only map of the first `size` bytes of an open file (empty files cannot be mapped)."""
    if size == 0:
        return b""
    return np.memmap(stream, dtype=np.uint8, mode="r", shape=(size,))


def drop_pages(view: np.ndarray) -> None:
    """Tell the kernel we are done, for now, with the pages of the file `view` maps.

    They stay in the page cache and fault back in on the next read, but leave this process's
    resident set, so walking a huge index once does not look like memory growth.
    """
    base: object = view
    while base is not None and getattr(base, "_mmap", None) is None:
        base = getattr(base, "base", None)
    if base is not None and hasattr(mmap, "MADV_DONTNEED"):
        base._mmap.madvise(mmap.MADV_DONTNEED)  # type: ignore[attr-defined]


def map_index_arrays(
    layout: IndexLayout, with_modes: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Zero-copy views of lengths, pointers, boundaries and (if asked) modes of an `.idx`."""
    count = layout.sequence_count
    size = expected_idx_size(count, layout.document_count, layout.has_modes)
    with open(layout.path, "rb") as stream:
        raw = map_file(stream, size)
    lengths = map_array(raw, np.int32, count, layout.lengths_offset)
    pointers = map_array(raw, np.int64, count, layout.pointers_offset)
    documents = map_array(raw, np.int64, layout.document_count, layout.documents_offset)
    modes = map_array(raw, np.int8, count, layout.modes_offset) if with_modes else None
    return lengths, pointers, documents, modes


def map_array(
    buffer: np.ndarray | memoryview | bytes, dtype: type, count: int, offset: int
) -> np.ndarray:
    """A read-only, zero-copy view of `count` items of `dtype` at byte `offset` of `buffer`."""
    view = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
    view.flags.writeable = False
    return view
