"""Corpus files -> tokens -> `.bin`/`.idx`: the parallel, resumable pipeline.

The main process cuts every work unit (an input, or a part of one: plan.py) into chunks, in
order; a pool of worker processes parses, checks and tokenizes chunks (one single-threaded
tokenizer each); the main process takes the results back in order, drops exact duplicates,
and appends them to the unit's own dataset in a work directory beside the output. A finished
unit is finalized and recorded in a manifest; a rerun with the same arguments reuses every
finished unit up to the first unfinished one. When all units are done they are concatenated
into the final output, atomically, and the work directory is removed.

The output depends only on the inputs and the options: not on `--workers`, the chunking,
or where an earlier run was killed.

The package, one job a module, each importing only those listed before it: `options` (what a
run is asked for), `summary` (what it did), `worker` (the worker processes and their pool),
`workdir` (the resumable work directory), `unit_writer` (results into each unit's dataset),
`driver` (`preprocess`, from start to end). The names below are the public API.
"""

from hp_data.pipeline.driver import check_shardable, preprocess
from hp_data.pipeline.options import (
    PreprocessOptions,
    default_workers,
    megatron_keys,
    output_prefixes,
)
from hp_data.pipeline.summary import PreprocessSummary, format_summary
from hp_data.pipeline.unit_writer import INVALID_EXAMPLES
from hp_data.pipeline.workdir import MANIFEST_VERSION
from hp_data.pipeline.worker import VERIFY_EVERY, VERIFY_FIRST, EngineMismatch, refuse_reentry

__all__ = [
    "INVALID_EXAMPLES",
    "MANIFEST_VERSION",
    "VERIFY_EVERY",
    "VERIFY_FIRST",
    "EngineMismatch",
    "PreprocessOptions",
    "PreprocessSummary",
    "check_shardable",
    "default_workers",
    "format_summary",
    "megatron_keys",
    "output_prefixes",
    "preprocess",
    "refuse_reentry",
]
