"""The range of token ids a dataset holds, exactly, without reading a corpus more than once.

A trainer needs the largest id before its first step: an embedding smaller than it fails at
the first sample that holds it (on a GPU, a device-side assert). hp-data's preprocess records
it in PREFIX.hp.json as it writes (`max_token_id`, format/metadata.py). Other datasets
(Megatron's own, hp's builder used directly, an older hp-data's) are scanned once, the `.bin`
memory-mapped 64 MiB at a time, and the result is kept in the index cache directory under a
key of the `.bin`'s identity, so a restart reads the record instead: a trillion-token corpus
is some 2 TB of reads.

A URL prefix is scanned only when its `.bin` fits in the chunk cache (its chunks then serve
the run too); a larger one without a record is refused in one line: a check that downloads
terabytes on every node is not what a large run wants.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from hp_data.cache import cache_key, resolve_cache_dir
from hp_data.dataset import IndexedDataset
from hp_data.errors import HpDataError
from hp_data.format.header import drop_pages
from hp_data.format.metadata import read_metadata
from hp_data.fs import write_json
from hp_data.gpt import corpus_fingerprint
from hp_data.object_store import StoreOptions, is_url
from hp_data.redact import redact

CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class TokenIds:
    """What `token_ids` found for one prefix. No id is above `largest` (exact but where
    `source` is "dtype") or below `smallest` (None where not known); both are None when the
    dataset holds no token."""

    largest: int | None
    smallest: int | None
    source: str  # "metadata" (PREFIX.hp.json), "dtype", "cache" (an earlier scan) or "scan"
    metadata: dict[str, Any] | None  # PREFIX.hp.json, for its tokenizer and EOD id


def scan(dataset: IndexedDataset) -> tuple[int | None, int | None]:
    """(smallest, largest) id of the `.bin`, read in bounded chunks of CHUNK_BYTES."""
    itemsize = dataset.dtype.itemsize
    count = dataset.bin_bytes // itemsize
    if count == 0:
        return None, None
    local = dataset.remote is None
    data = np.memmap(dataset.bin_path, dataset.dtype, mode="r", shape=(count,)) if local else None
    step = max(1, CHUNK_BYTES // itemsize)
    low, high = [], []
    for start in range(0, count, step):
        if data is None:  # a URL's .bin: through its chunk cache
            block = dataset._read(start * itemsize, min(step, count - start))
        else:
            block = data[start : start + step]
        low.append(block.min())
        high.append(block.max())
        if data is not None:
            drop_pages(block)  # a scan of the whole corpus does not stay resident
    return int(min(low)), int(max(high))


def _read_record(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as stream:
            record = json.load(stream)
    except (OSError, ValueError):
        return None  # none yet, or unreadable: scanned again and rewritten
    ok = isinstance(record, dict) and all(
        record.get(k) is None or type(record.get(k)) is int for k in ("largest", "smallest")
    )
    return record if ok and "largest" in record else None


def token_ids(
    prefix: str,
    cache_dir: str | None,
    vocab_size: int | None = None,
    store: StoreOptions | None = None,
) -> TokenIds:
    """The range of ids of the dataset at `prefix`: PREFIX.hp.json's `max_token_id`, else
    nothing read when `vocab_size` is given and the unsigned dtype cannot hold an id as large,
    else a scan, recorded in `cache_dir` (the index cache; None: the shared temporary one).
    A URL prefix is read through `store`'s cache, and scanned only when its .bin fits there."""
    opened = None
    if is_url(prefix):
        opened = IndexedDataset(prefix, validate=False, store=store)
        metadata = read_metadata(opened.remote.local_prefix)  # type: ignore[union-attr]
    else:
        metadata = read_metadata(prefix)
    recorded = (metadata or {}).get("max_token_id", False)
    if recorded is None or type(recorded) is int:  # None: the writer saw no token at all
        if opened is not None:
            opened.close()
        return TokenIds(recorded, None, "metadata", metadata)
    with opened or IndexedDataset(prefix, validate=False) as dataset:
        dtype = dataset.dtype
        # A uint16 dataset (Megatron's choice for vocabularies under 65500) holds no id of
        # 65536 or more: a vocab_size of at least 65536 needs no scan. Signed dtypes may
        # hold negative ids, so they are scanned.
        if vocab_size is not None and dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
            return TokenIds(int(np.iinfo(dtype).max), 0, "dtype", metadata)
        if dataset.remote is None:
            where = {
                "bin": os.path.realpath(dataset.bin_path),
                "mtime_ns": os.stat(dataset.bin_path).st_mtime_ns,
            }
        else:
            where = {"bin": dataset.remote.directory}  # its URL and pins
        key = cache_key({"corpus": corpus_fingerprint(dataset), **where})
        path = os.path.join(resolve_cache_dir(cache_dir), f"{key}-token-ids.json")
        record = _read_record(path)
        if record is not None:
            return TokenIds(record["largest"], record["smallest"], "cache", metadata)
        remote = dataset.remote
        if remote is not None and dataset.bin_bytes > remote.options.cache_bytes:
            name = f"{remote.options.key_prefix}remote_cache_gb"
            raise HpDataError(
                f"{redact(prefix)}: its .hp.json records no max_token_id, and finding the "
                f"largest token id would download the whole .bin ({dataset.bin_bytes / 2**30:.3g}"
                f" GiB, more than {name} = {remote.options.cache_gb:g}): write the corpus with "
                f'hp-data preprocess (it records it), add "max_token_id" to PREFIX.hp.json, or '
                f"raise {name} to scan it once"
            )
        smallest, largest = scan(dataset)
        record = {"prefix": redact(dataset.path_prefix), "smallest": smallest, "largest": largest}
        write_json(path, record)  # whole or absent: a kill leaves nothing a reader would trust
        return TokenIds(largest, smallest, "scan", metadata)
