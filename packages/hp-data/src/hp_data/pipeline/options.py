"""What a preprocess run is asked for: its options, the json keys, the output prefixes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from hp_data.errors import PreprocessError
from hp_data.format.dtypes import DTypeLike
from hp_data.format.header import prefix_of
from hp_data.readers.units import KEYS_OPTION, MAX_DOCUMENT_CHARS
from hp_data.remote import DEFAULT_TIMEOUT


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class PreprocessOptions:
    """Everything besides inputs, output and tokenizer; the defaults are the CLI's."""

    json_keys: tuple[str, ...] = ("text",)
    keys_option: str = KEYS_OPTION  # how messages name the setting of json_keys
    append_eod: bool = False
    eod_token: str | None = None
    add_bos: bool = False
    bos_token: str | None = None
    dtype: DTypeLike | None = None
    workers: int = field(default_factory=default_workers)
    skip_invalid: bool = False
    keep_empty: bool = False
    dedup: str | None = None  # None or "exact"
    input_format: str | None = None
    hf_split: str = "train"  # which split of an HF dataset (the CLI's --split)
    chunk_bytes: int = 1 << 20
    show_progress: bool = True
    unit_bytes: int | None = None  # work-unit size (plan.py); None: its default
    units: int | None = None  # or about this many work units
    num_shards: int = 1  # with shard_index: process one of num_shards groups of units
    shard_index: int | None = None
    tokenizer_engine: str = "auto"  # auto, hf or tiktoken (tokenize.ENGINES)
    allow_download: bool = False  # a hub tokenizer not in the local cache may be fetched
    megatron_names: bool = False  # PREFIX_{key}_document for every key, as Megatron names them
    verify: bool = False  # check the fast engine on every document, not one in VERIFY_EVERY
    max_document_chars: int | None = MAX_DOCUMENT_CHARS  # a longer text is invalid; None: any
    remote_timeout: float = DEFAULT_TIMEOUT  # seconds a remote request may wait (remote.py)


def megatron_keys(values: Sequence[str]) -> tuple[str, ...]:
    """`json_keys` from Megatron's `--json-keys text title` (a key a value) and hp's
    `--json-keys text,title` (several a value, by commas or spaces) alike, in order."""
    return tuple(key for value in values for key in value.replace(",", " ").split())


def output_prefixes(
    out_prefix: str, keys: tuple[str, ...], megatron_names: bool = False
) -> dict[str, str]:
    """`PREFIX` for one key; Megatron's `PREFIX_{key}_document` for each of several, or for
    every key with `megatron_names` (what `--output-prefix` gives)."""
    if not os.path.basename(prefix_of(out_prefix)):
        raise PreprocessError(
            f"--out {out_prefix!r}: the prefix needs a file name, e.g. out/corpus "
            "(writes out/corpus.bin and out/corpus.idx)"
        )
    out_prefix = prefix_of(out_prefix)
    if len(keys) == 1 and not megatron_names:
        return {keys[0]: out_prefix}
    return {key: f"{out_prefix}_{key}_document" for key in keys}
