"""What the readers hand on: a work unit (an input, or a part of one), a chunk of a unit,
the parsed texts of a chunk; and the settings' names and limits that their messages share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hp_data.redact import redact
from hp_data.remote import (
    Pin,
)

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
