"""`IndexedDataset`: read a Megatron `.bin`/`.idx` pair, checked on open, zero-copy when mmapped."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from hp_data.errors import IndexedDatasetError, open_input
from hp_data.format.commit import recover
from hp_data.format.header import (
    IndexLayout,
    bin_path,
    idx_path,
    map_file,
    map_index_arrays,
    read_layout,
)
from hp_data.format.validate import array_problems, bin_size_problem


class RemoteBin(Protocol):
    """A `.bin` read from elsewhere, its `.idx` copied to `local_prefix + ".idx"`: what a
    subclass that opens URL prefixes (`hp_data.dataset`) reads through (`remote`)."""

    local_prefix: str
    bin_size: int

    def read(self, offset: int, nbytes: int) -> np.ndarray: ...

    def close(self) -> None: ...


class IndexedDataset:
    """A tokenised corpus in Megatron's IndexedDataset v1 format.

    `ds[i]` is sequence `i` (a read-only view of the `.bin` when `mmap=True`), `ds[a:b]` a list
    of contiguous sequences, `ds.get_document(d)` all tokens of document `d`. For multimodal
    datasets `ds[i]` returns `(tokens, mode)` and slices `(list, modes)`, as in megatron-core.

    Opening checks every structural invariant (see `hp_data.format.validate`) and raises
    `IndexedDatasetError` naming the file; pass `validate=False` to skip the array checks
    (the header and file sizes are always checked).

    This class reads local files; `hp_data.IndexedDataset` (`hp_data.dataset`) also opens a
    URL prefix, through `remote`: its index arrays come from a local copy of the `.idx`,
    mapped as a local one is, its tokens from `remote.read`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        mmap: bool = True,
        multimodal: bool = False,
        validate: bool = True,
    ) -> None:
        self.path_prefix = os.fspath(path)
        self.mmap = mmap
        self.multimodal = multimodal
        self._validate = validate
        self.remote: RemoteBin | None = None
        self._open()

    def _connect(self) -> RemoteBin | None:
        """What reads this prefix's `.bin` from elsewhere; None (here, always): local files."""
        return None

    def _open_remote(self, remote: RemoteBin) -> IndexLayout:
        local = remote.local_prefix + ".idx"
        try:
            return read_layout(local, self.multimodal)
        except IndexedDatasetError as exc:  # named as the user named it
            raise IndexedDatasetError(str(exc).replace(local, self.idx_path)) from None

    def _open(self) -> None:
        self.idx_path = idx_path(self.path_prefix)
        self.bin_path = bin_path(self.path_prefix)
        self.path_prefix = self.idx_path[:-4]
        self._bin_file = None
        if self.remote is None:  # else unpickled: not asked again
            self.remote = self._connect()
        if self.remote is not None:
            self._layout: IndexLayout = self._open_remote(self.remote)
        else:
            recover(self.path_prefix)  # a commit a kill interrupted is finished before reading
            self._layout = read_layout(self.idx_path, self.multimodal)
        layout = self._layout
        self.dtype: np.dtype = layout.dtype
        self._itemsize = layout.dtype.itemsize

        self._lengths, self._pointers, self._documents, self._modes = map_index_arrays(
            layout, with_modes=self.multimodal
        )

        if self.remote is None:
            self._bin_file = open_input(self.bin_path, IndexedDatasetError, "a .bin file")
        bin_size = self._bin_size()
        if self._validate:
            problems: Iterable[str] = array_problems(
                self._lengths,
                self._pointers,
                self._documents,
                self._itemsize,
                bin_size,
                self.idx_path,
                self.bin_path,
            )
        else:
            expected = int(self._lengths.sum(dtype=np.int64)) * self._itemsize
            problem = bin_size_problem(expected, self._itemsize, bin_size, self.bin_path)
            problems = [problem] if problem else []
        for problem in problems:
            self.close()
            raise IndexedDatasetError(problem)
        local_map = self.mmap and self._bin_file is not None
        bin_map = map_file(self._bin_file, bin_size) if local_map else None
        self._bin_view = memoryview(bin_map) if bin_map is not None else None

    # -- the index -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._layout.sequence_count

    @property
    def num_documents(self) -> int:
        return self._layout.document_count - 1

    @property
    def num_tokens(self) -> int:
        return self._bin_size() // self._itemsize

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 tokens per sequence."""
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of each sequence in the `.bin`."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 sequence boundaries of documents: document d is sequences [b[d], b[d+1])."""
        return self._documents

    @property
    def sequence_modes(self) -> np.ndarray | None:
        """int8 mode per sequence for multimodal datasets, else None."""
        return self._modes

    # -- reads -----------------------------------------------------------------------------

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        if self.remote is not None:
            return self.remote.read(byte_offset, count * self._itemsize).view(self.dtype)
        if self._bin_view is not None:
            # The map is read-only, so the view is too: zero-copy and safe to hand out.
            return np.frombuffer(self._bin_view, self.dtype, count, byte_offset)
        if self._bin_file is None or self._bin_file.closed:
            raise IndexedDatasetError(f"{self.path_prefix}: read after close(); open it again")
        out = np.empty(count, dtype=self.dtype)
        got = os.preadv(self._bin_file.fileno(), [out], byte_offset)
        if got != out.nbytes:
            raise IndexedDatasetError(f"{self.bin_path}: short read at byte {byte_offset}")
        return out

    def __getitem__(self, idx: int | np.integer | slice) -> Any:
        if isinstance(idx, (int, np.integer)):
            return self.get(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an IndexedDataset must be contiguous (step 1)")
            stop = max(start, stop)
            lengths = self._lengths[start:stop]
            if len(lengths) == 0:
                tokens: list[np.ndarray] = []
            else:
                flat = self._read(self._pointers.item(start), int(lengths.sum(dtype=np.int64)))
                tokens = np.split(flat, np.cumsum(lengths[:-1], dtype=np.int64))
            if self._modes is not None:
                return tokens, self._modes[start:stop]
            return tokens
        raise TypeError(f"IndexedDataset indices must be int or slice, not {type(idx).__name__}")

    def get(self, idx: int | np.integer, offset: int = 0, length: int | None = None) -> Any:
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end when length is None)."""
        count = self._layout.sequence_count
        idx = int(idx)  # a narrow numpy integer would overflow below
        if idx < 0:
            idx += count
        if not 0 <= idx < count:
            raise IndexError(f"sequence {idx} out of range for {count} sequences")
        size = self._lengths.item(idx)
        # Python ints: an int32 offset from a sample index would overflow in `offset * itemsize`.
        offset = int(offset)
        length = size - offset if length is None else int(length)
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                f"of length {size}"
            )
        tokens = self._read(self._pointers.item(idx) + offset * self._itemsize, length)
        if self._modes is not None:
            return tokens, self._modes[idx]
        return tokens

    def get_document(self, doc: int) -> np.ndarray:
        """All tokens of document `doc`, its sequences back to back (one contiguous read)."""
        count, doc = self.num_documents, int(doc)
        if not -count <= doc < count:
            raise IndexError(f"document {doc} out of range for {count} documents")
        doc = doc + count if doc < 0 else doc
        first, end = int(self._documents[doc]), int(self._documents[doc + 1])
        if first == end:
            return np.empty(0, dtype=self.dtype)
        last = end - 1
        stop = int(self._pointers[last]) + int(self._lengths[last]) * self._itemsize
        start = int(self._pointers[first])
        return self._read(start, (stop - start) // self._itemsize)

    # -- lifetime --------------------------------------------------------------------------

    def _bin_size(self) -> int:
        if self.remote is not None:
            return self.remote.bin_size
        return os.fstat(self._bin_file.fileno()).st_size  # type: ignore[union-attr]

    @property
    def bin_bytes(self) -> int:
        """The size of the `.bin` (local or behind a URL, asked of neither again)."""
        return self._bin_size()

    def close(self) -> None:
        """Release the file handle and maps; views handed out keep their memory alive."""
        self._bin_view = None
        bin_file = getattr(self, "_bin_file", None)
        if bin_file is not None:
            bin_file.close()
        if getattr(self, "remote", None) is not None:
            self.remote.close()  # type: ignore[union-attr]

    def __enter__(self) -> IndexedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Maps and file handles do not pickle; a DataLoader worker reopens by path (a URL's
        # `remote` with it: its pins and cache directory, the store is not asked again).
        return {
            "path_prefix": self.path_prefix,
            "mmap": self.mmap,
            "multimodal": self.multimodal,
            "_validate": False,
            "remote": self.remote,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}, dtype={self.dtype}, sequences={len(self)}, "
            f"documents={self.num_documents})"
        )
