"""`hp-train export --out DIR`: a directory written whole or not at all, never at the cost of
a file the export did not write.

The files are written into a fresh hidden sibling, `.DIR.export-XXXXXXXX` (a unique name this
export made, so no one else's directory is ever taken for a stale one), with a manifest,
`hp-export.json`, that lists them. The sibling then takes DIR's place in one rename: a DIR that
does not exist or is empty is replaced; a DIR that is a previous export (its manifest lists
every file in it) is swapped with the new one atomically (Linux `renameat2(RENAME_EXCHANGE)`)
and then only the files its manifest lists are removed. Anything else at DIR is refused
untouched. A kill leaves DIR as it was or as the new export, never a mix; at most a hidden
sibling stays behind. (Without RENAME_EXCHANGE, e.g. on NFS, the old export is renamed aside
first: a kill in the instant between the two renames leaves it in `.DIR.export-old-XXXXXXXX`.)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable

from hp_data.fs import fsync_path, writable_dir_problem

from hp_runtime.train.dirlock import DirLock
from hp_runtime.train.errors import TrainError

MANIFEST = "hp-export.json"
WRITTEN_BY = "hp-train export"
# The names an export writes; a manifest naming anything else is not ours.
_OURS = re.compile(
    r"config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
)


def _exchange(a: str, b: str) -> None:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); OSError where the
    system or filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _manifest_files(directory: str) -> list[str] | None:
    """The files a previous export's manifest lists, or None when it is not one of ours."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as stream:
            manifest = json.load(stream)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):  # valid JSON, but garbled: `[1]`, `"x"`
        return None
    files = manifest.get("files")
    if manifest.get("written_by") != WRITTEN_BY or not isinstance(files, list):
        return None
    if not all(isinstance(f, str) and _OURS.fullmatch(f) for f in files):
        return None
    return files


class ExportTarget:
    """DIR for an export, used as a context manager: entering it takes DIR's lock
    (`dirlock`: `.DIR.export-lock` beside DIR, so that a second export into DIR meanwhile is
    refused, naming the first) and checks DIR, with a one-line `TrainError` for anything that
    is not absent, empty, or a previous export; `commit` then writes it, and leaving lets go."""

    def __init__(self, out: str, option: str = "--out") -> None:
        self.out = out
        self.label = f"{option} {out}"
        self.path = os.path.realpath(out)
        self.parent, self.name = os.path.split(self.path)
        self.old: list[str] | None = None  # the previous export's files, when DIR is one
        self.lock: DirLock | None = None
        problem = writable_dir_problem(self.parent, fix="create it first")
        if problem is not None:
            raise TrainError(f"{self.label}: {problem}")

    def __enter__(self) -> ExportTarget:
        """DIR locked, then checked: what an export before this one left there is judged."""
        self.lock = DirLock(os.path.join(self.parent, f".{self.name}.export-lock"))
        holder = self.lock.take()
        if holder is not None:
            raise TrainError(
                f"{self.label}: another hp-train export is writing it ({holder}); wait for it "
                "to end, or give another directory"
            )
        try:
            self._check()
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.lock is not None:
            self.lock.release()

    def _check(self) -> None:
        self.old = None
        if not os.path.lexists(self.path):
            return
        if not os.path.isdir(self.path):
            raise TrainError(
                f"{self.label}: is a file, not a directory; give a new or empty directory"
            )
        if os.path.samefile(self.path, os.getcwd()):
            raise TrainError(
                f"{self.label}: is the current directory; give a directory inside it, "
                "such as ./hf-model"
            )
        entries = os.listdir(self.path)
        if not entries:
            return
        files = _manifest_files(self.path)
        if files is None:
            raise TrainError(
                f"{self.label}: is a non-empty directory that is not an hp-train export; give a "
                "new or empty directory (export never deletes files it did not write)"
            )
        for entry in sorted(entries):
            regular = stat.S_ISREG(os.lstat(os.path.join(self.path, entry)).st_mode)
            if not regular or (entry != MANIFEST and entry not in files):
                raise TrainError(
                    f"{self.label}: holds {entry}, which hp-train export did not write; move it "
                    "out or give another directory"
                )
        self.old = files

    def commit(self, write: Callable[[str], list[str]]) -> list[str]:
        """`write(directory)` fills a new directory and returns the names of its files; they
        take DIR's place as described above."""
        if self.lock is None:
            raise RuntimeError("ExportTarget.commit outside its with block (DIR unchecked)")
        try:
            staging = tempfile.mkdtemp(prefix=f".{self.name}.export-", dir=self.parent)
        except OSError as exc:
            raise TrainError(
                f"{self.label}: cannot write in {self.parent} ({exc.strerror})"
            ) from None
        self._swapped = False
        try:
            files = write(staging)
            with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as stream:
                json.dump({"written_by": WRITTEN_BY, "files": sorted(files)}, stream, indent=2)
            for file in [*files, MANIFEST]:
                os.chmod(os.path.join(staging, file), 0o666 & ~_umask())  # safetensors': 0600
                fsync_path(os.path.join(staging, file))
            os.chmod(staging, self._mode())
            fsync_path(staging)
            self._swap_in(staging)
        except BaseException as exc:
            if not self._swapped:  # staging is still the new export alone: ours to remove
                shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError):
                raise TrainError(f"{self.label}: cannot be written ({exc.strerror})") from None
            raise
        fsync_path(self.parent)
        return files

    def _mode(self) -> int:
        """The replaced directory's permissions, else the umask's (mkdtemp's are 0700)."""
        if os.path.isdir(self.path):
            return stat.S_IMODE(os.stat(self.path).st_mode)
        return 0o777 & ~_umask()

    def _swap_in(self, staging: str) -> None:
        if self.old is None:  # nothing or an empty directory: one rename replaces it
            try:
                os.rename(staging, self.path)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise TrainError(
                        f"{self.label}: something was written there meanwhile; nothing changed"
                    ) from None
                raise
            self._swapped = True
            return
        try:
            _exchange(staging, self.path)
            self._swapped = True
            aside = staging  # now the previous export
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                raise
            holder = tempfile.mkdtemp(prefix=f".{self.name}.export-old-", dir=self.parent)
            aside = os.path.join(holder, self.name)
            os.rename(self.path, aside)
            try:
                os.rename(staging, self.path)
            except BaseException:
                os.rename(aside, self.path)
                os.rmdir(holder)
                raise
            self._swapped = True
        self._remove_old(aside)

    def _remove_old(self, aside: str) -> None:
        """The previous export's own files, then its (then empty) directories; anything
        else that appeared there stays."""
        for file in [*(self.old or []), MANIFEST]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(aside, file))
        with contextlib.suppress(OSError):
            os.rmdir(aside)
            if os.path.basename(os.path.dirname(aside)).startswith(f".{self.name}.export-old-"):
                os.rmdir(os.path.dirname(aside))


def leftovers(out: str) -> list[str]:
    """Hidden directories beside DIR that killed exports left."""
    parent, name = os.path.split(os.path.realpath(out))
    prefix = f".{name}.export-"
    with contextlib.suppress(OSError):
        return sorted(e for e in os.listdir(parent) if e.startswith(prefix))
    return []
