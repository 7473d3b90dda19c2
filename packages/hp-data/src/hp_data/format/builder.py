"""`IndexedDatasetBuilder`: write a Megatron `.bin`/`.idx` pair atomically in bounded memory."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from hp_data.errors import IndexedDatasetError
from hp_data.format.blocks import KEY, hash_file
from hp_data.format.commit import commit
from hp_data.format.dtypes import DTypeLike, as_token_dtype, check_token_range
from hp_data.format.header import drop_pages, pack_header, prefix_of
from hp_data.format.metadata import SCHEMA
from hp_data.format.reader import IndexedDataset
from hp_data.redact import redact_data

_INT32_MAX = np.iinfo(np.int32).max
COPY_BUFFER = 16 << 20


class _SpillColumn:
    """An append-only column of numbers that spills to a file in fixed-size blocks.

    The builder keeps lengths, boundaries and modes here instead of Python lists, so memory
    stays flat however many sequences and documents pass through.
    """

    BLOCK = 1 << 16

    def __init__(self, path: str, dtype: type) -> None:
        self._path = path
        self._file = open(path, "w+b")  # noqa: SIM115 - closed by close()
        self._buffer = np.empty(self.BLOCK, dtype=dtype)
        self._filled = 0
        self.count = 0
        self.last = 0  # the most recently appended value

    def append(self, value: int) -> None:
        if self._filled == self.BLOCK:
            self._flush()
        self._buffer[self._filled] = value
        self._filled += 1
        self.count += 1
        self.last = value

    def extend(self, values: np.ndarray | Sequence[int]) -> None:
        if isinstance(values, list) and len(values) <= 8:  # per-document calls: skip numpy
            for value in values:
                self.append(value)
            return
        values = np.asarray(values)
        if len(values) < self.BLOCK - self._filled:
            self._buffer[self._filled : self._filled + len(values)] = values
            self._filled += len(values)
        else:
            self._flush()
            self._file.write(np.ascontiguousarray(values, dtype=self._buffer.dtype).tobytes())
        if len(values):
            self.count += len(values)
            self.last = int(values[-1])

    def _flush(self) -> None:
        self._file.write(self._buffer[: self._filled].tobytes())
        self._filled = 0

    def blocks(self, size: int = 1 << 20) -> Iterator[np.ndarray]:
        """Everything appended so far, in order, `size` items at a time."""
        self._flush()
        self._file.flush()
        self._file.seek(0)
        while True:
            block = np.fromfile(self._file, dtype=self._buffer.dtype, count=size)
            if len(block) == 0:
                return
            yield block

    def close(self) -> None:
        self._file.close()


def finalize_together(builders: Sequence[IndexedDatasetBuilder]) -> None:
    """Finalize datasets of one directory with one commit point: all appear, or none."""
    try:
        commit([builder._prepare() for builder in builders])
    except BaseException:
        for builder in builders:
            builder.abort()
        raise
    for builder in builders:
        builder._cleanup()


def _copy(source: BinaryIO, target: BinaryIO, on_bytes: Callable[[int], None] | None) -> None:
    """Append all of `source` to `target`: in the kernel with `copy_file_range` where the
    filesystems allow it (no copy through Python; server-side on NFS, a reflink on XFS and
    btrfs), else through a buffer."""
    target.flush()
    position = target.tell()
    try:
        while copied := os.copy_file_range(source.fileno(), target.fileno(), COPY_BUFFER * 4):
            position += copied
            if on_bytes is not None:
                on_bytes(copied)
        target.seek(position)
        return
    except (OSError, AttributeError):  # no such call here, or not between these files
        target.seek(position)
    while block := source.read(COPY_BUFFER):
        target.write(block)
        if on_bytes is not None:
            on_bytes(len(block))


def _remove_directory(path: str) -> None:
    """Remove a builder's directory, its lock last: a kill part-way leaves it recognisable."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(path):
            if entry != "lock":
                os.remove(os.path.join(path, entry))
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, "lock"))
    shutil.rmtree(path, ignore_errors=True)


