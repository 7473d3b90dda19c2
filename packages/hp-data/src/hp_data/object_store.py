"""A Megatron `.bin`/`.idx` pair behind an fsspec URL (`s3://`, `gs://`, `az://`, `hf://`,
`https://`, `memory://`), read through a node-local cache, so that a run on many machines
reads its corpus from object storage instead of a copy on every disk.

Layout, under `CACHE/remote/` (`CACHE`: the index cache directory)::

    KEY/                      KEY: xxh3 of the prefix URL and its three objects' pins
        source.json           the URL (credentials redacted) and the pins, for people
        dataset.idx           the .idx, fetched whole, once per node
        dataset.hp.json       the .hp.json, where the prefix has one
        chunks-BYTES/NNNNNNNNNN.chunk   .bin bytes [N * BYTES, (N + 1) * BYTES), on demand,
                                        then their xxh3-64 (8 bytes, little-endian)

An object is pinned (`remote.Pin`: its size and ETag, version id or modification time) when
the dataset opens; a changed object gets another KEY, so nothing of two versions is ever
mixed. Every download is one range of one pinned object (`remote.open_pinned`: s3fs reads with
If-Match, other stores are asked for the pin again around the read), retried as every remote
read is, checked to hold exactly the bytes the `.idx` says the `.bin` has there, written to a
temporary name and renamed into place, under a file lock per chunk (striped): every rank and
DataLoader worker of a machine shares one download of each chunk, and waits for another's as
long as it makes progress (until `WAIT_TIMEOUTS` request timeouts pass without a byte).

Every chunk is checked, never trained on unchecked. Where the `.hp.json` records the `.bin`'s
block hashes (`format/blocks.py`, written by hp-data) and the chunk is whole blocks, its
download is checked against them before it is renamed into place and again when a process
maps a chunk it did not download itself; elsewhere (Megatron's files, chunks that are not
whole blocks) a chunk's own hash, taken as it arrives, is checked when it is mapped (damage
in the cache is caught, damage on the way is not). A damaged chunk is fetched once more; a
download that still differs from the record stops the run in one line. The chunk files
together are kept under `cache_bytes` by deleting the least recently used ones: only chunk
files, only inside `CACHE/remote/`.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import os
import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from hp_data.cache import cache_key, key_lock, resolve_cache_dir
from hp_data.errors import HpDataError, IndexedDatasetError
from hp_data.format.blocks import BLOCK_BYTES, BlockHasher, BlockRecord
from hp_data.format.header import bin_path, idx_path, metadata_path
from hp_data.format.metadata import read_metadata
from hp_data.fs import AtomicFile, temp_glob, temp_target, write_bytes
from hp_data.redact import redact, redact_data
from hp_data.remote import (
    DEFAULT_TIMEOUT,
    Pin,
    canonical_url,
    current_pin,
    is_url,
    open_pinned,
    set_timeout,
)

DEFAULT_CHUNK_MB = 64.0  # data.remote_chunk_mb
DEFAULT_CACHE_GB = 100.0  # data.remote_cache_gb: a 50B-token uint16 corpus fits whole
PAGE = 4096  # chunk sizes are whole pages: a token never straddles two chunks' alignment
WAIT_TIMEOUTS = 10  # another process's download is given up on after this many timeouts idle
TRAILER = 8  # bytes after a chunk's data: their xxh3-64, little-endian
_STRIPES = 64  # lock files per corpus: a bounded number, whatever the number of chunks
# Chunk maps one process keeps open: at least 8, else 1 GiB of them. A map keeps an evicted
# chunk's disk space until it is dropped, so this bounds what eviction can lag behind.
_MAPS, _MAP_BYTES = 8, 1 << 30
_COPY_BLOCK = 16 << 20  # bytes read at a time into a cache file
_CHUNK_NAME = re.compile(r"\d{10}\.chunk")
_warned: set[str] = set()


@dataclass(frozen=True)
class StoreOptions:
    """How URL prefixes are read: the cache directory (None: the shared temporary one), the
    chunk size in MiB (a float, so that tests use a few KiB), the cache bound in GiB and each
    request's timeout in seconds. `key_prefix` names the fields in messages (hp-train's
    "data.")."""

    cache_dir: str | None = None
    chunk_mb: float = DEFAULT_CHUNK_MB
    cache_gb: float = DEFAULT_CACHE_GB
    timeout_s: float = DEFAULT_TIMEOUT
    key_prefix: str = ""

    def __post_init__(self) -> None:
        limits = (
            ("remote_chunk_mb", self.chunk_mb, PAGE / 2**20, "at least 1/256 MiB (a 4 KiB page)"),
            ("remote_cache_gb", self.cache_gb, 0.0, "a positive size in GiB"),
            ("remote_timeout_s", self.timeout_s, 0.0, "a positive number of seconds"),
        )
        for name, value, low, hint in limits:
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and (value >= low if low else value > 0)):
                raise HpDataError(f"{self.key_prefix}{name} = {value!r}: give {hint}")

    @classmethod
    def of(cls, config: Any) -> StoreOptions:
        """The options a dataset config (`GPTDatasetConfig`, hp-train's `[data]`) gives."""
        return cls(
            config.cache_dir,
            config.remote_chunk_mb,
            config.remote_cache_gb,
            config.remote_timeout_s,
            getattr(config, "key_prefix", ""),
        )

    @property
    def chunk_bytes(self) -> int:
        return max(PAGE, int(self.chunk_mb * 2**20) // PAGE * PAGE)

    @property
    def cache_bytes(self) -> int:
        return int(self.cache_gb * 2**30)

    @property
    def wait_s(self) -> float:
        return WAIT_TIMEOUTS * self.timeout_s


def exists(prefix: str) -> bool:
    """Whether the URL `prefix` names a dataset (its `.idx` is there): asked of the store."""
    return current_pin(idx_path(_plain_prefix(prefix)), missing_ok=True) is not None


def _plain_prefix(prefix: str) -> str:
    """`prefix`, refused when it has a query or fragment: the files' names are made by adding
    `.idx` and `.bin` to it, and a presigned URL signs one object, not a prefix."""
    if "?" in prefix or "#" in prefix:
        raise IndexedDatasetError(
            f"{redact(prefix)}: a URL prefix cannot carry a query or fragment (PREFIX.idx and "
            "PREFIX.bin are named by adding to it); give the store's credentials in its "
            "environment or fsspec configuration instead"
        )
    return prefix


class RemoteCorpus:
    """One URL prefix: its objects pinned, its `.idx` and `.hp.json` copied into the cache,
    its `.bin` read by chunks. Pickles as its pins and directory: a DataLoader worker reopens
    it without asking the store again."""

    def __init__(self, prefix: str, options: StoreOptions) -> None:
        set_timeout(options.timeout_s, f"{options.key_prefix}remote_timeout_s")
        self.url, self.options = _plain_prefix(prefix), options
        self.idx_url, self.bin_url = idx_path(prefix), bin_path(prefix)
        self.metadata_url = metadata_path(prefix)
        idx_pin = current_pin(self.idx_url, missing_ok=True)
        if idx_pin is None:
            raise IndexedDatasetError(f"{redact(self.idx_url)}: no such dataset")
        self.pins: dict[str, Pin | None] = {
            "idx": idx_pin,
            "bin": current_pin(self.bin_url),
            "metadata": current_pin(self.metadata_url, missing_ok=True),
        }
        self._warn()
        key = cache_key({"url": canonical_url(prefix), "pins": repr(sorted(self.pins.items()))})
        self.directory = os.path.join(self.root(options), key)
        self._start()
        self._copy_small()
        self.record  # noqa: B018 - a bad record is one line at open, not at the first read

    def _start(self) -> None:
        self.chunk_bytes = self.options.chunk_bytes
        self.chunk_dir = os.path.join(self.directory, f"chunks-{self.chunk_bytes}")
        os.makedirs(self.chunk_dir, exist_ok=True)
        self.local_prefix = os.path.join(self.directory, "dataset")
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._checked: set[tuple[int, int]] = set()  # (device, inode) of chunk files known good

    @staticmethod
    def root(options: StoreOptions) -> str:
        return os.path.join(resolve_cache_dir(options.cache_dir), "remote")

    @property
    def bin_size(self) -> int:
        return self.pins["bin"].size  # type: ignore[union-attr]

    @property
    def idx_size(self) -> int:
        return self.pins["idx"].size  # type: ignore[union-attr]

    def copy_sidecar(self, suffix: str) -> str | None:
        """The object PREFIX`suffix` (`.hp.sources`, for inspect) copied whole into this
        corpus's directory under its pin's name, once; None where the store has none."""
        url = self.url + suffix
        pin = current_pin(url, missing_ok=True)
        if pin is None:
            return None
        target = os.path.join(self.directory, f"sidecar-{cache_key({'pin': repr(pin)})}{suffix}")
        with key_lock(target):
            if not _whole(target, pin.size):
                _download(url, pin, 0, pin.size, target)
        return target

    @functools.cached_property
    def record(self) -> BlockRecord | None:
        """The `.bin`'s block hashes its `.hp.json` records (None: it has none)."""
        if self.pins["metadata"] is None:
            return None
        metadata = read_metadata(self.local_prefix)
        return BlockRecord.of(metadata, redact(self.metadata_url), self.bin_size)

    def _warn(self) -> None:
        pins = [(self.idx_url, self.pins["idx"]), (self.bin_url, self.pins["bin"])]
        for url in [url for url, pin in pins if pin is not None and not pin.strong]:
            _warn_once(
                url,
                f"{redact(url)}: no ETag, version id or content hash: only its size and "
                "modification time show a change while the run reads it",
            )
        if self.bin_size > self.options.cache_bytes:
            _warn_once(
                f"{self.bin_url} size",
                f"{redact(self.bin_url)}: {self.bin_size / 2**30:.3g} GiB, more than "
                f"{self.options.key_prefix}remote_cache_gb = {self.options.cache_gb:g}: "
                "shuffled samples will download evicted chunks again; give the cache room "
                "for the whole .bin where the disk allows",
            )

    def _copy_small(self) -> None:
        """The `.idx` and `.hp.json`, fetched once per node (under a lock) and kept."""
        wanted = [(self.idx_url, self.pins["idx"], ".idx")]
        wanted += [(self.metadata_url, self.pins["metadata"], ".hp.json")]
        wanted = [(u, p, s) for u, p, s in wanted if p is not None]
        if all(_whole(self.local_prefix + s, p.size) for _, p, s in wanted):  # type: ignore[union-attr]
            return
        base = os.path.join(self.directory, "copy")

        def ours(name: str) -> bool:  # a download of the .idx or the .hp.json under way
            return temp_target(name) in ("dataset.idx", "dataset.hp.json")

        with self._turn(base, self.idx_url, "the .idx", lambda: _parts(self.directory, ours)):
            for url, pin, suffix in wanted:
                if not _whole(self.local_prefix + suffix, pin.size):  # type: ignore[union-attr]
                    _download(url, pin, 0, pin.size, self.local_prefix + suffix)  # type: ignore[union-attr,arg-type]
            source = os.path.join(self.directory, "source.json")
            if not os.path.exists(source):
                record = {"url": self.url, "pins": {k: repr(p) for k, p in self.pins.items()}}
                write_bytes(source, json.dumps(redact_data(record), indent=2).encode())

    @contextlib.contextmanager
    def _turn(
        self, base: str, url: str, what: str, progress: Callable[[], object]
    ) -> Iterator[None]:
        """`key_lock(base)`, waited for while the holder's download makes `progress` (what it
        returns changes): a slow download is waited for as long as it takes, one that writes
        nothing for `wait_s` (the holder is stuck) ends the wait in one line naming `url`."""
        seen, since = progress(), time.monotonic()
        with contextlib.ExitStack() as stack:
            while True:
                try:
                    stack.enter_context(key_lock(base, min(self.options.timeout_s, 1.0)))
                    break
                except TimeoutError:
                    now = progress()
                    if now != seen:
                        seen, since = now, time.monotonic()
                    elif time.monotonic() - since >= self.options.wait_s:
                        key = f"{self.options.key_prefix}remote_timeout_s"
                        raise IndexedDatasetError(
                            f"{redact(url)}: another process's download of {what} wrote "
                            f"nothing for {self.options.wait_s:g} s ({WAIT_TIMEOUTS} x {key}); "
                            "is one stuck?"
                        ) from None
            yield

    # -- chunks ------------------------------------------------------------------------------

    def chunks(self, start: int, end: int) -> range:
        """The chunks that bytes [start, end) of the `.bin` lie in."""
        return range(
            start // self.chunk_bytes, (end - 1) // self.chunk_bytes + 1 if end > start else 0
        )

    def _span(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.bin_size)

    def chunk_path(self, chunk: int) -> str:
        return os.path.join(self.chunk_dir, f"{chunk:010d}.chunk")

    def cached(self, chunk: int) -> bool:
        start, end = self._span(chunk)
        return _whole(self.chunk_path(chunk), end - start + TRAILER)

    def fetch(self, chunk: int, damaged: tuple[int, int] | None = None) -> str:
        """The path of chunk `chunk`, whole: from the cache, else downloaded (once per node:
        another process's download is waited for, within the bound). `damaged`: the (device,
        inode) of a cached file found damaged, replaced unless another process already did."""
        path = self.chunk_path(chunk)
        start, end = self._span(chunk)
        if _whole(path, end - start + TRAILER) and _inode(path) != damaged:
            return path
        stripe = chunk % _STRIPES
        base = os.path.join(self.chunk_dir, f"stripe-{stripe}")

        def ours(name: str) -> bool:  # a download of one of this stripe's chunks under way
            chunk = temp_target(name)
            return (
                chunk is not None
                and _CHUNK_NAME.fullmatch(chunk) is not None
                and (int(chunk[:10]) % _STRIPES == stripe)
            )

        progress = functools.partial(_parts, self.chunk_dir, ours)
        with self._turn(base, self.bin_url, f"bytes {start}-{end}", progress):
            if _whole(path, end - start + TRAILER) and _inode(path) != damaged:
                return path  # another process's download
            found = _inode(path)
            if found is not None:
                # Found damaged by the caller, who said so; or an older hp-data's chunk, which
                # had no trailer; or of a wrong size: a damaged cache.
                if found != damaged and os.path.getsize(path) != end - start:
                    warnings.warn(
                        f"{path}: not the {end - start + TRAILER:,} bytes written (a damaged "
                        "cache); fetching it again",
                        stacklevel=2,
                    )
                os.remove(path)
            self._download_chunk(chunk, path)
            self._checked.add(_inode(path))  # type: ignore[arg-type]
        evict(self.root(self.options), self.options.cache_bytes, keep=path)
        return path

    def _download_chunk(self, chunk: int, path: str) -> None:
        """Chunk `chunk` into `path` with its trailer; where the record covers it, only once
        its bytes agree with it: downloaded once more, then one line."""
        start, end = self._span(chunk)
        record = self.record if self._covered(chunk) else None
        block = BLOCK_BYTES if record is None else record.block_bytes

        def seal(hasher: BlockHasher) -> bytes | None:
            if record is not None and record.first_bad(hasher.digests(), start) is not None:
                return None
            return hasher.whole().to_bytes(TRAILER, "little")

        for _ in range(2):
            pin = self.pins["bin"]
            if _download(self.bin_url, pin, start, end - start, path, seal, block):  # type: ignore[arg-type]
                return
        raise IndexedDatasetError(
            f"{redact(self.bin_url)}: chunk {chunk} (bytes {start}-{end}, cached at {path}) "
            f"differs from the block hashes in {redact(self.metadata_url)} on two downloads: "
            "the store's .bin is not the one hp-data wrote; upload the dataset's files again"
        )

    def _covered(self, chunk: int) -> bool:
        """Whether the record (where there is one) covers chunk `chunk` whole."""
        return self.record is not None and self.record.covers(*self._span(chunk), self.bin_size)

    def _intact(self, chunk: int, view: np.ndarray) -> bool:
        """Whether a mapped chunk file (data, then trailer) holds the bytes that were written:
        against the record where it covers the chunk, else against the chunk's own trailer."""
        data, trailer = view[:-TRAILER], int.from_bytes(view[-TRAILER:].tobytes(), "little")
        if self._covered(chunk):
            hasher = BlockHasher(self.record.block_bytes)  # type: ignore[union-attr]
            hasher.update(data)
            return self.record.first_bad(hasher.digests(), self._span(chunk)[0]) is None  # type: ignore[union-attr]
        return xxhash.xxh3_64_intdigest(data) == trailer

    def _view(self, chunk: int) -> np.ndarray:
        """Chunk `chunk` mapped (a few stay mapped in each process, most recent last)."""
        found = self._maps.get(chunk)
        if found is not None:
            self._maps.move_to_end(chunk)
            return found
        start, end = self._span(chunk)
        damaged = None
        for _ in range(3):  # evicted between its download and its opening: fetched again
            path = self.fetch(chunk, damaged)
            try:
                with open(path, "rb") as stream:
                    stat = os.fstat(stream.fileno())
                    if stat.st_size != end - start + TRAILER:
                        continue  # replaced under us by a damaged file: check it again
                    view = np.memmap(stream, np.uint8, mode="r", shape=(stat.st_size,))
            except FileNotFoundError:
                continue
            inode = (stat.st_dev, stat.st_ino)
            if inode not in self._checked and not self._intact(chunk, view):
                warnings.warn(
                    f"{path}: chunk {chunk} of {redact(self.bin_url)} (bytes {start}-{end}) is "
                    "not the bytes that were written (a damaged cache); fetching it again",
                    stacklevel=3,
                )
                damaged = inode
                continue
            self._checked.add(inode)
            os.utime(path)  # its use, for the least-recently-used eviction
            view = view[: end - start]
            break
        else:
            raise IndexedDatasetError(
                f"{redact(self.bin_url)}: bytes {start}-{end} left the cache as they were read; "
                f"raise {self.options.key_prefix}remote_cache_gb"
            )
        self._maps[chunk] = view
        if len(self._maps) > max(_MAPS, _MAP_BYTES // self.chunk_bytes):
            self._maps.popitem(last=False)
        return view

    def read(self, offset: int, size: int) -> np.ndarray:
        """Bytes [offset, offset + size) of the `.bin` (uint8, a copy), across chunks."""
        out = np.empty(size, dtype=np.uint8)
        done = 0
        with self._lock:
            while done < size:
                chunk, inside = divmod(offset + done, self.chunk_bytes)
                view = self._view(chunk)
                count = min(size - done, len(view) - inside)
                out[done : done + count] = view[inside : inside + count]
                done += count
        return out

    def close(self) -> None:
        self._maps.clear()

    def __getstate__(self) -> dict[str, Any]:
        keep = ("url", "options", "idx_url", "bin_url", "metadata_url", "pins", "directory")
        return {name: self.__dict__[name] for name in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        set_timeout(self.options.timeout_s, f"{self.options.key_prefix}remote_timeout_s")
        self._start()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=5)


def _whole(path: str, size: int) -> bool:
    try:
        return os.stat(path).st_size == size
    except FileNotFoundError:
        return False


def _inode(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _parts(directory: str, ours: Callable[[str], object]) -> list[tuple[str, int]]:
    """The files in `directory` whose names `ours` accepts (temporary files of downloads under
    way) and their sizes: what a waiter watches for progress."""
    found = []
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if ours(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    found.append((entry.name, entry.stat().st_size))
    return sorted(found)


def _download(
    url: str,
    pin: Pin,
    start: int,
    size: int,
    target: str,
    seal: Callable[[BlockHasher], bytes | None] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> bool:
    """Bytes [start, start + size) of the pinned object at `url` into `target`, whole or not
    at all (a temporary name renamed into place). With `seal`, the bytes are hashed (blocks
    of `block_bytes`) as they arrive and `seal(hasher)` gives what to append after them, or
    None: they are not what was written, nothing is renamed, and this returns False. Called
    under `target`'s lock, so another temporary file of it is a killed process's half
    download: deleted (nothing else would, and it is not counted in the cache bound)."""
    for stale in glob.glob(temp_glob(target)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(stale)
    hasher = BlockHasher(block_bytes) if seal is not None else None
    # Not synced: a cache, and a chunk torn by a power cut fails its trailer's check.
    with (
        open_pinned(url, pin, "a dataset file") as stream,
        AtomicFile(target, durable=False) as out,
    ):
        stream.seek(start)
        left = size
        while left:
            block = stream.read(min(left, _COPY_BLOCK))  # every byte, or one line
            if not block:
                raise IndexedDatasetError(
                    f"{redact(url)}: ends at byte {start + size - left:,}; its pin says "
                    f"{pin.size:,} bytes"
                )
            out.file.write(block)
            if hasher is not None:
                hasher.update(block)
            left -= len(block)
        trailer = b"" if seal is None else seal(hasher)  # type: ignore[arg-type]
        if trailer is None:
            out.discard()
            return False
        out.file.write(trailer)
    return True


def evict(root: str, bound: int, keep: str) -> None:
    """Delete the least recently used chunk files under `root` until they hold at most
    `bound` bytes (never `keep`, the chunk just fetched). Only `chunks-*/NNNNNNNNNN.chunk`
    files of the cache's own directories are ever considered. One process evicts at a time;
    the others skip it (the next download evicts again)."""
    try:
        with key_lock(os.path.join(root, "evict"), timeout=0.0):
            files = list(_chunk_files(root))
            total = sum(size for _, size, _ in files)
            for _, size, path in sorted(files):
                if total <= bound:
                    break
                if path == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):  # another reader's eviction
                    os.remove(path)
                total -= size
    except TimeoutError:
        return


def _chunk_files(root: str) -> Iterable[tuple[float, int, str]]:
    """(last use, size, path) of every chunk file the cache wrote under `root`."""
    for corpus in _dirs(root):
        for chunks in _dirs(corpus.path):
            if not chunks.name.startswith("chunks-"):
                continue
            for entry in os.scandir(chunks.path):
                if _CHUNK_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    try:
                        stat = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    yield stat.st_mtime, stat.st_size, entry.path


def _dirs(path: str) -> list[os.DirEntry[str]]:
    try:
        return [e for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


__all__ = ["RemoteCorpus", "StoreOptions", "evict", "exists", "is_url"]
