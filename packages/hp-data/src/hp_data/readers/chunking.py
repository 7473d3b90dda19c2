"""The main process's side of reading: a work unit into chunks, in order (byte ranges of
JSON lines, blocks of decompressed lines, rows of Parquet files and HF datasets)."""

from __future__ import annotations

import gzip
import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from hp_data.errors import PreprocessError
from hp_data.fs import first_line
from hp_data.readers.units import (
    KEYS_OPTION,
    STDIN,
    Chunk,
    WorkUnit,
)
from hp_data.remote import (
    is_url,
    open_pinned,
    size_of,
)

ROWS_PER_CHUNK = 4096


def chunks(
    index: int,
    unit: WorkUnit,
    keys: Sequence[str],
    chunk_bytes: int,
    hf_split: str = "train",
    cache_dir: str | None = None,
    quiet: bool = False,
    keys_option: str = KEYS_OPTION,
) -> Iterator[Chunk]:
    """The chunks of one unit in order; the last has `last=True` (an empty unit has one).

    `hf_split` (which split of an HF dataset), `cache_dir` (the cache of `load_dataset`) and
    `quiet` apply to HF datasets; `keys_option` names the keys' setting in a message about a
    missing column."""
    if unit.path == STDIN:
        produced = _stream_blocks(index, unit, chunk_bytes, sys.stdin.buffer)
    elif unit.format == "jsonl":
        produced = _jsonl_ranges(index, unit, chunk_bytes)
    elif unit.format in ("jsonl.gz", "jsonl.zst"):
        produced = _compressed_blocks(index, unit, chunk_bytes)
    elif unit.format == "parquet":
        produced = _parquet_rows(index, unit, keys, keys_option)
    else:
        produced = _hf_rows(index, unit, keys, hf_split, cache_dir, quiet, keys_option)
    previous: Chunk | None = None
    for chunk in produced:
        if previous is not None:
            yield previous
        previous = chunk
    if previous is None:
        previous = Chunk(index, unit.path, unit.format, rows=None, blob=b"")
    previous.last = True
    yield previous


def _jsonl_ranges(index: int, unit: WorkUnit, chunk_bytes: int) -> Iterator[Chunk]:
    with open_pinned(unit.path, unit.pin, "a .jsonl file") as stream:
        size = size_of(stream)
        size = size if unit.end is None else min(unit.end, size)
        start = unit.start  # a part starts on a line start (plan.py)
        while start < size:
            stream.seek(min(start + chunk_bytes, size))
            stream.readline()  # extend to the end of the line the cut falls in
            end = min(stream.tell(), size)
            yield Chunk(
                index, unit.path, unit.format, start, end, input_bytes=end - start, pin=unit.pin
            )
            start = end


def _open_compressed(stream: BinaryIO, fmt: str) -> BinaryIO:
    if fmt == "jsonl.gz":
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)


ZSTD_MAGIC = 0xFD2FB528

ZSTD_SKIPPABLE = range(0x184D2A50, 0x184D2A60)


def zstd_frames_problem(stream: BinaryIO, size: int) -> str | None:
    """Why the zstd frames in `stream` do not end exactly at `size` (None when they do).

    zstandard's stream reader ends quietly at a frame cut short, so a truncated `.zst` would
    lose its tail unnoticed. Walking the frame and block headers (RFC 8878) finds the cut
    without decompressing: a few bytes read per block of up to 128 KiB."""

    def read(at: int, count: int) -> int | None:
        stream.seek(at)
        data = stream.read(count)
        return int.from_bytes(data, "little") if len(data) == count else None

    position = 0
    while position < size:
        magic = read(position, 4)
        if magic in ZSTD_SKIPPABLE:
            length = read(position + 4, 4)
            if length is None or position + 8 + length > size:
                return f"truncated zstd skippable frame at byte {position}"
            position += 8 + length
            continue
        if magic != ZSTD_MAGIC:
            return f"no zstd frame at byte {position}"
        descriptor = read(position + 4, 1)
        if descriptor is None:
            return f"truncated zstd frame at byte {position}"
        single_segment = bool(descriptor & 0x20)
        content_size = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
        dictionary = (0, 1, 2, 4)[descriptor & 3]
        block = position + 5 + (0 if single_segment else 1) + dictionary + content_size
        while True:
            header = read(block, 3)
            if header is None:
                return f"truncated zstd frame at byte {position}"
            kind, length = (header >> 1) & 3, header >> 3
            if kind == 3:
                return f"corrupt zstd block at byte {block}"
            block += 3 + (1 if kind == 1 else length)
            if header & 1:
                break
        position = block + (4 if descriptor & 0x04 else 0)  # the content checksum
        if position > size:
            return f"truncated zstd frame at byte {block}"
    return None


