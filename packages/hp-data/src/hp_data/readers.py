"""Documents out of every input format a corpus comes in, in a stable order.

The main process turns inputs into *work units* (one per file or HF dataset, or a part of one:
plan.py) and each unit into *chunks* in order; workers turn a chunk into validated texts.
Every problem is reported with where it is: `file:line` for JSON lines, `file: row N` for
Parquet and HF datasets.

Order: inputs in the order given; a directory or glob stands for its matching files sorted by
name; inside a file, lines (or rows) in file order. An input named again (another spelling, a
link, a glob or directory that holds it) is read once, where it first occurs, with a warning.
"""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import sys
import time
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from stat import S_ISREG
from typing import Any, BinaryIO

import orjson

from hp_data.errors import PreprocessError
from hp_data.fs import first_line
from hp_data.redact import redact
from hp_data.remote import (
    Pin,
    canonical_url,
    expand,
    identify,
    is_url,
    local_path,
    open_pinned,
    size_of,
)

SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".json.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".json.zst": "jsonl.zst",
    ".jsonl.zstd": "jsonl.zst",
    ".parquet": "parquet",
}
FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf-saved", "hf")
HF_SAVED_MARKERS = ("state.json", "dataset_dict.json")
ROWS_PER_CHUNK = 4096
# How messages name the setting that chooses the keys: the CLI's flag, unless a caller that
# configures them otherwise (hp-train's data.text_key) passes its own name.
KEYS_OPTION = "--json-keys"
STDIN = "-"
# The longest text read by default. tokenizers holds several structures per byte and per
# token while it encodes one text (a 11M-character line of CJK text peaked at 4.7 GB), so one
# enormous record could take a worker's memory; longer ones are invalid records, `file:line`.
MAX_DOCUMENT_CHARS = 10_000_000
LENGTH_OPTION = "--max-document-chars"


@dataclass(frozen=True)
class WorkUnit:
    """One input, or a part of one that a worker processes whole: the input is a file or an
    HF dataset directory, with what identifies its contents; a part is bytes `[start, end)` of
    a plain JSONL file or row groups `[start, end)` of a Parquet file (`end=None`: the whole
    input). Not a machine's share of a split run: that is a shard (shards.py)."""

    path: str
    format: str
    size: int
    mtime_ns: int
    start: int = 0
    end: int | None = None
    first_row: int = 0  # rows of a Parquet file before this part, for `file: row N`
    part_bytes: int | None = None  # input bytes this part stands for (None: `size`)
    pin: Pin | None = None  # what the input was when planned, checked by every read

    @property
    def identity(self) -> list[object]:
        """What a resumed run, a shard's manifest and a merge compare: the path as `redact`
        prints it (so a rotated password or a fresh presigned URL names the same input), with
        what identifies the contents (size and mtime; a URL's size and ETag or version)."""
        whole = [redact(self.path), self.format, self.size, self.mtime_ns]
        return whole if self.end is None else [*whole, self.start, self.end]

    @property
    def nbytes(self) -> int:
        return self.size if self.part_bytes is None else self.part_bytes

    @property
    def reusable(self) -> bool:
        """Whether a later run may reuse this unit finished: not when nothing strong tells
        the input's changes (a server without ETag or version: `Pin.strong`)."""
        return self.pin is None or self.pin.strong


@dataclass
class Chunk:
    """A piece of one work unit for one worker: a byte range, a block of lines, or rows."""

    unit: int  # the unit's index in the run
    path: str
    format: str
    start: int = 0  # byte range of a plain JSONL file
    end: int = 0
    blob: bytes | None = None  # whole lines, for compressed JSONL
    rows: dict[str, list[Any]] | None = None  # columns, for Parquet and HF datasets
    input_bytes: int = 0  # bytes of the input this chunk accounts for, for progress
    last: bool = False  # the unit's final chunk
    pin: Pin | None = None  # the unit's, for a byte range read in a worker


@dataclass
class Parsed:
    """The valid texts of a chunk (one list per key) and what was wrong with the rest."""

    texts: list[list[str]]
    records: int = 0  # non-blank lines or rows
    lines: int = 0  # all lines (rows) of the chunk, to number the next chunk's lines
    invalid: list[tuple[int, str, str]] = field(default_factory=list)  # (offset, kind, why)
    offsets: list[int] | None = None  # each text's line (row) in the chunk, when asked for


# hp's metadata beside a dataset (format/metadata.py): JSON by name, never a corpus, so a
# directory or glob that also holds outputs does not read it.
HP_METADATA = ".hp.json"


def _files_in(directory: str) -> list[str]:
    names = sorted(os.listdir(directory))
    return [os.path.join(directory, n) for n in names if _corpus_format(n) is not None]


