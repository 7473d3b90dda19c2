"""Writing files so that no reader ever sees half of one: hp's one place for temporary names,
atomic replaces, fsync, and whether a directory can be written in.

A file is written under a temporary name beside its target (so on the same filesystem) and
renamed onto it once whole: a reader finds the old file or the new one, never a mix, and a
kill leaves at most a temporary file, which every reader ignores. The temporary name is
`TARGET.tmp-PID-THREAD-RANDOM`, unique to one writer, so two writers of one target (threads
or processes) never write into one file: the last rename wins, whole. The `TARGET.tmp-`
prefix is what hp has always written, and still what its waiters and clean-ups (and those of
an older hp-data sharing a cache) recognise: `is_temp`, `temp_target`, `temp_glob`.

`durable` (the default) also syncs the file before the rename and its directory after it, so
the new file survives a power cut; a cache that is cheap to rebuild passes `durable=False`.

Directories staged under a fixed name and renamed into place once complete (a checkpoint of
step N, `.tmp-step-N`, written by every rank) are named by `staging_name`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

TEMP_MARK = ".tmp-"  # TARGET.tmp-...: a file being written; .tmp-NAME: a directory staged


def temp_name(target: str) -> str:
    """A temporary path beside `target`, unique to this process, thread and call."""
    return f"{target}{TEMP_MARK}{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"


def is_temp(name: str) -> bool:
    """Whether `name` (a path or a file name) is a temporary file of some target."""
    return temp_target(name) is not None


def temp_target(name: str) -> str | None:
    """The file name that temporary file `name` is being written for (`0000000003.chunk` for
    `0000000003.chunk.tmp-12-34-ab`), or None when `name` is no temporary file."""
    base = os.path.basename(name)
    target, mark, _ = base.rpartition(TEMP_MARK)
    return target if mark and target else None


def temp_glob(target: str) -> str:
    """A `glob` pattern matching every temporary file of `target`, a killed writer's too."""
    return glob.escape(target) + TEMP_MARK + "*"


def staging_name(name: str) -> str:
    """The fixed name `.tmp-NAME` of a directory staged for `NAME`, renamed onto it once done."""
    return TEMP_MARK + name


def is_staging(name: str) -> bool:
    """Whether `name` is a staged directory's (`staging_name`): never read, a killed run's."""
    return os.path.basename(name).startswith(TEMP_MARK)


