"""Reading ahead of the samples: the sample order is known in advance (a sampler's
consecutive ids), so the chunks of a URL prefix that the next samples read are downloaded
on background threads before a reader asks for them (`object_store.RemoteCorpus`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hp_data.object_store import RemoteCorpus


def distinct(chunks: Iterable[tuple[Any, int]]) -> list[tuple[Any, int]]:
    """(corpus, chunk) pairs, each once, in their first order."""
    out: dict[tuple[int, int], tuple[Any, int]] = {}
    for corpus, chunk in chunks:
        out.setdefault((id(corpus), chunk), (corpus, chunk))
    return list(out.values())


class ReadAhead:
    """Downloads, on background threads, the chunks that samples about to be read need (the
    sample order is known in advance: a sampler's consecutive ids), so that a reader rarely
    waits for the network. `dataset.chunks_for(sample_ids)` (GPTDataset, BlendableDataset, or
    any dataset that has it) lists them: at once for a local dataset (nothing), a few
    index reads a sample for a URL's. At most `in_flight` downloads run at once; what does not
    fit now is left to the next call. No thread starts until there is something to fetch. A
    failed download is left to the reader, whose own read of the chunk reports it in one
    line."""

    def __init__(self, dataset: Any, in_flight: int = 4) -> None:
        self._chunks_for = getattr(dataset, "chunks_for", None)
        self._in_flight = in_flight
        self._slots = threading.BoundedSemaphore(in_flight)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: set[tuple[str, int]] = set()

    def want(self, sample_ids: Iterable[int]) -> None:
        """Start fetching what `sample_ids` (read soon, in this order) need, within the bound."""
        if self._chunks_for is None:
            return
        for corpus, chunk in self._chunks_for(sample_ids):
            key = (corpus.directory, chunk)
            if key in self._pending or corpus.cached(chunk):
                continue
            if not self._slots.acquire(blocking=False):
                return  # the bound: the next call asks again
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._in_flight, thread_name_prefix="hp-read-ahead")
            self._pending.add(key)
            self._pool.submit(self._fetch, corpus, chunk, key)

    def _fetch(self, corpus: RemoteCorpus, chunk: int, key: tuple[str, int]) -> None:
        # A failure is not reported here: the reader's own read of the chunk fails in one line.
        try:
            with contextlib.suppress(Exception):
                corpus.fetch(chunk)
        finally:
            self._pending.discard(key)
            self._slots.release()

    def close(self) -> None:
        """Start no more downloads; those under way finish (each within its timeouts)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._chunks_for = None


__all__ = ["ReadAhead", "distinct"]
