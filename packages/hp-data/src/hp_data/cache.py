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
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

_warned: set[str] = set()


def fingerprint(description: dict[str, Any]) -> str:
    """The cache key: xxh3-128 of the description's canonical JSON."""
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(canonical.encode())


def _writable(directory: str) -> bool:
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".hp-write-test-"):
            return True
    except OSError:
        return False


def resolve_cache_dir(directory: str | None) -> str:
    """`directory` if it can be written, else a shared temporary one (with one warning)."""
    fallback = os.path.join(tempfile.gettempdir(), "hp-data-index-cache")
    if directory is not None and _writable(directory):
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
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as stream:
        np.save(stream, np.ascontiguousarray(array), allow_pickle=False)
    os.replace(tmp, path)


def _load(paths: dict[str, str]) -> dict[str, np.ndarray] | None:
    try:
        return {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
    except (OSError, ValueError, EOFError):
        return None


def load_or_build(
    directory: str | None,
    description: dict[str, Any],
    class_name: str,
    split: str,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays `names` for `description`, from the cache or built (once) and saved.

    Returns the arrays (memory-mapped, read-only) and a report: the cache key, the files, and
    `built_seconds` (None on a cache hit). `directory=None` uses the temporary fallback.
    """
    directory = resolve_cache_dir(directory)
    key = fingerprint(description)
    base = os.path.join(directory, f"{key}-{class_name}-{split}")
    paths = {name: f"{base}-{name}.npy" for name in names}
    marker = f"{base}-description.json"
    built_seconds = None
    loaded = _load(paths) if os.path.exists(marker) else None
    if loaded is None:
        with open(f"{base}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this key
            loaded = _load(paths) if os.path.exists(marker) else None
            if loaded is None:
                start = time.perf_counter()
                arrays = build()
                built_seconds = time.perf_counter() - start
                for name in names:
                    _save_atomic(paths[name], arrays[name])
                tmp = f"{marker}.tmp-{os.getpid()}"
                with open(tmp, "w", encoding="utf-8") as stream:
                    json.dump(
                        {"key": key, "class": class_name, "split": split, **description},
                        stream,
                        indent=2,
                        sort_keys=True,
                        default=str,
                    )
                os.replace(tmp, marker)
                loaded = _load(paths)
    if loaded is None:
        raise OSError(f"{base}-*.npy: written but unreadable; remove them and retry")
    report = {
        "key": key,
        "files": [*paths.values(), marker],
        "built_seconds": built_seconds,
    }
    return loaded, report
