"""`merge_datasets`: datasets concatenated into one with where their documents came from (the
tokens by `format/merge.py`, the `.hp.sources` by `provenance.py`)."""

from __future__ import annotations

from hp_data.format import merge
from hp_data.provenance import merged_provenance


def merge_datasets(
    out_prefix: str, in_prefixes: list[str], multimodal: bool = False, show_progress: bool = False
) -> str:
    """Write `out_prefix` as the concatenation of `in_prefixes`; returns the output prefix.

    Every input header is checked before anything is written, so a mixed-dtype merge fails
    fast and leaves no output. The output records the inputs' tokenizer when they all record
    the same one (`shared_metadata`), and where its documents came from when any input
    records it (provenance.py; an input without a sidecar gives documents of no source).
    """
    return merge.merge_datasets(
        out_prefix, in_prefixes, multimodal, show_progress, sources=merged_provenance
    )


__all__ = ["merge_datasets"]