def fsync_path(path: str) -> None:
    """Sync a file or a directory (a directory's entries: what a rename changed) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class AtomicFile:
    """A file written under `temp_name(target)` and renamed onto `target` by `commit`; until
    then `target` is untouched, and `discard` (or leaving a `with` block by an exception)
    removes the temporary file. `file` is the open temporary file (`mode` "wb" or "w").

    As a context manager it is committed at the end of the block unless discarded."""

    def __init__(
        self, target: str, mode: str = "wb", *, durable: bool = True, encoding: str | None = None
    ) -> None:
        if mode not in ("wb", "w"):
            raise ValueError(f"AtomicFile mode must be 'wb' or 'w', not {mode!r}")
        self.target = os.fspath(target)
        self.durable = durable
        self.temp = temp_name(self.target)
        if mode == "w" and encoding is None:
            encoding = "utf-8"
        self.file: IO[Any] = open(self.temp, "x" + mode[1:], encoding=encoding)  # noqa: SIM115
        self.done = False

    def commit(self) -> None:
        """Rename the finished file onto `target` (synced first, and its directory after, when
        `durable`). On failure the temporary file is removed and the error raised."""
        if self.done:
            return
        try:
            self.file.flush()
            if self.durable:
                os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.temp, self.target)
        except BaseException:
            self.discard()
            raise
        self.done = True
        if self.durable:
            fsync_path(os.path.dirname(os.path.abspath(self.target)))

    def discard(self) -> None:
        """Close and remove the temporary file; `target` stays as it was (after `commit`:
        nothing)."""
        if self.done:
            return
        self.done = True
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.temp)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


@contextlib.contextmanager
def committing(
    target: str, mode: str = "wb", *, durable: bool = True, encoding: str | None = None
) -> Iterator[IO[Any]]:
    """The open temporary file of an `AtomicFile`: what the block writes is renamed onto
    `target` at its end, and nothing reaches `target` when it raises."""
    with AtomicFile(target, mode, durable=durable, encoding=encoding) as atomic:
        yield atomic.file


def write_bytes(target: str, data: bytes, *, durable: bool = True) -> None:
    """`data` as the whole of `target`, atomically (`AtomicFile`)."""
    with committing(target, "wb", durable=durable) as stream:
        stream.write(data)


def write_text(target: str, text: str, *, durable: bool = True) -> None:
    """`text` (UTF-8) as the whole of `target`, atomically (`AtomicFile`)."""
    with committing(target, "w", durable=durable) as stream:
        stream.write(text)


def write_json(target: str, value: Any, *, durable: bool = True, **dump: Any) -> None:
    """`value` as JSON (`json.dump`'s keyword arguments in `dump`), atomically (`AtomicFile`)."""
    with committing(target, "w", durable=durable) as stream:
        json.dump(value, stream, **dump)


def directory_problem(directory: str) -> str | None:
    """Why `directory` is no directory, in one line (`DIR does not exist`, `DIR is not a
    directory`), else None."""
    if os.path.isdir(directory):
        return None
    what = "is not a directory" if os.path.exists(directory) else "does not exist"
    return f"{directory} {what}"


def writable_dir_problem(directory: str, fix: str = "") -> str | None:
    """Why files cannot be created in `directory`, in one line, else None: `directory_problem`
    (with `; FIX` after it when `fix` is given), or `cannot write in DIR (permission denied)`.
    Judged from permissions (`os.access`): `can_write_in` tries."""
    problem = directory_problem(directory)
    if problem is not None:
        return f"{problem}; {fix}" if fix else problem
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"cannot write in {directory} (permission denied)"
    return None


def creatable_dir_problem(path: str, show: Callable[[str], str] = str) -> str | None:
    """Why `path` can be neither a directory this process writes in nor one it can create
    (with its parents), in one line naming the nearest directory that stands ("it" when that
    is `path` itself, else `show(parent)`), else None: an output directory checked before a
    job makes it."""
    target = here = os.path.abspath(path)
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    shown = "it" if here == target else show(here)
    if not os.path.isdir(here):
        return f"{shown} is not a directory"
    if not os.access(here, os.W_OK | os.X_OK):
        return f"{shown} is not writable"
    longest = max(len(os.fsencode(part)) for part in os.path.relpath(target, here).split(os.sep))
    if longest > 255 or len(os.fsencode(target)) > 4000:  # NAME_MAX, PATH_MAX on Linux
        return "the name is too long"
    return None


def can_write_in(directory: str) -> bool:
    """Whether a file can be created in `directory`, made (with its parents) where missing:
    tried, not judged from permissions (a read-only mount, a full quota say no too)."""
    try:
        os.makedirs(directory, exist_ok=True)
        with open(temp_name(os.path.join(directory, ".hp-write-test")), "x") as probe:
            os.remove(probe.name)
        return True
    except OSError:
        return False


def first_line(exc: BaseException, *, named: bool = False) -> str:
    """The first line of a third-party exception's message (its class name when it has
    none), for a one-line error of hp's own; `named` puts the class name before it. An
    exception that gathers one per rank (torch.distributed.checkpoint's, whose `failures`
    hold each rank's exception with its traceback) speaks through its first."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text[0]}" if named else text[0]


__all__ = [
    "TEMP_MARK",
    "AtomicFile",
    "can_write_in",
    "committing",
    "directory_problem",
    "first_line",
    "fsync_path",
    "is_staging",
    "is_temp",
    "staging_name",
    "temp_glob",
    "temp_name",
    "temp_target",
    "writable_dir_problem",
    "write_bytes",
    "write_json",
    "write_text",
]
