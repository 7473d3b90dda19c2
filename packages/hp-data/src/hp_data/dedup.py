"""Exact deduplication: 128-bit xxhash of normalised text, kept in a flat numpy hash set.

A Python set of 128-bit ints costs about 100 bytes a document; this open-addressing table
of two uint64 columns costs 16 bytes a slot at a load of at most 0.7, so 23-46 bytes a
unique document, and it is probed a batch at a time with numpy.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

import numpy as np
import xxhash

_SEPARATOR = "\x1f"  # joins the texts of several --json-keys into one identity


def normalise(text: str) -> str:
    """NFC, with every run of whitespace made one space and the ends stripped."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def hash_texts(columns: Sequence[Sequence[str]]) -> np.ndarray:
    """xxh3-128 of each row's normalised texts (one column per JSON key), as (n, 2) uint64."""
    digests = b"".join(
        xxhash.xxh3_128_digest(_SEPARATOR.join(normalise(text) for text in row).encode("utf-8"))
        for row in zip(*columns, strict=True)
    )
    return np.frombuffer(digests, dtype=np.uint64).reshape(-1, 2)


class HashSet:
    """A set of 128-bit hashes with `add_new`, which tells which of a batch were unseen."""

    BLOCK = 1 << 18

    def __init__(self, capacity: int = 1 << 16) -> None:
        size = 1 << max(4, (capacity - 1).bit_length())
        self._table = np.zeros((size, 2), dtype=np.uint64)  # (0, 0) marks an empty slot
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def add_new(self, hashes: np.ndarray) -> np.ndarray:
        """Insert `hashes` (n, 2) in order; True where a hash was not seen before, counting
        earlier rows of the same batch."""
        hashes = np.ascontiguousarray(hashes, dtype=np.uint64).reshape(-1, 2).copy()
        hashes[(hashes[:, 0] == 0) & (hashes[:, 1] == 0), 1] = 1  # keep (0, 0) for "empty"
        fresh = np.zeros(len(hashes), dtype=bool)
        if len(hashes) == 0:
            return fresh
        # The first occurrence of each hash within the batch is the candidate for insertion.
        _, first = np.unique(hashes.view(np.dtype((np.void, 16))).ravel(), return_index=True)
        candidates = np.sort(first)
        while (self._count + len(candidates)) * 10 > len(self._table) * 7:
            self._grow()
        inserted = self._insert(hashes[candidates])
        fresh[candidates[inserted]] = True
        self._count += int(inserted.sum())
        return fresh

    def _insert(self, keys: np.ndarray) -> np.ndarray:
        """Linear probing for all keys at once; True for keys that took a new slot."""
        mask = len(self._table) - 1
        table = self._table
        position = (keys[:, 0] ^ keys[:, 1]).astype(np.int64) & mask
        inserted = np.zeros(len(keys), dtype=bool)
        active = np.arange(len(keys))
        while len(active):
            slots = table[position[active]]
            key = keys[active]
            same = (slots[:, 0] == key[:, 0]) & (slots[:, 1] == key[:, 1])
            empty = (slots[:, 0] == 0) & (slots[:, 1] == 0)
            # Of several keys that reach one empty slot, the earliest in order takes it.
            claim = active[empty]
            _, winners = np.unique(position[claim], return_index=True)
            won = claim[winners]
            table[position[won]] = keys[won]
            inserted[won] = True
            done = same.copy()
            done[np.flatnonzero(empty)[winners]] = True
            active = active[~done]
            # Losers re-read the slot they lost (now taken); others move to the next slot.
            moving = ~np.isin(active, claim)
            position[active[moving]] = (position[active[moving]] + 1) & mask
        return inserted

    def _grow(self) -> None:
        # Rehash a block at a time so the temporaries stay small next to the tables.
        old = self._table
        self._table = np.zeros((len(old) * 2, 2), dtype=np.uint64)
        for start in range(0, len(old), self.BLOCK):
            block = old[start : start + self.BLOCK]
            self._insert(block[(block[:, 0] != 0) | (block[:, 1] != 0)])
