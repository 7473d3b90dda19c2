"""Move finished `.bin`/`.idx` files into place with one atomic commit point.

A dataset is two files (more with hp's `.hp.json`, `format/metadata.py`, and `.hp.sources`,
`provenance.py`), and no filesystem
renames two names at once: renaming them one after the other leaves, for an instant, a new
`.bin` beside an old `.idx`. So the new files are first gathered in one hidden *journal*
directory with the list of where they go, and renaming that directory to its fixed name,
`.NAME.hp-commit` beside `NAME.bin`, is the commit: before it the final paths hold the old
dataset untouched, after it the new one is the dataset. An old `.hp.json` or `.hp.sources`
that the new dataset has none for is then removed, the files are renamed into place and the journal
removed. A kill in between leaves the journal; whatever of hp next opens or writes the
prefix (`IndexedDataset`, a builder, `preprocess`) finishes it first (`recover`), so hp never
reads a mixed pair.

Several datasets written together (the keys of one preprocess) share one journal, named for
the first; each other one gets a symbolic link `.NAME.hp-commit` to it, made *before* the
commit, dangling (and so ignored) until the journal's rename brings it to life.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Sequence

from hp_data.errors import IndexedDatasetError
from hp_data.format.header import bin_path, idx_path, metadata_path, sources_path
from hp_data.fs import fsync_path

TARGETS = "targets.json"


def journal_path(prefix: str) -> str:
    directory, name = os.path.split(os.path.abspath(prefix))
    return os.path.join(directory, f".{name}.hp-commit")


def recover(prefix: str) -> None:
    """Finish a commit of `prefix` that a kill interrupted (nothing to do when none was)."""
    journal = journal_path(prefix)
    if not os.path.lexists(journal):
        return
    try:
        if os.path.exists(journal):
            _apply(os.path.realpath(journal))
        if os.path.islink(journal):  # a link left dangling by a run killed before its commit
            os.remove(journal)
    except OSError as exc:
        raise IndexedDatasetError(
            f"{prefix}: an interrupted write left {journal} and it cannot be finished here "
            f"({exc.strerror}); open the dataset once with write access to complete it"
        ) from None


def _apply(journal: str) -> None:
    """Rename the journal's files into place, drop its links, then the journal itself."""
    directory = os.path.dirname(journal)
    try:
        with open(os.path.join(journal, TARGETS), encoding="utf-8") as stream:
            plan = json.load(stream)
    except FileNotFoundError:  # every file moved already: the journal is being removed
        shutil.rmtree(journal, ignore_errors=True)
        return
    for stale in plan.get("remove", []):  # an old dataset's metadata, not the new one's
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, stale))
    for name, target in plan["files"]:
        with contextlib.suppress(FileNotFoundError):  # already in place
            os.replace(os.path.join(journal, name), os.path.join(directory, target))
    fsync_path(directory)
    for link in plan["links"]:
        path = os.path.join(directory, link)
        if os.path.islink(path) and os.readlink(path) == os.path.basename(journal):
            os.remove(path)
    shutil.rmtree(journal, ignore_errors=True)


def commit(files: Sequence[tuple[str, str, str, str | None, str | None]]) -> None:
    """Move each finished `(prefix, tmp_bin, tmp_idx, tmp_metadata, tmp_sources)` to
    `prefix.bin`, `.idx`, `.hp.json` and `.hp.sources` (provenance.py), all or none; a prefix
    without `tmp_metadata` (`tmp_sources`) loses any old `.hp.json` (`.hp.sources`): it
    would describe other documents.

    Every prefix must sit in one directory. The first temporary `.bin`'s directory (a
    builder's own, on the same filesystem) becomes the journal; it is gone afterwards."""
    prefixes = [staged[0] for staged in files]
    directory = os.path.dirname(os.path.abspath(prefixes[0]))
    if any(os.path.dirname(os.path.abspath(p)) != directory for p in prefixes):
        raise IndexedDatasetError("datasets committed together must share one directory")
    for prefix in prefixes:
        recover(prefix)
    journal = journal_path(prefixes[0])
    staging = os.path.dirname(os.path.abspath(files[0][1]))
    moves, stale = [], []
    for i, (prefix, tmp_bin, tmp_idx, tmp_metadata, tmp_sources) in enumerate(files):
        staged = [(tmp_bin, bin_path(prefix), ".bin"), (tmp_idx, idx_path(prefix), ".idx")]
        for tmp, final, extension in (
            (tmp_metadata, metadata_path(prefix), ".json"),
            (tmp_sources, sources_path(prefix), ".sources"),
        ):
            if tmp is not None:
                staged.append((tmp, final, extension))
            elif os.path.lexists(final):
                stale.append(os.path.basename(final))
        for source, final, extension in staged:
            name = f"{i}{extension}"
            os.replace(source, os.path.join(staging, name))
            moves.append([name, os.path.basename(final)])
    links = [os.path.basename(journal_path(p)) for p in prefixes[1:]]
    with open(os.path.join(staging, TARGETS), "w", encoding="utf-8") as stream:
        json.dump({"files": moves, "links": links, "remove": stale}, stream)
        stream.flush()
        os.fsync(stream.fileno())
    fsync_path(staging)
    for link in links:  # dangling until the rename below
        os.symlink(os.path.basename(journal), os.path.join(directory, link))
    os.rename(staging, journal)  # the commit point
    fsync_path(directory)
    _apply(journal)
