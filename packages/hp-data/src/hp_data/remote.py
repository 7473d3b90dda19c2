"""Corpus files behind fsspec URLs (`s3://`, `gs://`, `hf://`, `https://`, `memory://`, ...):
listed, identified and opened as the readers open local files. Needs `hp-data[remote]`.

A URL input is read as a stream of byte ranges, never downloaded whole first. An object is
identified by its size and its ETag (else its modification time, else its version), which is
what a resumed run compares, as size and mtime are for a local file.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Any, BinaryIO

import xxhash

from hp_data.errors import PreprocessError, open_input

# Keys of fsspec's info() that change when an object's contents do, most telling first.
_IDENTITY_KEYS = (
    "ETag", "etag", "md5Hash", "crc32c", "LastModified", "last_modified", "mtime", "updated",
    "created", "VersionId", "generation", "lfs", "blob_id",
)  # fmt: skip


def is_url(path: str) -> bool:
    """A path with a protocol (`s3://...`), read through fsspec."""
    return "://" in path


@functools.lru_cache(maxsize=32)
def _filesystem(protocol: str) -> Any:
    try:
        import fsspec
    except ImportError:
        raise PreprocessError(
            f"{protocol}:// inputs need fsspec: pip install 'hp-data[remote]'"
        ) from None
    try:
        return fsspec.filesystem(protocol)
    except (ImportError, ValueError) as exc:
        raise PreprocessError(
            f"{protocol}:// inputs: {exc} (pip install 'hp-data[remote]' has s3, gs and https)"
        ) from None


def _split(url: str) -> tuple[Any, str]:
    protocol = url.split("://", 1)[0]
    fs = _filesystem(protocol)
    return fs, fs._strip_protocol(url)


def _url(fs: Any, path: str) -> str:
    return fs.unstrip_protocol(path)


def canonical_url(url: str) -> str:
    """`url` as fsspec spells the object: as a glob or directory lists it (`memory://a/x` is
    `memory:///a/x`), so that a file named and matched again is seen to be one."""
    return _url(*_split(url))


def expand(spec: str, suffix_format: Any) -> list[str]:
    """The URLs `spec` stands for: a glob's matches sorted, a directory's corpus files (those
    `suffix_format` knows) sorted by name, or the object itself."""
    fs, path = _split(spec)
    try:
        if glob.has_magic(path):
            matches = sorted(fs.glob(path))
            if not matches:
                raise PreprocessError(f"{spec}: pattern matches no files")
            return [_url(fs, match) for match in matches]
        if fs.isdir(path):
            names = sorted(
                entry["name"] for entry in fs.ls(path, detail=True) if entry["type"] == "file"
            )
            found = [_url(fs, name) for name in names if suffix_format(name) is not None]
            if not found:
                raise PreprocessError(f"{spec}: directory holds no corpus files")
            return found
        if not fs.exists(path):
            raise PreprocessError(f"{spec}: no such file or directory")
    except PreprocessError:
        raise
    except Exception as exc:  # each filesystem raises its own errors (auth, network, ...)
        raise PreprocessError(f"{spec}: cannot list: {_reason(exc)}") from None
    return [spec]


def identify(url: str) -> tuple[int, int]:
    """(size, a number that changes when the object's contents do) of the object at `url`."""
    fs, path = _split(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise PreprocessError(f"{url}: no such file") from None
    except Exception as exc:
        raise PreprocessError(f"{url}: cannot read: {_reason(exc)}") from None
    if info.get("type") == "directory":
        raise PreprocessError(f"{url}: is a directory, expected a corpus file")
    version = repr([info.get(key) for key in _IDENTITY_KEYS if info.get(key) is not None])
    return int(info.get("size") or 0), xxhash.xxh3_64_intdigest(version.encode()) >> 1


def open_url(url: str) -> BinaryIO:
    """The object at `url`, for reading byte ranges (seek, read) as a stream."""
    fs, path = _split(url)
    try:
        return fs.open(path, "rb")
    except FileNotFoundError:
        raise PreprocessError(f"{url}: no such file") from None
    except Exception as exc:
        raise PreprocessError(f"{url}: cannot read: {_reason(exc)}") from None


def open_corpus(path: str, expected: str) -> BinaryIO:
    """A corpus file for reading, local (`open_input`) or behind a URL."""
    return open_url(path) if is_url(path) else open_input(path, PreprocessError, expected)


def size_of(stream: BinaryIO) -> int:
    """The size of an open corpus file, local or remote."""
    return stream.size if hasattr(stream, "size") else os.fstat(stream.fileno()).st_size


def _reason(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
