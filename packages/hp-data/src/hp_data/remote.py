"""Corpus files behind fsspec URLs (`s3://`, `gs://`, `hf://`, `https://`, `memory://`, ...):
listed, identified and opened as the readers open local files, and every input's *pin*, which
each read checks. Needs `hp-data[remote]` for URLs.

A URL input is read as a stream of byte ranges, never downloaded whole first: discovery asks
for metadata only (a HEAD or a listing). An object is identified by its size and every
validator its store gives (ETag, version id or content hash, and modification time), which is
what a resumed run compares, as size and mtime are for a local file.

A `Pin` is what an input was when the run planned it. Every read opens it through `open_pinned`,
which checks the pin as it opens and as it closes, so that an input replaced or rewritten during
a run stops the run ("changed during the run; rerun") instead of giving output of two versions.

Every remote request has `set_timeout` seconds to connect and between bytes (http(s) and s3;
other filesystems keep their own), an http(s) one `REQUEST_TIMEOUTS` times that in all; one
that fails for a passing reason (a timeout, a broken connection, a 5xx answer, a short body) is
tried again, `TRIES` times in all with a backoff; then the run stops with one line naming the
object and the bytes it was reading.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar
from urllib.parse import unquote, urlsplit

import xxhash

from hp_data.errors import PreprocessError, open_input

DEFAULT_TIMEOUT = 60.0  # seconds, --remote-timeout
REQUEST_TIMEOUTS = 10  # an http(s) request ends after this many timeouts, however it goes
TRIES = 3  # of each remote request, with BACKOFF * 2**n seconds between them
BACKOFF = 0.25
_LINE_BLOCK = 64 << 10  # bytes read at a time to find a line's end
_READ_AHEAD = 1 << 20  # for streams read front to back (compressed files)

# Keys of fsspec's info() that change when an object's contents do: content hashes, ETags and
# versions (strong, most telling first), then modification times (weak: HTTP's Last-Modified
# has a resolution of one second).
_STRONG_KEYS = (
    "ETag", "etag", "md5Hash", "crc32c", "Content-MD5", "Digest", "VersionId", "generation",
    "blob_id", "lfs",
)  # fmt: skip
_MODIFIED_KEYS = ("LastModified", "last_modified", "Last-Modified", "mtime", "updated", "created")

_timeout = DEFAULT_TIMEOUT
_timeout_name = "--remote-timeout"  # what messages call the setting (hp-train: a config key)
T = TypeVar("T")


def is_url(path: str) -> bool:
    """A path with a protocol (`s3://...`), read through fsspec."""
    return "://" in path


def is_remote(path: str) -> bool:
    """A path whose data is in a store: a URL, but not a `file://` one of this machine."""
    return is_url(local_path(path))


def local_path(spec: str) -> str:
    """`spec`, a `file://` URL of this machine as the plain path it names (so that it is
    pinned, identified and read once as a local file is); any other spec as it is."""
    if not spec.startswith("file://"):
        return spec
    parts = urlsplit(spec)
    return unquote(parts.path) if parts.netloc in ("", "localhost") and parts.path else spec


def set_timeout(seconds: float, name: str = "--remote-timeout") -> None:
    """Give every remote request of this process `seconds` to connect and between bytes;
    `name` is what messages call the setting."""
    global _timeout, _timeout_name
    if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
        raise PreprocessError(f"{name} {seconds!r}: give a positive number of seconds")
    _timeout_name = name
    if seconds != _timeout:
        _timeout = float(seconds)
        _filesystem.cache_clear()


@dataclass(frozen=True)
class Pin:
    """What an input was when the run planned it: its size, its strongest validator (`tag`:
    an ETag, version id or content hash, as (key, value)), its weak validators (`weak`:
    modification times, a weak ETag), and for a local file its (device, inode)."""

    size: int
    tag: tuple[str, str] | None = None
    weak: tuple[tuple[str, str], ...] = ()
    inode: tuple[int, int] | None = None

    @property
    def strong(self) -> bool:
        """Whether a change of contents always shows: a local file, or an object with a tag.
        With only a size and weak validators, a resumed run cannot trust a finished unit."""
        return self.tag is not None or self.inode is not None

    @property
    def number(self) -> int:
        """The validators as one number, for `WorkUnit.mtime_ns` (what a resume compares)."""
        return xxhash.xxh3_64_intdigest(repr((self.tag, self.weak)).encode()) >> 1

    def holds(self, now: Pin) -> bool:
        """Whether `now` (the input as it is) is still what this pin names: the strongest
        validator both name decides, else every weak one both name."""
        if self.size != now.size or self.inode != now.inode:
            return False
        if self.tag is not None and now.tag is not None and self.tag[0] == now.tag[0]:
            return self.tag == now.tag
        theirs = dict(now.weak)
        shared = [(key, value) for key, value in self.weak if key in theirs]
        if shared:
            return all(theirs[key] == value for key, value in shared)
        return self.tag is None and not self.weak  # nothing to compare: only the size

    @property
    def inode_number(self) -> int | None:
        """A local file's inode number (None for a URL): what a resumed run keeps beside the
        identity, so that a file replaced (written, then renamed over) by one of the same size
        and mtime is seen to be another. Not the device: an NFS mount's is numbered when it is
        mounted, so another node or a remount would redo every unit."""
        return None if self.inode is None else self.inode[1]

    @classmethod
    def of_stat(cls, stat: os.stat_result) -> Pin:
        return cls(stat.st_size, weak=(("mtime_ns", str(stat.st_mtime_ns)),),
                   inode=(stat.st_dev, stat.st_ino))  # fmt: skip

    @classmethod
    def of_info(cls, info: dict[str, Any]) -> Pin:
        def text(key: str) -> str | None:
            value = info.get(key)
            if value is None or value == "":
                return None
            if hasattr(value, "timestamp"):  # a datetime: listings and HEADs differ in tz
                return repr(value.timestamp())
            return str(value)

        found = [(key, value) for key in _STRONG_KEYS if (value := text(key)) is not None]
        tags = [(key, value) for key, value in found if not value.startswith("W/")]
        weak = [(key, value) for key, value in found if value.startswith("W/")]  # weak ETags
        weak += [(key, value) for key in _MODIFIED_KEYS if (value := text(key)) is not None]
        return cls(int(info.get("size") or 0), next(iter(tags), None), tuple(weak))


def same_file(record: dict[str, Any], pin: Pin | None) -> bool:
    """Whether the inode a resume `record` keeps (`Pin.inode_number`) is the input's now.
    A record an older hp-data wrote has none: its size and mtime decide, as they did then."""
    recorded = record.get("inode")
    return recorded is None or recorded == (pin and pin.inode_number)


@functools.lru_cache(maxsize=32)
def _filesystem(protocol: str) -> Any:
    try:
        import fsspec
    except ImportError:
        raise PreprocessError(
            f"{protocol}:// inputs need fsspec: pip install 'hp-data[remote]'"
        ) from None
    try:
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, **_options(protocol))
    except (ImportError, ValueError) as exc:
        raise PreprocessError(
            f"{protocol}:// inputs: {exc} (pip install 'hp-data[remote]' has s3, gs and https)"
        ) from None
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop: hp's (`_retrying`) is the one policy
    if getattr(fs, "async_impl", False):
        _quiet_lost_connections()
    return fs


def _quiet_lost_connections() -> None:
    """fsspec's event loop, told not to print the traceback of a request's body writer that
    lost its connection (a store gone mid-upload): nobody awaits that task once the request
    failed, and asyncio prints it when it is collected. The request's own failure is what
    hp reports, in one line."""
    import fsspec.asyn

    loop = fsspec.asyn.get_loop()

    def handler(loop: Any, context: dict[str, Any]) -> None:
        lost = isinstance(context.get("exception"), OSError)
        if not (lost and context.get("message") == "Task exception was never retrieved"):
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _after_fork() -> None:
    """A forked child (a DataLoader worker) makes its own filesystems (fsspec's async clients
    are not fork-safe) and its own fsspec lock: fsspec's own after-fork hook resets its event
    loop but not the lock that guards making one (it sets `lock`, not `_lock`), so a child
    forked while another thread of the parent held it would wait for it forever."""
    _filesystem.cache_clear()
    asyn = sys.modules.get("fsspec.asyn")
    if asyn is not None and hasattr(asyn, "reset_lock"):
        asyn.reset_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _options(protocol: str) -> dict[str, Any]:
    """The timeouts (and no retries of the library's own) for http(s) and s3, over what fsspec's
    configuration (`fsspec.config.conf`) sets."""
    import fsspec

    configured = fsspec.config.conf.get(protocol, {})
    if protocol in ("http", "https"):
        import aiohttp

        # The socket timeouts end a stall; `total` ends a server that trickles bytes, which
        # they never would (a read is at most a chunk, 1 MiB by default).
        timeout = aiohttp.ClientTimeout(
            total=REQUEST_TIMEOUTS * _timeout, sock_connect=_timeout, sock_read=_timeout
        )
        return {"client_kwargs": {**configured.get("client_kwargs", {}), "timeout": timeout}}
    if protocol in ("s3", "s3a"):
        config = {"connect_timeout": _timeout, "read_timeout": _timeout,
                  "retries": {"total_max_attempts": 1}}  # fmt: skip
        return {"config_kwargs": {**configured.get("config_kwargs", {}), **config}}
    return {}


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


def _is_http(fs: Any) -> bool:
    return "http" in fs.protocol


def expand(spec: str, corpus_format: Callable[[str], str | None]) -> list[str]:
    """The URLs `spec` stands for, as a local path's (`readers.discover`): a glob's matches
    sorted, each "directory" among them standing for its corpus files (those `corpus_format`
    knows) sorted by name; a directory's corpus files; or the object itself. Only metadata is
    fetched (an http(s) URL is a directory when it ends in `/` or is an HTML page without a
    corpus file's name)."""
    fs, path = _split(spec)
    verb = "list"

    def listing(directory: str) -> list[str]:
        entries = _retrying(lambda: fs.ls(directory, detail=True))
        names = sorted(e["name"] for e in entries if e["type"] == "file")
        found = [_url(fs, name) for name in names if corpus_format(name) is not None]
        if not found:
            raise PreprocessError(f"{_url(fs, directory)}: directory holds no corpus files")
        return found

    try:
        if glob.has_magic(path):
            matches = _retrying(lambda: fs.glob(path, detail=True))
            if not matches:
                raise PreprocessError(f"{spec}: pattern matches no files")
            urls = []
            for name in sorted(matches):
                is_dir = matches[name].get("type") == "directory"
                urls += listing(name) if is_dir else [_url(fs, name)]
            return urls
        verb = "read"
        info = _retrying(lambda: fs.info(path))
        directory = info.get("type") == "directory" or (
            _is_http(fs)
            and (path.endswith("/") or (info.get("mimetype") == "text/html" and
                                        corpus_format(path.split("?", 1)[0]) is None))
        )  # fmt: skip
        verb = "list"
        return listing(path) if directory else [spec]
    except PreprocessError:
        raise
    except Exception as exc:  # each filesystem raises its own errors (auth, network, ...)
        if _missing(exc):
            raise PreprocessError(f"{spec}: no such file or directory") from None
        raise PreprocessError(f"{spec}: cannot {verb}: {_describe(exc)}") from None


def identify(url: str) -> Pin:
    """What the object at `url` is now (its pin), with a warning (one line) when nothing
    strong identifies it: then a change that keeps its size and modification time is not seen."""
    fs, path = _split(url)
    try:
        info = _retrying(lambda: fs.info(path))
    except Exception as exc:
        raise _failure(url, exc) from None
    if info.get("type") == "directory":
        raise PreprocessError(f"{url}: is a directory, expected a corpus file")
    if info.get("size") is None:
        raise PreprocessError(
            f"{url}: the server gives no size (Content-Length), which reading byte ranges needs"
        )
    pin = Pin.of_info(info)
    if not pin.strong:
        names = [f"a weak {key}" if value.startswith("W/") else key for key, value in pin.weak]
        by = f"its size and {', '.join(names)}" if names else "its size"
        warnings.warn(
            f"{url}: no ETag, version id or content hash: only {by} can show a change; "
            "a resumed run reads it again rather than reuse its finished units",
            stacklevel=2,
        )
    return pin


def _now(path: str) -> Pin:
    """The pin of the input at `path` as it is now (never a cached listing)."""
    if not is_url(path):
        try:
            return Pin.of_stat(os.stat(path))
        except FileNotFoundError:
            raise PreprocessError(f"{path}: no such file (deleted during the run?)") from None
    return current_pin(path)  # type: ignore[return-value]


def current_pin(url: str, missing_ok: bool = False) -> Pin | None:
    """The pin of the object at `url` as it is now, asked of the store (never a cached
    listing); None for a missing one when `missing_ok`."""
    fs, stripped = _split(url)
    fs.invalidate_cache(stripped)
    try:
        return Pin.of_info(_retrying(lambda: fs.info(stripped)))
    except Exception as exc:
        if missing_ok and _missing(exc):
            return None
        raise _failure(url, exc) from None


def check_unchanged(path: str, pin: Pin | None) -> None:
    """Raise the one-line error when the input at `path` is no longer what `pin` names."""
    if pin is not None and not pin.holds(_now(path)):
        raise PreprocessError(f"{path}: changed during the run; rerun")


@contextlib.contextmanager
def open_pinned(
    path: str, pin: Pin | None, expected: str, read_ahead: bool = False
) -> Iterator[BinaryIO]:
    """The input at `path` for reading, local or behind a URL, checked against `pin` as it
    opens and closes. An error while it is read is checked too: a line that is malformed
    because the input changed says that it changed. `read_ahead`: the caller reads front to
    back in small pieces (a decompressor)."""
    if is_url(path):
        opened = _open_url(path, pin, read_ahead)
    else:
        check_unchanged(path, pin)
        opened = open_input(path, PreprocessError, expected)
    with opened as stream:
        try:
            yield stream  # type: ignore[misc]
        except _Unreachable:
            raise  # no answer: asking again whether it changed cannot help
        except Exception:
            check_unchanged(path, pin)
            raise
    check_unchanged(path, pin)


@contextlib.contextmanager
def _open_url(url: str, pin: Pin | None, read_ahead: bool) -> Iterator[BinaryIO]:
    """The object, checked against `pin` with what opening it learned (s3fs fetches the
    object's info, and then reads only that ETag: If-Match), else with a HEAD of its own."""
    fs, path = _split(url)
    options: dict[str, Any] = {"cache_type": "none"}  # each read asks for exactly its bytes
    if read_ahead:
        options = {"cache_type": "readahead", "block_size": _READ_AHEAD}
    if _is_http(fs) and pin is not None:
        options["size"] = pin.size  # known: no HEAD of fsspec's, the check below makes one
    fs.invalidate_cache(path)  # a listing's info is no check
    try:
        stream = _retrying(lambda: fs.open(path, "rb", **options))
    except Exception as exc:
        raise _failure(url, exc) from None
    with contextlib.closing(stream):
        learned = Pin.of_info(getattr(stream, "details", None) or {})
        if pin is not None and learned.tag is None and not learned.weak:
            check_unchanged(url, pin)
        elif pin is not None and not pin.holds(learned):
            raise PreprocessError(f"{url}: changed during the run; rerun")
        yield _Reader(url, stream)  # type: ignore[misc]


class _Reader:
    """An fsspec file whose reads are retried (`_retrying`) and checked to return every byte
    asked for (a server may send fewer), failing with one line naming the object and bytes."""

    def __init__(self, url: str, stream: Any) -> None:
        self.url, self.stream = url, stream
        self.size = size_of(stream)

    def read(self, size: int = -1) -> bytes:
        at = self.stream.tell()
        left = max(self.size - at, 0)
        wanted = left if size < 0 else min(size, left)

        def attempt() -> bytes:
            self.stream.seek(at)
            data = self.stream.read(wanted)
            if len(data) != wanted:
                raise _ShortRead(f"{len(data):,} of {wanted:,} bytes came")
            return data

        try:
            return _retrying(attempt)
        except Exception as exc:
            raise _failure(self.url, exc, f"bytes {at}-{at + wanted}") from None

    def readline(self) -> bytes:
        parts = []
        while block := self.read(_LINE_BLOCK):
            found = block.find(b"\n")
            if found >= 0:
                parts.append(block[: found + 1])
                self.seek(self.tell() - len(block) + found + 1)
                break
            parts.append(block)
        return b"".join(parts)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.stream.seek(offset, whence)

    def tell(self) -> int:
        return self.stream.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self.stream.closed

    def close(self) -> None:
        self.stream.close()


def size_of(stream: BinaryIO) -> int:
    """The size of an open corpus file, local or remote."""
    return stream.size if hasattr(stream, "size") else os.fstat(stream.fileno()).st_size


# -- failures -------------------------------------------------------------------------------


class _Unreachable(PreprocessError):
    """A server that did not answer (timeouts, connections that failed), after `TRIES`."""


class _ShortRead(OSError):
    """A server sent fewer bytes than asked for, and than the object holds."""


def _retrying(call: Callable[[], T]) -> T:
    """`call()`, tried again after a passing failure, `TRIES` times in all."""
    for attempt in range(TRIES):
        try:
            return call()
        except Exception as exc:
            if attempt == TRIES - 1 or not _passing(exc):
                raise
        time.sleep(BACKOFF * 2**attempt)
    raise AssertionError("unreachable")


def store_path(url: str) -> tuple[Any, str]:
    """fsspec's filesystem for `url` (hp's timeouts, none of the library's own retries) and
    the path in it: for writers of objects (hp-train's checkpoints) that follow this policy."""
    return _split(url)


def retried(call: Callable[[], T]) -> T:
    """`call()` (one request to a store) under the one retry policy of every remote read."""
    return _retrying(call)


def describe(exc: BaseException) -> str:
    """A store's failure in words, for a one-line error of the caller's."""
    return _describe(exc)


def missing(exc: BaseException) -> bool:
    """Whether `exc` says the object is not there."""
    return _missing(exc)


def _cause(exc: BaseException) -> BaseException:
    """The error behind fsspec's HTTP `FileNotFoundError`, which it raises for any failure."""
    if isinstance(exc, FileNotFoundError) and exc.__cause__ is not None:
        return exc.__cause__
    return exc


def _status(exc: BaseException) -> int | None:
    status = getattr(_cause(exc), "status", None)  # aiohttp's ClientResponseError
    return status if isinstance(status, int) else None


def _names(exc: BaseException) -> set[str]:
    """The class names of `exc` (and its bases): botocore and aiohttp are optional imports."""
    return {cls.__name__ for cls in type(_cause(exc)).__mro__}


def _missing(exc: BaseException) -> bool:
    status = _status(exc)
    if status is not None:
        return status in (404, 410)
    return isinstance(exc, FileNotFoundError) and exc.__cause__ is None


def _changed(exc: BaseException) -> bool:
    return _status(exc) == 412 or "FileExpired" in _names(exc)  # a pinned ETag (If-Match)


def _timed_out(exc: BaseException) -> bool:
    return isinstance(_cause(exc), TimeoutError) or any("Timeout" in n for n in _names(exc))


def _passing(exc: BaseException) -> bool:
    """Whether asking again may succeed: a timeout, a broken connection, a server's 5xx."""
    if isinstance(exc, PreprocessError) or _missing(exc) or _changed(exc):
        return False
    status = _status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    return not isinstance(_cause(exc), PermissionError | ValueError | TypeError | KeyError)


def _unreachable(exc: BaseException) -> bool:
    connection = {"ConnectionError", "ClientConnectionError", "EndpointConnectionError"}
    return _timed_out(exc) or bool(_names(exc) & connection)


def _describe(exc: BaseException) -> str:
    """What went wrong, in words, for a one-line error."""
    cause = _cause(exc)
    reason = " ".join(str(cause).split())[:300] or type(cause).__name__
    if _timed_out(exc):
        whole = REQUEST_TIMEOUTS * _timeout
        return (
            f"no answer within {_timeout:g} s ({_timeout_name}; an http(s) request may take "
            f"{whole:g} s in all), {TRIES} tries"
        )
    if _unreachable(exc):
        return f"cannot reach the server, {TRIES} tries ({reason})"
    if isinstance(cause, ValueError) and "range requests" in reason:
        return (
            "the server does not answer byte-range requests (HTTP Range), which a URL is read "
            "by; serve it from one that does, or download it"
        )
    if _passing(exc):
        return f"{reason}, {TRIES} tries"
    return reason


def _failure(url: str, exc: BaseException, where: str = "") -> PreprocessError:
    """The one-line error for a remote failure (`where`: the bytes that were being read)."""
    if isinstance(exc, PreprocessError):
        return exc
    if _changed(exc):
        return PreprocessError(f"{url}: changed during the run; rerun")
    head = f"{url}: cannot read {where}: " if where else f"{url}: "
    if _missing(exc):
        return PreprocessError(head + ("no such file (deleted during the run?)" if where
                                       else "no such file"))  # fmt: skip
    if isinstance(_cause(exc), PermissionError) or _status(exc) in (401, 403):
        return PreprocessError(f"{head}access denied: {_describe(exc)}")
    kind = _Unreachable if _unreachable(exc) else PreprocessError
    return kind(head + ("" if where else "cannot read: ") + _describe(exc))