def _remove_abandoned(directory: str, name: str) -> None:
    """Remove the temporary directories of builders of `name` that were killed: those whose
    lock no process holds, or that are empty (killed while being removed)."""
    start = f".{name}.hp-tmp-"
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if not entry.startswith(start):
            continue
        try:
            with open(os.path.join(path, "lock"), "r+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _remove_directory(path)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only when empty
        except OSError:  # alive, or a filesystem without locks: leave it
            continue


class IndexedDatasetBuilder:
    """Build `PREFIX.bin` and `PREFIX.idx`, byte-identical to megatron-core's builder.

    Data goes to a hidden temporary directory beside the output; `finalize()` commits both
    files in one atomic step (`format/commit.py`), so a failure or a kill at any point leaves
    the final paths as they were (an earlier dataset or nothing) or holding the complete new
    dataset. Used as a context manager it finalizes on success and cleans up on an exception.
    Token ids outside `dtype`'s range raise instead of wrapping around. The directories of
    killed builders of the same prefix are removed when the next one starts. `metadata`
    (JSON-able, `format/metadata.py`) is committed with the two files as `PREFIX.hp.json`,
    with the `.bin`'s block hashes (`format/blocks.py`) added, metadata or not (an old
    `PREFIX.hp.json` is replaced: it would describe other tokens). `sources`
    (a `provenance.Provenance`, set before finalizing) becomes `PREFIX.hp.sources` alike.
    """

    def __init__(
        self,
        prefix: str | os.PathLike[str],
        dtype: DTypeLike = np.int32,
        multimodal: bool = False,
        metadata: Mapping[str, Any] | None = None,
        sources: Any = None,
    ) -> None:
        self.prefix = prefix_of(prefix)
        if not os.path.basename(self.prefix):
            raise IndexedDatasetError(
                f"{os.fspath(prefix)!r}: an output prefix needs a file name, e.g. out/corpus "
                "(for out/corpus.bin and out/corpus.idx)"
            )
        self.dtype = as_token_dtype(dtype)
        self.multimodal = multimodal
        self.metadata = metadata
        self.sources = sources  # a provenance.Provenance, committed as PREFIX.hp.sources
        directory = os.path.dirname(os.path.abspath(self.prefix))
        try:
            os.makedirs(directory, exist_ok=True)
            _remove_abandoned(directory, os.path.basename(self.prefix))
            self._tmp = tempfile.mkdtemp(
                prefix=f".{os.path.basename(self.prefix)}.hp-tmp-", dir=directory
            )
            self._lock = open(os.path.join(self._tmp, "lock"), "w")  # noqa: SIM115
        except OSError as exc:
            raise IndexedDatasetError(f"{directory}: cannot write here: {exc.strerror}") from None
        with contextlib.suppress(OSError):  # no locks here: a killed run's directory stays
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._bin = open(os.path.join(self._tmp, "data.bin"), "wb")  # noqa: SIM115
        self._lengths = _SpillColumn(os.path.join(self._tmp, "lengths"), np.int32)
        self._documents = _SpillColumn(os.path.join(self._tmp, "documents"), np.int64)
        self._documents.append(0)
        self._modes = (
            _SpillColumn(os.path.join(self._tmp, "modes"), np.int8) if multimodal else None
        )
        self._done = False

    @property
    def sequence_count(self) -> int:
        return self._lengths.count

    @property
    def document_count(self) -> int:
        return self._documents.count - 1

    def _tokens(self, tokens: Any) -> np.ndarray:
        """`tokens` as a contiguous 1-D array of the dataset's dtype, range-checked."""
        self._check_open()
        if type(tokens) is np.ndarray and tokens.dtype == self.dtype and tokens.ndim == 1:
            return tokens if tokens.flags.c_contiguous else np.ascontiguousarray(tokens)
        array = np.asarray(tokens).reshape(-1)
        check_token_range(array, self.dtype)
        return np.ascontiguousarray(array, dtype=self.dtype)

    def _check_open(self) -> None:
        if self._done:
            raise IndexedDatasetError(f"{self.prefix}: builder already finalized or aborted")

    def add_item(self, tokens: Any, mode: int = 0) -> None:
        """Append one sequence (a list, numpy array or CPU tensor of token ids)."""
        array = self._tokens(tokens)
        if array.size > _INT32_MAX:
            raise IndexedDatasetError(
                f"a sequence of {array.size} tokens exceeds the format's int32 length; split it"
            )
        self._bin.write(array)
        self._lengths.append(array.size)
        if self._modes is not None:
            self._modes.append(mode)

    def end_document(self) -> None:
        """Close the current document after the sequences added with `add_item`."""
        self._check_open()
        self._documents.append(self._lengths.count)

    def add_document(
        self, tokens: Any, lengths: Sequence[int] | np.ndarray, modes: Any = None
    ) -> None:
        """Append one document: `tokens` split into sequences of `lengths`."""
        array = self._tokens(tokens)
        lengths_array = self._lengths_of(lengths, array.size)
        self._bin.write(array)
        self._lengths.extend(lengths_array)
        if self._modes is not None:
            modes_array = np.zeros(len(lengths_array), np.int8) if modes is None else modes
            modes_array = np.asarray(modes_array, dtype=np.int8).reshape(-1)
            if len(modes_array) != len(lengths_array):
                raise IndexedDatasetError(
                    f"add_document: {len(modes_array)} modes for {len(lengths_array)} sequences"
                )
            self._modes.extend(modes_array)
        self._documents.append(self._lengths.count)

    def add_documents(self, tokens: Any, lengths: Sequence[int] | np.ndarray) -> None:
        """Append `len(lengths)` documents of one sequence each, in one write.

        The bulk form of `add_document(doc, [len(doc)])` per document, which is how Megatron's
        preprocessing writes a corpus; the bytes are the same.
        """
        lengths_array = np.asarray(lengths, dtype=np.int64).reshape(-1)
        self.add_batch(tokens, lengths_array, np.ones(len(lengths_array), np.int64))

    def add_batch(
        self,
        tokens: Any,
        sequence_lengths: Sequence[int] | np.ndarray,
        sequences_per_document: Sequence[int] | np.ndarray,
    ) -> None:
        """Append many documents at once: `sequences_per_document[k]` sequences each (0 makes
        a document with no sequences), taking `sequence_lengths` in order."""
        array = self._tokens(tokens)
        lengths_array = self._lengths_of(sequence_lengths, array.size)
        per_document = np.asarray(sequences_per_document, dtype=np.int64).reshape(-1)
        if (per_document.size and per_document.min() < 0) or int(per_document.sum()) != len(
            lengths_array
        ):
            raise IndexedDatasetError(
                f"sequences_per_document must be >= 0 and add up to the {len(lengths_array)} "
                f"sequences, got a total of {int(per_document.sum())}"
            )
        self._bin.write(array)
        first = self._lengths.count
        self._lengths.extend(lengths_array)
        if self._modes is not None:
            self._modes.extend(np.zeros(len(lengths_array), np.int8))
        self._documents.extend(first + np.cumsum(per_document))

    def _lengths_of(
        self, lengths: Sequence[int] | np.ndarray, token_count: int
    ) -> np.ndarray | list[int]:
        """`lengths` checked: each in int32's range, together `token_count`."""
        # A document of a few sequences is the common call: plain ints beat numpy here.
        if (
            isinstance(lengths, (list, tuple))
            and len(lengths) <= 8
            and all(type(n) is int and 0 <= n <= _INT32_MAX for n in lengths)
            and sum(lengths) == token_count
        ):
            return list(lengths)
        lengths_array = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if lengths_array.size and (lengths_array.min() < 0 or lengths_array.max() > _INT32_MAX):
            raise IndexedDatasetError(
                f"sequence lengths must be between 0 and {_INT32_MAX}, "
                f"got min {lengths_array.min()} and max {lengths_array.max()}"
            )
        if int(lengths_array.sum()) != token_count:
            raise IndexedDatasetError(
                f"lengths sum to {int(lengths_array.sum())} but there are {token_count} tokens"
            )
        return lengths_array

    def add_index(
        self,
        other: str | os.PathLike[str],
        on_bytes: Callable[[int], None] | None = None,
        keep: np.ndarray | None = None,
    ) -> int | None:
        """Append every document of another dataset, streaming its `.bin` (dtypes must match);
        with `keep` (a bool per document), only those documents.

        `on_bytes(n)` is called as each block of `n` bytes of the `.bin` is copied. Returns
        the largest id appended when `keep` dropped documents (their tokens were read anyway;
        None when none is left), else None: the source's own record says it.
        """
        self._check_open()
        with IndexedDataset(other, multimodal=self.multimodal) as source:
            if source.dtype != self.dtype:
                raise IndexedDatasetError(
                    f"{source.idx_path}: dtype {source.dtype} differs from the output's "
                    f"{self.dtype}; datasets of different dtypes cannot be concatenated"
                )
            if keep is not None and not np.all(keep):
                return self._add_kept(source, np.asarray(keep, dtype=bool), on_bytes)
            offset = self._lengths.count
            step = 1 << 20
            for start in range(0, len(source), step):
                self._lengths.extend(source.sequence_lengths[start : start + step])
                if self._modes is not None and source.sequence_modes is not None:
                    self._modes.extend(source.sequence_modes[start : start + step])
                drop_pages(source.sequence_lengths)
            boundaries = source.document_indices
            for start in range(1, len(boundaries), step):
                self._documents.extend(boundaries[start : start + step] + offset)
                drop_pages(boundaries)
            with open(source.bin_path, "rb") as data:
                _copy(data, self._bin, on_bytes)
        return None

    def _add_kept(
        self, source: IndexedDataset, keep: np.ndarray, on_bytes: Callable[[int], None] | None
    ) -> int | None:
        """The documents of `source` that `keep` marks, in blocks of documents: each block's
        tokens are read in one piece and masked, so no Python loop runs per document."""
        if self._modes is not None:
            raise IndexedDatasetError("add_index(keep=...) does not carry multimodal modes")
        if len(keep) != source.num_documents:
            raise IndexedDatasetError(
                f"{source.idx_path}: {len(keep)} flags for {source.num_documents} documents"
            )
        boundaries, pointers = source.document_indices, source.sequence_pointers
        end_of_data = os.path.getsize(source.bin_path)

        def offset(document: int) -> int:  # where document `document` starts in the .bin
            sequence = int(boundaries[document])
            return int(pointers[sequence]) if sequence < len(pointers) else end_of_data

        first, largest = 0, None
        with open(source.bin_path, "rb") as data:
            while first < len(keep):
                last = min(first + (1 << 18), len(keep))
                while last > first + 1 and offset(last) - offset(first) > COPY_BUFFER * 4:
                    last = first + (last - first) // 2  # at most 64 MiB of tokens at once
                low, high = int(boundaries[first]), int(boundaries[last])
                lengths = np.asarray(source.sequence_lengths[low:high], dtype=np.int64)
                per_document = np.diff(boundaries[first : last + 1])
                kept_sequences = np.repeat(keep[first:last], per_document)
                tokens = np.empty(0, self.dtype)
                if high > low:
                    data.seek(int(source.sequence_pointers[low]))
                    tokens = np.fromfile(data, self.dtype, int(lengths.sum()))
                kept = tokens[np.repeat(kept_sequences, lengths)]
                self.add_batch(kept, lengths[kept_sequences], per_document[keep[first:last]])
                if len(kept):
                    largest = max(int(kept.max()), -1 if largest is None else largest)
                if on_bytes is not None:
                    on_bytes(tokens.nbytes)
                first = last
        return largest

    def finalize(self) -> str:
        """Write the index and move both files into place atomically; returns the prefix.

        Sequences added after the last `end_document()` form a final document (megatron-core
        would write an index its own reader rejects).
        """
        finalize_together([self])
        return self.prefix

    def _prepare(self) -> tuple[str, str, str, str, str | None]:
        """Write the index (and metadata, provenance) beside the data: (prefix, tmp .bin,
        tmp .idx, tmp .hp.json, tmp .hp.sources or None), ready to commit."""
        self._check_open()
        if self._documents.last != self._lengths.count:
            self._documents.append(self._lengths.count)
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        tmp_idx = os.path.join(self._tmp, "index.idx")
        with open(tmp_idx, "wb") as index:
            self._write_index(index)
            index.flush()
            os.fsync(index.fileno())
        # Every .bin hp writes carries its block hashes (format/blocks.py), metadata or not.
        metadata = {"schema": SCHEMA, **(self.metadata or {}), KEY: hash_file(self._bin.name)}
        tmp_metadata = os.path.join(self._tmp, "metadata.json")
        with open(tmp_metadata, "w", encoding="utf-8") as stream:
            # No credential is ever stored: a tokenizer named by URL is kept redacted.
            json.dump(redact_data(metadata), stream, indent=1, sort_keys=True)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        tmp_sources = None
        if self.sources is not None:
            tmp_sources = os.path.join(self._tmp, "sources")
            self.sources.write(tmp_sources, tmp_idx)
        return self.prefix, self._bin.name, tmp_idx, tmp_metadata, tmp_sources

    def _write_index(self, index: Any) -> None:
        itemsize = self.dtype.itemsize
        index.write(pack_header(self.dtype, self._lengths.count, self._documents.count))
        for block in self._lengths.blocks():
            index.write(block.tobytes())
        running = 0
        for block in self._lengths.blocks():
            ends = np.cumsum(block, dtype=np.int64) * itemsize + running
            starts = np.empty_like(ends)
            starts[0] = running
            starts[1:] = ends[:-1]
            index.write(starts.tobytes())
            running = int(ends[-1])
        for block in self._documents.blocks():
            index.write(block.tobytes())
        if self._modes is not None:
            for block in self._modes.blocks():
                index.write(block.tobytes())

    def abort(self) -> None:
        """Discard everything written so far; nothing appears at the final paths."""
        if not self._done:
            self._cleanup()

    def _cleanup(self) -> None:
        self._done = True
        self._bin.close()
        self._lock.close()
        for column in (self._lengths, self._documents, self._modes):
            if column is not None:
                column.close()
        _remove_directory(self._tmp)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None and not self._done:
            self.finalize()
        else:
            self.abort()

    def __del__(self) -> None:
        if getattr(self, "_done", True) is False:
            self.abort()
