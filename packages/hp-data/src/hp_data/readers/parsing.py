"""The workers' side of reading: a chunk into validated texts, each problem reported with
where it is (`file:line` for JSON lines, `file: row N` for Parquet and HF datasets)."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from hp_data.readers.units import (
    KEYS_OPTION,
    LENGTH_OPTION,
    STDIN,
    Chunk,
    Parsed,
    WorkUnit,
)
from hp_data.redact import redact
from hp_data.remote import (
    Pin,
    open_pinned,
)


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
