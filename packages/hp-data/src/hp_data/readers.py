"""Documents out of corpus files, in a stable order, with `file:line` for every error."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from hp_data.errors import PreprocessError, open_input


def read_jsonl(
    path: str, key: str = "text", batch_size: int = 1024
) -> Iterator[tuple[list[str], int]]:
    """Texts under `key` of the JSON object lines of `path`, in batches.

    Yields `(texts, bytes_read)`: up to `batch_size` texts and how far into the file they
    reach, for progress. Blank lines are skipped. Anything else that is not an object with a
    string under `key` raises PreprocessError as `path:line: reason`.
    """
    with open_input(path, PreprocessError, "a .jsonl file") as stream:
        texts: list[str] = []
        offset = 0
        for number, raw in enumerate(stream, start=1):
            offset += len(raw)
            if not raw.strip():
                continue
            texts.append(_text_of(raw, key, path, number))
            if len(texts) == batch_size:
                yield texts, offset
                texts = []
        if texts:
            yield texts, offset


def _text_of(raw: bytes, key: str, path: str, number: int) -> str:
    where = f"{path}:{number}"
    try:
        line = raw.rstrip(b"\r\n").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PreprocessError(f"{where}: invalid UTF-8 at byte {exc.start} of the line") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PreprocessError(f"{where}: malformed JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(record, dict):
        raise PreprocessError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if key not in record:
        raise PreprocessError(f"{where}: missing key {key!r} (choose one with --json-keys)")
    text = record[key]
    if not isinstance(text, str):
        raise PreprocessError(f"{where}: {key!r} must be a string, got {type(text).__name__}")
    return text


def total_size(paths: list[str]) -> int:
    """Bytes across `paths`, for the progress bar's ETA (missing files count as 0)."""
    return sum(os.path.getsize(path) for path in paths if os.path.isfile(path))