class _Counted:
    """A binary stream that counts the bytes read from it (a pipe has no `tell`)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.count += len(data)
        return data


def _compressed_blocks(index: int, unit: WorkUnit, chunk_bytes: int) -> Iterator[Chunk]:
    with open_pinned(unit.path, unit.pin, "a compressed .jsonl file", read_ahead=True) as raw:
        yield from _stream_blocks(index, unit, chunk_bytes, raw, unit.size)
        if unit.format == "jsonl.zst":
            problem = zstd_frames_problem(raw, size_of(raw))
            if problem:
                raise PreprocessError(f"{unit.path}: corrupt zstd data: {problem}")


def _stream_blocks(
    index: int, unit: WorkUnit, chunk_bytes: int, raw: BinaryIO, size: int = 0
) -> Iterator[Chunk]:
    """Whole lines of a stream read front to back: a compressed file (of `size` bytes, all
    of them counted done at its end), or standard input."""
    import zstandard

    counted = _Counted(raw)
    reader = counted if unit.format == "jsonl" else _open_compressed(counted, unit.format)
    name = "standard input" if unit.path == STDIN else unit.path
    kind = "gzip" if unit.format == "jsonl.gz" else "zstd"
    carry = b""
    consumed = 0
    while True:
        try:
            block = reader.read(chunk_bytes)
        except (OSError, EOFError, zlib.error, zstandard.ZstdError) as exc:
            raise PreprocessError(f"{name}: corrupt {kind} data: {exc}") from None
        if not block:
            break
        data = carry + block
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            carry = data
            continue
        carry = data[cut:]
        yield Chunk(
            index, unit.path, unit.format, blob=data[:cut], input_bytes=counted.count - consumed
        )
        consumed = counted.count
    if counted.count == 0 and unit.format != "jsonl":
        # Both readers take no bytes as no lines; an empty stream has a header (20 bytes of
        # gzip, 9 of zstd), so this is a file cut to nothing, not a compressed empty corpus.
        empty = "empty" if unit.path == STDIN else "empty file"
        raise PreprocessError(f"{name}: {empty}, not a {kind} stream")
    if carry or consumed < max(size, counted.count):
        rest = max(size, counted.count) - consumed
        yield Chunk(index, unit.path, unit.format, blob=carry, input_bytes=rest)


def require(module: str, extra: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise PreprocessError(
            f"reading this input needs {module.split('.')[0]}: pip install 'hp-data[{extra}]'"
        ) from None


def _parquet_rows(
    index: int, unit: WorkUnit, keys: Sequence[str], keys_option: str = KEYS_OPTION
) -> Iterator[Chunk]:
    parquet = require("pyarrow.parquet", "parquet")
    with open_pinned(unit.path, unit.pin, "a Parquet file") as stream:
        source = stream if is_url(unit.path) else unit.path  # pyarrow's own reads, locally
        try:
            table = parquet.ParquetFile(source)
        except PreprocessError:
            raise  # a remote read that failed (remote.py)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise PreprocessError(f"{unit.path}: not a readable Parquet file: {exc}") from None
        yield from _row_batches(index, unit, table, keys, keys_option)


def _row_batches(
    index: int, unit: WorkUnit, table: Any, keys: Sequence[str], keys_option: str
) -> Iterator[Chunk]:
    names = table.schema_arrow.names
    _check_columns(unit.path, names, keys, keys_option)
    rows = max(table.metadata.num_rows, 1)
    groups = range(table.metadata.num_row_groups)
    if unit.end is not None:
        groups = range(unit.start, unit.end)
        rows = max(sum(table.metadata.row_group(g).num_rows for g in groups), 1)
    first = unit.first_row + 1  # the first row of the group, for the error
    for group in groups:
        batches = table.iter_batches(ROWS_PER_CHUNK, row_groups=[group], columns=list(keys))
        while True:
            try:
                batch = next(batches, None)
                columns = batch.to_pydict() if batch is not None else None
            except PreprocessError:
                raise
            except Exception as exc:  # pyarrow raises several types for a corrupt page
                reason = " ".join(str(exc).split()) or type(exc).__name__
                raise PreprocessError(
                    f"{unit.path}: row group {group} (from row {first}): corrupt Parquet "
                    f"data: {reason}"
                ) from None
            if batch is None:
                break
            share = unit.nbytes * batch.num_rows // rows
            yield Chunk(index, unit.path, unit.format, rows=columns, input_bytes=share)
        first += table.metadata.row_group(group).num_rows


def _check_columns(
    path: str, names: Sequence[str], keys: Sequence[str], keys_option: str = KEYS_OPTION
) -> None:
    missing = [key for key in keys if key not in names]
    if missing:
        raise PreprocessError(
            f"{path}: no column {missing[0]!r} (columns: {', '.join(names)}); "
            f"choose one with {keys_option}"
        )


def load_hf_dataset(
    unit: WorkUnit, hf_split: str, cache_dir: str | None, quiet: bool = False
) -> Any:
    """The `datasets.Dataset` of an HF input, never touching a hub; `quiet` hides the
    progress bars `datasets` draws while it converts files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets = require("datasets", "hf")
    was_enabled = not datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        if unit.format == "hf-saved":
            loaded = datasets.load_from_disk(unit.path)
        else:
            loaded = datasets.load_dataset(unit.path, split=hf_split, cache_dir=cache_dir)
    except Exception as exc:  # datasets raises many types for a bad directory
        raise PreprocessError(
            f"{unit.path}: cannot load as an HF dataset: {first_line(exc)}"
        ) from None
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    if isinstance(loaded, datasets.DatasetDict):
        if hf_split not in loaded:
            raise PreprocessError(
                f"{unit.path}: no split {hf_split!r} (splits: {', '.join(loaded)}); use --split"
            )
        loaded = loaded[hf_split]
    return loaded


def _hf_rows(
    index: int,
    unit: WorkUnit,
    keys: Sequence[str],
    hf_split: str,
    cache_dir: str | None,
    quiet: bool,
    keys_option: str = KEYS_OPTION,
) -> Iterator[Chunk]:
    dataset = load_hf_dataset(unit, hf_split, cache_dir, quiet)
    _check_columns(unit.path, dataset.column_names, keys, keys_option)
    total = max(len(dataset), 1)
    selected = dataset.select_columns(list(keys))
    for start in range(0, len(dataset), ROWS_PER_CHUNK):
        columns = selected[start : start + ROWS_PER_CHUNK]
        count = len(columns[keys[0]])
        yield Chunk(
            index, unit.path, unit.format, rows=columns, input_bytes=unit.size * count // total
        )
