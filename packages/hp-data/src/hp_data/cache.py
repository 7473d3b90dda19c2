"""A directory of index arrays keyed by a hash of everything that shapes them.

Files are named like megatron-core's (`{hash}-{Class}-{split}-{name}.npy`) with a readable
`{hash}-{Class}-{split}-description.json` written last: it is the commit marker, so a
half-written set is never loaded. Builders of the same key serialise on a file lock, so
concurrent processes build once and all load the same arrays, memory-mapped. The cache knows
nothing about GPT: callers pass a description and a build function.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import xxhash

from hp_data.fs import can_write_in, committing, write_json
from hp_data.redact import redact_data

_warned: set[str] = set()


def cache_key(description: dict[str, Any]) -> str:
    """The cache key: xxh3-128 of the description's canonical JSON."""
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(canonical.encode())


# The descriptors of the lock files this process has open (`open_lock_file`), and a guard that
# a fork waits for. A forked child (a DataLoader worker) shares each with its parent: the lock
# would stay held by the child's copy, for the child's life, after the parent lets go, and no
# process of the node could take it again. The child drops its copies at once.
_held: set[int] = set()
_guard = threading.Lock()


def _drop_inherited() -> None:
    _guard.release()
    if _held:
        null = os.open(os.devnull, os.O_RDONLY)
        for fd in _held:  # the child's copy goes; the number stays open (on /dev/null), so
            os.dup2(null, fd)  # the parent's holder, copied here, closes nothing else
        os.close(null)
        _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_guard.acquire, after_in_parent=_guard.release, after_in_child=_drop_inherited
    )


def open_lock_file(path: str, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """A descriptor of `path` to flock, that a process forked while it is open does not keep
    (above); closed by `close_lock_file` alone. Never truncates: a holder's note in the file
    stays for whoever is refused."""
    with _guard:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o666)
        _held.add(fd)
    return fd


def close_lock_file(fd: int) -> None:
    """Close a descriptor of `open_lock_file` (letting its lock go); nothing in a forked child,
    whose copy is already gone and whose number may be another file's."""
    with _guard:
        if fd in _held:
            _held.discard(fd)
            os.close(fd)


@contextmanager
def key_lock(base: str, timeout: float | None = None) -> Iterator[None]:
    """Held while one key is built: builders of the same key, in any process, take turns,
    and the later ones find what the first committed. `timeout`: seconds to wait for the
    holder before `TimeoutError` (None: as long as it takes; a holder that dies lets go; a
    process forked meanwhile does not hold it)."""
    lock = open_lock_file(f"{base}.lock")
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:  # type: ignore[operator]
                    raise TimeoutError(f"{base}.lock: held for more than {timeout:g} s") from None
                time.sleep(0.02)
        yield
    finally:
        close_lock_file(lock)


def resolve_cache_dir(directory: str | None) -> str:
    """`directory` if it can be written, else a shared temporary one (with one warning)."""
    fallback = os.path.join(tempfile.gettempdir(), "hp-data-index-cache")
    if directory is not None and can_write_in(directory):
        return directory
    if directory is not None and directory not in _warned:
        _warned.add(directory)
        warnings.warn(
            f"{directory}: index cache directory is not writable; using {fallback}",
            stacklevel=3,
        )
    os.makedirs(fallback, exist_ok=True)
    return fallback


def _save_atomic(path: str, array: np.ndarray) -> None:
    # No fsync: a kill cannot tear a renamed file, and a set torn by a power cut fails to
    # load and is rebuilt (see load_or_build); the cache is cheap to rebuild, slow to sync.
    with committing(path, durable=False) as stream:
        np.save(stream, np.ascontiguousarray(array), allow_pickle=False)


def _load(
    paths: dict[str, str], marker: str, check: Callable[[dict[str, np.ndarray]], str | None]
) -> dict[str, np.ndarray] | None:
    """The committed arrays, or None (with a warning) when any does not match its record."""
    if not os.path.exists(marker):
        return None
    try:
        with open(marker, encoding="utf-8") as stream:
            recorded = json.load(stream).get("arrays", {})
        arrays = {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
    except (OSError, ValueError, EOFError) as exc:
        problem = f"unreadable ({exc})"
    else:
        problem = next(
            (
                f"{paths[name]}: {_shape(array)} on disk, {recorded.get(name)} recorded"
                for name, array in arrays.items()
                if recorded.get(name) != _shape(array)
            ),
            None,
        ) or check(arrays)
        if problem is None:
            return arrays
    warnings.warn(f"index cache {marker}: {problem}; rebuilding", stacklevel=3)
    return None


def _shape(array: np.ndarray) -> dict[str, Any]:
    return {"shape": list(array.shape), "dtype": str(array.dtype)}


def load_or_build(
    directory: str | None,
    description: dict[str, Any],
    class_name: str,
    split_name: str,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
    check: Callable[[dict[str, np.ndarray]], str | None] = lambda arrays: None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays `names` for `description`, from the cache or built (once) and saved.

    Returns the arrays (memory-mapped, read-only) and a report: the cache key, the files, and
    `built_seconds` (None on a cache hit). `directory=None` uses the temporary fallback.
    Cached arrays whose shape or dtype differs from the one recorded in the description, or
    that `check` (cheap relations between the arrays) finds wrong, are rebuilt.
    """
    directory = resolve_cache_dir(directory)
    key = cache_key(description)
    base = os.path.join(directory, f"{key}-{class_name}-{split_name}")
    paths = {name: f"{base}-{name}.npy" for name in names}
    marker = f"{base}-description.json"
    built_seconds = None
    loaded = _load(paths, marker, check)
    if loaded is None:
        with key_lock(base):  # another process may be building this key
            loaded = _load(paths, marker, check)
            if loaded is None:
                start = time.perf_counter()
                arrays = build()
                built_seconds = time.perf_counter() - start
                if os.path.exists(marker):  # a set that failed its checks: uncommit it first
                    os.remove(marker)
                for name in names:
                    _save_atomic(paths[name], arrays[name])
                shapes = {name: _shape(arrays[name]) for name in names}
                record = {
                    "key": key,
                    "class": class_name,
                    "split": split_name,
                    **description,
                    "arrays": shapes,
                }
                write_json(  # no credential is ever stored (`redact_data`)
                    marker,
                    redact_data(record),
                    durable=False,
                    indent=2,
                    sort_keys=True,
                    default=str,
                )
                loaded = _load(paths, marker, check)
    if loaded is None:
        raise OSError(f"{base}-*.npy: written but unreadable; remove them and retry")
    report = {
        "key": key,
        "files": [*paths.values(), marker],
        "built_seconds": built_seconds,
    }
    return loaded, report