def _corpus_format(name: str) -> str | None:
    """The format of a file a directory holds, or None when it is no corpus."""
    return None if name.endswith(HP_METADATA) else suffix_format(name)


def suffix_format(name: str) -> str | None:
    lowered = name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if lowered.endswith(suffix):
            return SUFFIXES[suffix]
    return None


def _tree_size(path: str) -> tuple[int, int]:
    size = mtime = 0
    for root, _, files in os.walk(path):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            size += stat.st_size
            mtime = max(mtime, stat.st_mtime_ns)
    return size, mtime


def _same_input(path: str) -> tuple[object, ...]:
    """What two names of one input share: standard input; a URL as fsspec normalises it; a
    local file or directory (a `file://` URL too, `discover`) by
    device and inode, so `./a`, a symbolic link and a hard link are `a`."""
    if path == STDIN:
        return (STDIN,)
    if is_url(path):
        return ("url", canonical_url(path))  # not redacted: `?key=a` and `?key=b` differ
    stat = os.stat(path)
    return ("local", stat.st_dev, stat.st_ino)


def _read_once(named: Sequence[tuple[str, list[str]]]) -> list[str]:
    """The paths that the `named` inputs (each with the paths it stands for) stand for, each
    input once, where it first occurs: a corpus read twice would train on its documents twice.
    One warning for each name that stood for an input already read."""
    first: dict[tuple[object, ...], tuple[str, str]] = {}  # input: (its path, its name)
    for spec, paths in named:
        again = []
        for path in paths:
            key = _same_input(path)
            if key in first:
                again.append((path, *first[key]))
            else:
                first[key] = (path, spec)
        if not again:
            continue
        if paths == [spec]:  # named outright, not a glob or directory
            _, earlier, its_name = again[0]
            if earlier == spec:
                what = "named more than once" if its_name == spec else f"already in {its_name}"
            else:
                what = f"the same input as {earlier}"
        else:
            shown = ", ".join(path for path, _, _ in again[:3]) + (", ..." if again[3:] else "")
            inputs = "input" if len(again) == 1 else "inputs"
            what = f"holds {len(again)} {inputs} named before ({shown})"
        # Redacted here, each URL on its own: the line's redaction would take the ':' after a
        # secret query value for part of the value.
        warnings.warn(f"{redact(spec)}: {redact(what)}; read once, where first named", stacklevel=3)
    return [path for path, _ in first.values()]


def discover(specs: Sequence[str], input_format: str | None = None) -> list[WorkUnit]:
    """The inputs for paths, globs and directories, each one whole unit, in the documented
    order (`plan.plan_units` cuts them into smaller units).

    A directory holding a saved HF dataset (`state.json` or `dataset_dict.json`) is one
    input; with `input_format="hf"` a directory is loaded with `datasets.load_dataset` (local
    files only); any other directory stands for its corpus files.
    """
    if input_format is not None and input_format not in FORMATS:
        raise PreprocessError(f"unknown --input-format {input_format!r}; use one of {FORMATS}")
    named: list[tuple[str, list[str]]] = []  # each input named, with the paths it stands for
    for name in specs:
        spec = local_path(name)
        paths: list[str] = []
        named.append((name, paths))
        if is_url(spec):
            found = expand(spec, _corpus_format)
            paths.extend(url for url in found if url == spec or not url.endswith(HP_METADATA))
            continue
        if glob.has_magic(spec) and not os.path.exists(spec):
            matches = [m for m in sorted(glob.glob(spec)) if not m.endswith(HP_METADATA)]
            if not matches:
                raise PreprocessError(f"{spec}: pattern matches no files")
        else:
            matches = [spec]
        for match in matches:
            if match == STDIN:
                paths.append(match)
                continue
            if not os.path.exists(match):
                raise PreprocessError(f"{match}: no such file or directory")
            is_dataset_dir = input_format in ("hf", "hf-saved") or any(
                os.path.exists(os.path.join(match, m)) for m in HF_SAVED_MARKERS
            )
            if os.path.isdir(match) and not is_dataset_dir:
                found = _files_in(match)
                if not found:
                    raise PreprocessError(
                        f"{match}: directory holds no corpus files ({', '.join(SUFFIXES)})"
                    )
                paths.extend(found)
            else:
                paths.append(match)
    sources: list[WorkUnit] = []
    for path in _read_once(named):
        if path == STDIN:
            fmt = input_format or "jsonl"
            if fmt not in ("jsonl", "jsonl.gz"):
                raise PreprocessError(
                    f"standard input (-) can be read as jsonl or jsonl.gz, not {fmt}; "
                    "decompress it into the pipe (e.g. zstd -dc FILE | hp-data preprocess -)"
                )
            sources.append(WorkUnit(path, fmt, 0, time.time_ns()))
            continue
        if is_url(path):
            fmt = input_format or suffix_format(path.split("?", 1)[0])  # a presigned query
            if fmt is None or fmt.startswith("hf"):
                raise PreprocessError(
                    f"{path}: a URL is read as a jsonl, jsonl.gz, jsonl.zst or parquet file; "
                    "name its format with --input-format"
                )
            pin = identify(path)
            sources.append(WorkUnit(path, fmt, pin.size, pin.number, pin=pin))
            continue
        if os.path.isdir(path):
            if input_format == "hf":
                fmt = "hf"
            elif any(os.path.exists(os.path.join(path, m)) for m in HF_SAVED_MARKERS):
                fmt = "hf-saved"
            else:
                raise PreprocessError(
                    f"{path}: not a saved HF dataset (no state.json); "
                    f"use --input-format hf to load it with datasets.load_dataset"
                )
            size, mtime = _tree_size(path)
            pin = None
        else:
            fmt = input_format or suffix_format(path)
            if input_format is not None and input_format.startswith("hf"):
                raise PreprocessError(
                    f"{path}: --input-format {input_format} reads a directory (an HF dataset), "
                    f"and this is a file; use --input-format jsonl or parquet, or none"
                )
            if fmt is None or fmt.startswith("hf"):
                raise PreprocessError(
                    f"{path}: cannot tell the format from the name; name it with --input-format"
                )
            stat = os.stat(path)
            if not S_ISREG(stat.st_mode):
                raise PreprocessError(
                    f"{path}: not a regular file (a pipe or a device has no size to split or "
                    f"resume by); give its contents on standard input as -"
                )
            size, mtime, pin = stat.st_size, stat.st_mtime_ns, Pin.of_stat(stat)
        sources.append(WorkUnit(path, fmt, size, mtime, pin=pin))
    if not sources:
        raise PreprocessError("no input files given")
    return sources


