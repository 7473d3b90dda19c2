"""The writer's record of a `.bin`: the xxh3-64 of every `BLOCK_BYTES` of it, kept in
`PREFIX.hp.json` under `bin_blocks` (committed with the two files, `format/builder.py`).

A reader that holds any part of the `.bin` that starts on a block and ends on one (or at the
file's end) can tell whether it holds exactly the bytes that were written: a node cache's
chunk after its download and when a process maps it (`object_store.py`), or `inspect --check`
over the whole file. Megatron's own files have no record; what reads them checks what it can
without one. Stored as one hex string (16 digits a block) so that a trillion-token corpus's
record is a few megabytes and is parsed without a Python object per block.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from hp_data.errors import IndexedDatasetError
from hp_data.format.header import metadata_path

BLOCK_BYTES = 4 << 20  # 4 MiB: data.remote_chunk_mb of any whole number of MiB divisible by 4
KEY = "bin_blocks"
_READ = 16 << 20


def file_record(path: str, on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
    """`{"bytes", "xxh3_128"}` of the whole file at `path`, read once in 16 MiB blocks: what
    binds a shard's manifest (shards.py) and a `.hp.sources` (provenance.py) to their files."""
    digest, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as stream:
        while block := stream.read(_READ):
            digest.update(block)
            size += len(block)
            if on_bytes is not None:
                on_bytes(len(block))
    return {"bytes": size, "xxh3_128": digest.hexdigest()}


class BlockHasher:
    """xxh3-64 of each `block_bytes` of a stream fed in pieces of any size, and of the whole
    stream (what a cache keeps beside bytes no record covers)."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self._block, self._whole = xxhash.xxh3_64(), xxhash.xxh3_64()
        self._filled = 0
        self._digests: list[int] = []

    def update(self, data: bytes | memoryview | np.ndarray) -> None:
        view = memoryview(data).cast("B")
        self._whole.update(view)
        while len(view):
            take = min(len(view), self.block_bytes - self._filled)
            self._block.update(view[:take])
            self._filled, view = self._filled + take, view[take:]
            if self._filled == self.block_bytes:
                self._digests.append(self._block.intdigest())
                self._block.reset()
                self._filled = 0

    def digests(self) -> np.ndarray:
        """Every block's digest so far, the last (short) block's included."""
        tail = [self._block.intdigest()] if self._filled else []
        return np.array(self._digests + tail, dtype=np.uint64)

    def whole(self) -> int:
        return self._whole.intdigest()


def file_digests(path: str | os.PathLike[str], block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """The digest of every block of the file at `path`, read once front to back."""
    hasher = BlockHasher(block_bytes)
    buffer = bytearray(_READ)
    with open(path, "rb", buffering=0) as stream:
        while count := stream.readinto(buffer):  # type: ignore[attr-defined]
            hasher.update(memoryview(buffer)[:count])
    return hasher.digests()


def hash_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The `bin_blocks` record of the file at `path`."""
    digits = file_digests(path).astype(">u8").tobytes().hex()
    return {"block_bytes": BLOCK_BYTES, "xxh3_64": digits}


@dataclass(frozen=True)
class BlockRecord:
    """A parsed `bin_blocks` record, checked against the size of the `.bin` it describes."""

    block_bytes: int
    digests: np.ndarray  # uint64, one a block

    @classmethod
    def of(cls, metadata: dict[str, Any] | None, where: str, bin_size: int) -> BlockRecord | None:
        """The record in `metadata` (read from `where`), None when it has none; one line when
        it is malformed or describes a `.bin` of another size."""
        found = (metadata or {}).get(KEY)
        if found is None:
            return None
        fix = "delete the file (hp-data then checks what it can without it) or write it again"
        block = found.get("block_bytes") if isinstance(found, dict) else None
        digits = found.get("xxh3_64") if isinstance(found, dict) else None
        if not (type(block) is int and block > 0 and isinstance(digits, str)):
            raise IndexedDatasetError(
                f"{where}: {KEY} needs a positive integer block_bytes and a hex string xxh3_64; "
                f"{fix}"
            )
        try:
            digests = np.frombuffer(bytes.fromhex(digits), dtype=">u8").astype(np.uint64)
        except ValueError:
            raise IndexedDatasetError(
                f"{where}: {KEY}.xxh3_64 is not 16 hex digits a block; {fix}"
            ) from None
        expected = -(-bin_size // block)
        if len(digests) != expected:
            raise IndexedDatasetError(
                f"{where}: {KEY} records {len(digests):,} blocks of {block:,} bytes, but the .bin "
                f"holds {bin_size:,} bytes ({expected:,} blocks): they are not one dataset; "
                "write or upload the dataset's files together"
            )
        return cls(block, digests)

    def covers(self, start: int, end: int, size: int) -> bool:
        """Whether bytes [start, end) of a `.bin` of `size` bytes are whole blocks."""
        return start % self.block_bytes == 0 and (end % self.block_bytes == 0 or end == size)

    def first_bad(self, digests: np.ndarray, start: int) -> int | None:
        """The index in the `.bin` of the first block whose digest (of `digests`, the blocks
        from byte `start` on) differs from the record; None when all agree."""
        first = start // self.block_bytes
        wrong = np.flatnonzero(digests != self.digests[first : first + len(digests)])
        return None if len(wrong) == 0 else first + int(wrong[0])


def record_problems(prefix: str, metadata: dict[str, Any] | None, bin_file: str) -> list[str]:
    """`inspect --check`'s look at the record: one line for the first block of `bin_file`
    that differs from it (empty when it agrees, or there is none)."""
    where = metadata_path(prefix)
    try:
        record = BlockRecord.of(metadata, where, os.path.getsize(bin_file))
    except IndexedDatasetError as exc:
        return [str(exc)]
    if record is None:
        return []
    bad = record.first_bad(file_digests(bin_file, record.block_bytes), 0)
    return [] if bad is None else [block_problem(bin_file, where, bad, record.block_bytes)]


def block_problem(
    bin_name: str,
    where: str,
    bad: int,
    block_bytes: int,
    fix: str = "; the file is damaged: write or copy it again",
) -> str:
    """The line for block `bad` of `bin_name` differing from the record in `where`."""
    start = bad * block_bytes
    return (
        f"{bin_name}: bytes {start:,}-{start + block_bytes:,} (block {bad}) differ from "
        f"what was written ({where}: {KEY}){fix}"
    )


def streamed_digests(corpus: Any) -> np.ndarray:
    """The digest of every block of a URL prefix's `.bin` (`object_store.RemoteCorpus`),
    read once front to back from the store through its pin: never into the node cache."""
    from hp_data.redact import redact
    from hp_data.remote import open_pinned

    hasher = BlockHasher(corpus.record.block_bytes)
    read = 0
    with open_pinned(corpus.bin_url, corpus.pins["bin"], "a dataset file") as stream:
        while block := stream.read(_READ):
            hasher.update(block)
            read += len(block)
    if read != corpus.bin_size:
        raise IndexedDatasetError(
            f"{redact(corpus.bin_url)}: ends at byte {read:,}; its pin says {corpus.bin_size:,}"
        )
    return hasher.digests()
