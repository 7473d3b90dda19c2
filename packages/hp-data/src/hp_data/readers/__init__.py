"""Documents out of every input format a corpus comes in, in a stable order.

The main process turns inputs into *work units* (one per file or HF dataset, or a part of one:
plan.py) and each unit into *chunks* in order; workers turn a chunk into validated texts.
Every problem is reported with where it is: `file:line` for JSON lines, `file: row N` for
Parquet and HF datasets.

Order: inputs in the order given; a directory or glob stands for its matching files sorted by
name; inside a file, lines (or rows) in file order. An input named again (another spelling, a
link, a glob or directory that holds it) is read once, where it first occurs, with a warning.

The package, one stage a module: `units` (what the stages hand on), `discovery` (inputs into
units), `chunking` (units into chunks, in the main process), `parsing` (chunks into texts, in
the workers). The names below are what the rest of hp-data imports.
"""

from hp_data.readers.chunking import (
    ROWS_PER_CHUNK,
    ZSTD_MAGIC,
    ZSTD_SKIPPABLE,
    chunks,
    load_hf_dataset,
    require,
    zstd_frames_problem,
)
from hp_data.readers.discovery import (
    FORMATS,
    HF_SAVED_MARKERS,
    HP_METADATA,
    SUFFIXES,
    discover,
    suffix_format,
)
from hp_data.readers.parsing import lines_before, location, read_chunk
from hp_data.readers.units import (
    KEYS_OPTION,
    LENGTH_OPTION,
    MAX_DOCUMENT_CHARS,
    STDIN,
    Chunk,
    Parsed,
    WorkUnit,
)

__all__ = [
    "FORMATS",
    "HF_SAVED_MARKERS",
    "HP_METADATA",
    "KEYS_OPTION",
    "LENGTH_OPTION",
    "MAX_DOCUMENT_CHARS",
    "ROWS_PER_CHUNK",
    "STDIN",
    "SUFFIXES",
    "ZSTD_MAGIC",
    "ZSTD_SKIPPABLE",
    "Chunk",
    "Parsed",
    "WorkUnit",
    "chunks",
    "discover",
    "lines_before",
    "load_hf_dataset",
    "location",
    "read_chunk",
    "require",
    "suffix_format",
    "zstd_frames_problem",
]