# -- the main process: units into chunks ----------------------------------------------------


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


# -- the workers: chunks into texts ---------------------------------------------------------


def read_chunk(
    chunk: Chunk,
    keys: Sequence[str],
    stop_at_invalid: bool,
    check_unicode: bool = False,
    with_offsets: bool = False,
    keys_option: str = KEYS_OPTION,
    max_chars: int | None = None,
) -> Parsed:
    """The valid texts of `chunk`; invalid records are listed (and end the chunk when
    `stop_at_invalid`), a missing key's reason naming the keys' setting as `keys_option`;
    a text longer than `max_chars` characters is invalid (None: any length).

    JSON may escape lone surrogates (`"\\ud800"`), which no tokenizer can encode. Checking
    every text costs time on every chunk, so the worker asks for `check_unicode` only when the
    tokenizer refused one, and reads the chunk again."""
    if chunk.rows is not None:
        return _parse_rows(
            chunk.rows, keys, stop_at_invalid, check_unicode, with_offsets, keys_option, max_chars
        )
    if chunk.blob is not None:
        data = chunk.blob
    else:
        with open_pinned(chunk.path, chunk.pin, "a .jsonl file") as stream:
            stream.seek(chunk.start)
            data = stream.read(chunk.end - chunk.start)
    return _parse_lines(
        data, keys, stop_at_invalid, check_unicode, with_offsets, keys_option, max_chars
    )


def _json_problem(exc: Exception) -> tuple[str, str]:
    """(kind, reason) for a line `json.loads` refused."""
    if isinstance(exc, UnicodeDecodeError):
        return ("invalid UTF-8", f"invalid UTF-8 at byte {exc.start} of the line")
    if isinstance(exc, json.JSONDecodeError):
        return ("malformed JSON", f"malformed JSON: {exc.msg} (column {exc.colno})")
    if isinstance(exc, RecursionError):
        return ("nested too deeply", "JSON nested too deeply to parse")
    # int() refuses numbers of more than sys.get_int_max_str_digits() digits.
    return ("number too long", f"a JSON number too long to read ({str(exc).split(':')[0]})")


def _surrogate_at(text: str) -> int | None:
    """Where `text` holds a lone surrogate (not valid Unicode text), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _load(raw: bytes) -> Any:
    """`json.loads(raw)`, about 3x faster: orjson reads what it can, and what it refuses
    (NaN, escaped lone surrogates, a BOM, numbers past a double, and every error) the
    standard library decides; so what is accepted, each text and each message stay json's."""
    try:
        return orjson.loads(raw)
    except (orjson.JSONDecodeError, RecursionError):
        return json.loads(raw)  # json.loads accepts UTF-8 bytes and strict checks it


