"""`IndexedDataset` and its checks (`dataset_problems`) of any prefix: a local `.bin`/`.idx`
pair (`format/reader.py`) or one behind a URL, read through the node-local cache of
`object_store.py`. This is the one
`hp_data.IndexedDataset` names; the format layer below knows nothing of object storage."""

from __future__ import annotations

import os
from typing import Any

from hp_data.errors import HpDataError, IndexedDatasetError
from hp_data.format import reader, validate
from hp_data.format.blocks import block_problem, streamed_digests
from hp_data.format.header import idx_path, map_index_arrays, read_layout
from hp_data.object_store import RemoteCorpus, StoreOptions, is_url


class IndexedDataset(reader.IndexedDataset):
    """A dataset of `hp_data.format.reader.IndexedDataset` (see it for `ds[i]`, slices,
    documents and the checks on open) at a local prefix or a URL one.

    A URL prefix (`s3://bucket/corpus`, hp_data.object_store) is read through the node-local
    cache `store` describes (None: the defaults): its index arrays come from the cached `.idx`,
    mapped as a local one is, its tokens from the `.bin`'s cached chunks.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        mmap: bool = True,
        multimodal: bool = False,
        validate: bool = True,
        store: StoreOptions | None = None,
    ) -> None:
        self._store = store
        super().__init__(path, mmap, multimodal, validate)

    def _connect(self) -> RemoteCorpus | None:
        if not is_url(self.path_prefix):
            return None
        return RemoteCorpus(self.path_prefix, self._store or StoreOptions())

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_store": self._store}


def dataset_problems(
    prefix: str, multimodal: bool = False, store: StoreOptions | None = None
) -> list[str]:
    """Every broken invariant of the dataset at `prefix`, local or a URL (read through the
    node cache `store` describes), one line each; empty when sound (`inspect --check`)."""
    if is_url(prefix):
        return remote_problems(prefix, multimodal, store)
    return validate.dataset_problems(prefix, multimodal)


def remote_problems(
    prefix: str, multimodal: bool = False, store: StoreOptions | None = None
) -> list[str]:
    """`dataset_problems` of a URL prefix: the `.idx` (copied into the node cache) against the
    `.bin` object's size and, where the `.hp.json` records block hashes, the `.bin` streamed
    once from the store (not cached) against them: a whole download of it."""
    try:  # opening reads the pins, copies the .idx and parses the record against the .bin
        corpus = RemoteCorpus(idx_path(prefix)[:-4], store or StoreOptions())
        local = corpus.local_prefix + ".idx"
        try:
            layout = read_layout(local, multimodal)
        except IndexedDatasetError as exc:  # named as the user named it
            return [str(exc).replace(local, corpus.idx_url)]
    except HpDataError as exc:
        return [str(exc)]
    lengths, pointers, documents, _ = map_index_arrays(layout, with_modes=False)
    itemsize = layout.dtype.itemsize
    problems = list(validate.array_problems(lengths, pointers, documents, itemsize, corpus.bin_size,
                                   corpus.idx_url, corpus.bin_url))  # fmt: skip
    record = corpus.record
    if problems or record is None:
        return problems
    try:  # a read that differs is read once more: damage on the way is not the store's
        for _ in range(2):
            bad = record.first_bad(streamed_digests(corpus), 0)
            if bad is None:
                return []
    except HpDataError as exc:
        return [str(exc)]
    fix = " on two reads: the store's .bin is not the one hp-data wrote; upload it again"
    return [block_problem(corpus.bin_url, corpus.metadata_url, bad, record.block_bytes, fix)]


__all__ = ["IndexedDataset", "dataset_problems"]
