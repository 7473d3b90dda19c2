"""Concatenate datasets into one, streaming, in the order given. Where their documents came
from is not this layer's: the caller passes how to merge it (`hp_data.merge_datasets`)."""

from __future__ import annotations

import glob
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hp_data.errors import IndexedDatasetError
from hp_data.format.builder import IndexedDatasetBuilder
from hp_data.format.commit import recover
from hp_data.format.header import (
    METADATA_SUFFIX,
    SOURCES_SUFFIX,
    IndexLayout,
    bin_path,
    idx_path,
    prefix_of,
    read_layout,
)
from hp_data.format.metadata import shared_metadata
from hp_data.progress import Progress


def expand_prefixes(specs: Iterable[str]) -> list[str]:
    """Dataset prefixes for prefixes, `.bin`/`.idx` paths, globs and directories.

    A directory stands for every `*.idx` in it and a glob for every match (but hp's
    `.hp.json` beside a dataset), each sorted by name; the order of `specs` is kept and a
    prefix named twice is kept once.
    """
    prefixes: list[str] = []
    for spec in specs:
        if os.path.isdir(spec):
            matches = sorted(glob.glob(os.path.join(glob.escape(spec), "*.idx")))
            if not matches:
                raise IndexedDatasetError(f"{spec}: directory holds no .idx files")
        elif glob.has_magic(spec):
            matches = [
                m
                for m in sorted(glob.glob(spec))
                if not m.endswith((METADATA_SUFFIX, SOURCES_SUFFIX))
            ]
            if not matches:
                raise IndexedDatasetError(f"{spec}: pattern matches no files")
        else:
            matches = [spec]
        for match in matches:
            prefix = prefix_of(match)
            if prefix not in prefixes:
                prefixes.append(prefix)
            elif match == spec:  # named twice outright, not just matched by a glob again
                warnings.warn(f"{prefix}: named more than once; merged once", stacklevel=2)
    return prefixes


Sources = Callable[[Sequence[str], Sequence[IndexLayout]], Any]


def merge_datasets(
    out_prefix: str,
    in_prefixes: list[str],
    multimodal: bool = False,
    show_progress: bool = False,
    sources: Sources | None = None,
) -> str:
    """Write `out_prefix` as the concatenation of `in_prefixes`; returns the output prefix.

    Every input header is checked before anything is written, so a mixed-dtype merge fails
    fast and leaves no output. The output records the inputs' tokenizer when they all record
    the same one (`shared_metadata`). `sources(in_prefixes, layouts)`, called once the inputs
    are checked, gives what the output records as where its documents came from (the
    builder's `sources`; None: nothing, as without `sources`).
    """
    if not in_prefixes:
        raise IndexedDatasetError("merge needs at least one input dataset")
    out_prefix = prefix_of(out_prefix)
    for prefix in in_prefixes:
        recover(prefix)
    layouts = [read_layout(idx_path(prefix), multimodal) for prefix in in_prefixes]
    for prefix in in_prefixes:
        if os.path.abspath(prefix) == os.path.abspath(out_prefix):
            raise IndexedDatasetError(f"{prefix}: output prefix is also an input; choose another")
        if not os.path.exists(bin_path(prefix)):
            raise IndexedDatasetError(f"{bin_path(prefix)}: no such file")
    dtypes = {layout.dtype for layout in layouts}
    if len(dtypes) > 1:
        described = ", ".join(f"{layout.path} is {layout.dtype}" for layout in layouts)
        raise IndexedDatasetError(
            f"cannot merge datasets of different dtypes ({described}); "
            f"re-tokenize them with one --dtype"
        )
    total = sum(os.path.getsize(bin_path(prefix)) for prefix in in_prefixes)
    progress = Progress(total, "merge", enabled=show_progress)
    metadata = shared_metadata(in_prefixes)
    merged = None if sources is None else sources(in_prefixes, layouts)
    with IndexedDatasetBuilder(
        out_prefix, layouts[0].dtype, multimodal, metadata, merged
    ) as builder:
        for prefix in in_prefixes:
            builder.add_index(prefix, on_bytes=progress.add_bytes)
    progress.close()
    return out_prefix
