"""One job at a time in a directory: every hp-train command that writes in a run directory
(training, `replay`, `verify`) holds `RUN_DIR/hp-train.lock` for the whole job, and
`hp-train export --out DIR` holds `.DIR.export-lock` beside DIR, so that a second job there
(the same command twice, a scheduler's duplicate launch) is refused before it writes anything.

The lock is the kernel's (`flock`), so it goes with the process that holds it: a job killed by
SIGKILL leaves the file behind, and that file blocks no one. Once it holds the lock, the job
writes its host, pid and start time into the file, which is how a refused job names it; it
removes the file as it lets go. Under torchrun the lock belongs to the job, not to a rank: rank
0 takes it and every rank learns the verdict (`agree`), so a refusal is one line from rank 0
and no rank waits. On a filesystem without file locks the job warns and runs unguarded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from typing import TYPE_CHECKING, Any, TextIO

from hp_data.cache import close_lock_file, open_lock_file

from hp_runtime.train.errors import TrainError

if TYPE_CHECKING:
    from hp_runtime.train.launch import Runtime

LOCK = "hp-train.lock"  # in RUN_DIR
HOLDER_WAIT_S = 2.0  # how long a refused job waits for the holder to write its name


def _lock(fd: int) -> None:
    """Take the file's lock without waiting: BlockingIOError while another holds it, another
    OSError where the filesystem has no locks."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file `fd` is open on (a holder letting go removes it)."""
    try:
        mine, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _holder(fd: int) -> str:
    """The holder as its file names it ('pid 12 on host n1, since ...'): it writes that just
    after taking the lock, so a job refused in between waits a moment for it."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            note = json.loads(os.pread(fd, 4096, 0))
            return f"pid {int(note['pid'])} on host {note['host']}, since {note['since']}"
        except (OSError, ValueError, TypeError, KeyError):
            if time.monotonic() >= deadline:
                return "its holder wrote no host and pid"
            time.sleep(0.05)


def _open(path: str) -> int:
    """The lock file, created if absent, never through a link nor anything but a file."""
    try:
        fd = open_lock_file(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        what = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory"}.get(exc.errno)
        if what is None:
            raise TrainError(f"{path}: cannot be opened ({exc.strerror})") from None
        raise TrainError(f"{path}: is {what}, not hp-train's lock file; move it aside") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        close_lock_file(fd)
        raise TrainError(f"{path}: is not a regular file, not hp-train's lock file; move it aside")
    return fd


class DirLock:
    """The lock file at `path`, taken without waiting (`take`) and let go (`release`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self.pid = 0  # the process that took it: a forked child lets nothing go
        self.unsupported: str | None = None  # why the filesystem could not lock, if it could not

    def take(self) -> str | None:
        """None once this process holds the lock (or runs unguarded: `unsupported`), else
        the holder, named. TrainError for a path that is not a lock file."""
        for _ in range(100):  # a holder letting go removes the file between our open and lock
            fd = _open(self.path)
            try:
                _lock(fd)
            except BlockingIOError:
                holder = _holder(fd)
                close_lock_file(fd)
                return holder
            except OSError as exc:
                self.unsupported = exc.strerror or str(exc)
            if self.unsupported or _same_file(fd, self.path):
                self.fd, self.pid = fd, os.getpid()
                self._sign()
                return None
            close_lock_file(fd)
        raise TrainError(f"{self.path}: replaced faster than it could be locked; try again")

    def _sign(self) -> None:
        """Our host, pid and start time in the file, for whoever is refused."""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        note = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since})
        assert self.fd is not None
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, (note + "\n").encode(), 0)
            os.fsync(self.fd)  # another node reads it through the file server
        except OSError as exc:
            self.release()
            raise TrainError(f"{self.path}: cannot be written ({exc.strerror})") from None

    def release(self) -> None:
        """Remove the file (while still holding it) and let the lock go; idempotent."""
        fd, self.fd = self.fd, None
        if fd is None or self.pid != os.getpid():
            return
        if _same_file(fd, self.path):
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        close_lock_file(fd)

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RunDirLock:
    """A job's hold on its run directory (`hold_run_dir`); `release` lets it go, and removes
    the directories it created if nothing else was put in them (a refused run leaves none)."""

    def __init__(self) -> None:
        self.lock: DirLock | None = None
        self.created: list[str] = []  # deepest first

    def take(self, run_dir: str, stream: TextIO) -> None:
        here = os.path.abspath(run_dir)
        while not os.path.lexists(here) and os.path.dirname(here) != here:
            self.created.append(here)
            here = os.path.dirname(here)
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as exc:
            raise TrainError(f"{run_dir}: cannot be created ({exc.strerror})") from None
        self.lock = DirLock(os.path.join(run_dir, LOCK))
        holder = self.lock.take()
        if holder is not None:
            raise TrainError(
                f"{run_dir}: another hp-train job is writing here ({holder}); wait for it to "
                "end, or give another run directory"
            )
        if self.lock.unsupported is not None:
            print(
                f"hp-train: warning: {self.lock.path}: this filesystem cannot lock files "
                f"({self.lock.unsupported}); nothing stops a second job from writing in "
                f"{run_dir} meanwhile",
                file=stream,
                flush=True,
            )

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
        for directory in self.created:
            try:
                os.rmdir(directory)
            except OSError:  # not empty: the run's (or someone's) files are in it
                break
        self.created = []

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def hold_run_dir(run_dir: str, runtime: Runtime, stream: TextIO) -> RunDirLock:
    """Rank 0 takes `run_dir`'s lock before anything is written there (a warning on `stream`
    where the filesystem cannot lock); every rank raises rank 0's refusal (`agree`: rank 0's
    line, its peers quietly), or returns the hold (a no-op on ranks other than 0) to
    `release` at the job's end."""
    from hp_runtime.train.launch import agree

    held, failure = RunDirLock(), None
    if runtime.is_main:
        try:
            held.take(run_dir, stream)
        except TrainError as exc:
            failure = exc
    try:
        agree(failure, runtime)
    except BaseException:
        held.release()
        raise
    return held
