"""`IndexedDataset` of any prefix: a local `.bin`/`.idx` pair (`format/reader.py`) or one
behind a URL, read through the node-local cache of `object_store.py`. This is the one
`hp_data.IndexedDataset` names; the format layer below knows nothing of object storage."""

from __future__ import annotations

import os
from typing import Any

from hp_data.format import reader
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


__all__ = ["IndexedDataset"]