def _parse_lines(
    data: bytes,
    keys: Sequence[str],
    stop_at_invalid: bool,
    check_unicode: bool = False,
    with_offsets: bool = False,
    keys_option: str = KEYS_OPTION,
    max_chars: int | None = None,
) -> Parsed:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    parsed = Parsed([[] for _ in keys], lines=len(lines))
    offsets = parsed.offsets = [] if with_offsets else None
    single = keys[0] if len(keys) == 1 else None
    longest = sys.maxsize if max_chars is None else max_chars
    for offset, raw in enumerate(lines):
        if not raw.strip():
            continue
        parsed.records += 1
        try:
            record = _load(raw)
        except (ValueError, RecursionError) as exc:
            problem = _json_problem(exc)
        else:
            if (
                not check_unicode
                and single is not None
                and type(record) is dict
                and type(record.get(single)) is str
                and len(record[single]) <= longest
            ):
                parsed.texts[0].append(record[single])  # the common case, checked cheaply
                if offsets is not None:
                    offsets.append(offset)
                continue
            problem = _record_problem(record, keys, check_unicode, keys_option, longest)
            if problem is None:
                for column, key in zip(parsed.texts, keys, strict=True):
                    column.append(record[key])
                if offsets is not None:
                    offsets.append(offset)
                continue
        parsed.invalid.append((offset, *problem))
        if stop_at_invalid:
            break
    return parsed


def _record_problem(
    record: Any,
    keys: Sequence[str],
    check_unicode: bool = False,
    keys_option: str = KEYS_OPTION,
    longest: int = sys.maxsize,
) -> tuple[str, str] | None:
    if not isinstance(record, dict):
        return ("not an object", f"expected a JSON object, got {type(record).__name__}")
    for key in keys:
        if key not in record:
            return ("missing key", f"missing key {key!r} (choose keys with {keys_option})")
        if not isinstance(record[key], str):
            return ("not a string", f"{key!r} must be a string, got {type(record[key]).__name__}")
        if len(record[key]) > longest:
            return (
                "too long",
                f"{key!r} is {len(record[key]):,} characters long, more than {LENGTH_OPTION} "
                f"{longest:,} (tokenizing a text takes hundreds of bytes of memory a character); "
                "raise the limit, or skip such records with --skip-invalid",
            )
        if check_unicode and (at := _surrogate_at(record[key])) is not None:
            return ("lone surrogate", f"{key!r} holds a lone surrogate at character {at}")
    return None


def _parse_rows(
    rows: dict[str, list[Any]],
    keys: Sequence[str],
    stop_at_invalid: bool,
    check_unicode: bool = False,
    with_offsets: bool = False,
    keys_option: str = KEYS_OPTION,
    max_chars: int | None = None,
) -> Parsed:
    count = len(rows[keys[0]]) if keys else 0
    parsed = Parsed([[] for _ in keys], records=count, lines=count)
    offsets = parsed.offsets = [] if with_offsets else None
    columns = [rows[key] for key in keys]
    longest = sys.maxsize if max_chars is None else max_chars
    for offset, values in enumerate(zip(*columns, strict=True)):
        problem = None
        if check_unicode or not all(type(v) is str and len(v) <= longest for v in values):
            record = dict(zip(keys, values, strict=True))
            problem = _record_problem(record, keys, check_unicode, keys_option, longest)
        if problem is None:
            for column, value in zip(parsed.texts, values, strict=True):
                column.append(value)
            if offsets is not None:
                offsets.append(offset)
            continue
        parsed.invalid.append((offset, *problem))
        if stop_at_invalid:
            break
    return parsed


def location(unit: WorkUnit, line: int) -> str:
    """`file:line` for JSON lines, `file: row N` for tables (both 1-based; `line` counts
    from the start of the part)."""
    if unit.path == STDIN:
        return f"<stdin>:{line}"
    name = redact(unit.path)  # kept in manifests and summaries (invalid_examples)
    if unit.format.startswith("jsonl"):
        return f"{name}:{lines_before(unit.path, unit.start, unit.pin) + line}"
    return f"{name}: row {unit.first_row + line}"


@functools.lru_cache(maxsize=64)
def lines_before(path: str, offset: int, pin: Pin | None) -> int:
    """Lines of `path` before byte `offset` (a line start): counted only when a part that
    starts inside a file reports a line, so runs without errors never pay for it."""
    if offset == 0:
        return 0
    count = 0
    with open_pinned(path, pin, "a .jsonl file") as stream:
        while offset > 0:
            block = stream.read(min(offset, 16 << 20))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count
