"""Checkpoints under an fsspec URL (`checkpoint.dir = "s3://bucket/run/checkpoints"`): the
commit protocol without a rename, and a mirror on the node's disk to read them from.

An object store has no atomic rename, so a checkpoint is written where it stays. Every rank's
DCP writes land in a local staging directory first (`RUN_DIR/checkpoints/.staging-step-N`,
as a local checkpoint's do), and each rank uploads the files it wrote (its shards and its
random states; rank 0 also `meta.json`) under the checkpoint's final prefix `DIR/step-N/`,
each request retried as data reads are (`hp_data.remote`), a large file in parts
`checkpoint.upload_concurrency` at a time (`Uploader`, inside DCP's write: in the background
under `checkpoint.async`). DCP hands rank 0 every rank's results before it finishes, so rank 0
knows every object, its size and xxh3-64: it uploads DCP's `.metadata` and then, last, the
commit object `DIR/step-N/commit.json` that lists them all. A prefix without one is not a
checkpoint: resume names it and skips it; nothing is ever read from it.

`keep` deletes only what a committed checkpoint of this run lists: its objects first, its
commit object last (a kill midway leaves it listed, and it goes at the next save), never
anything else under the prefix.

Reading (`mirror`), a checkpoint's small objects are copied into a directory on the node's
disk, each checked against the listing; a shard file is fetched when a rank's reads reach it
(`fetcher`), so that a rank resuming on its own layout downloads its own shards only; the
local readers (checksums, no pickle) do the rest. With `checkpoint.local_copy` the staging
directory of the newest save becomes that mirror, so a restart on the same node downloads
nothing it has.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash
from hp_data.cache import resolve_cache_dir
from hp_data.redact import redact
from hp_data.remote import (
    canonical_url,
    describe,
    is_remote,
    missing,
    retried,
    store_path,
)
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from hp_runtime.train import storage
from hp_runtime.train.checkpoint_format import META, PREFIX, CheckpointError

COMMIT = "commit.json"
MIRROR = "local-"  # a mirror's name beside staging: never `step-N`, never taken for one
_LISTING = "hp.objects"  # the fqn of the result that carries a rank's objects to rank 0
_READ_BLOCK = 16 << 20
_PART = re.compile(r"[A-Za-z0-9._-]+")  # of an object's name: no query or fragment a store
# library would cut off (and so read or delete another object by)
PART_BYTES = 64 << 20  # a multipart upload's part: a 5 GB shard is 80 parts (S3 allows 10,000)


def join(root: str, *names: str) -> str:
    return "/".join([root.rstrip("/"), *names])


class UploadFailed(OSError):
    """An object that could not be written, after the retries; the message names it."""


def file_digest(path: str) -> tuple[int, str]:
    """A file's size and xxh3-64, read in blocks (shards are gigabytes)."""
    hasher, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as stream:
        while block := stream.read(_READ_BLOCK):
            hasher.update(block)
            size += len(block)
    return size, hasher.hexdigest()


def upload(local: str, url: str, concurrency: int) -> tuple[int, str]:
    """`local` put at `url` (multipart where the store has it); its (size, xxh3) for the
    listing. A failure after the retries is `UploadFailed`, named by the redacted URL."""
    listed = file_digest(local)
    fs, path = store_path(url)
    s3 = "s3" in fs.protocol  # s3fs: in parts above PART_BYTES, `concurrency` at a time
    parts = {"max_concurrency": concurrency, "chunksize": PART_BYTES} if s3 else {}
    try:
        retried(lambda: fs.put_file(local, path, **parts))
    except Exception as exc:
        raise UploadFailed(f"{redact(url)}: cannot be written: {describe(exc)}") from None
    return listed


def _put_bytes(data: bytes, url: str) -> None:
    fs, path = store_path(url)
    try:
        retried(lambda: fs.pipe_file(path, data))
    except Exception as exc:
        raise UploadFailed(f"{redact(url)}: cannot be written: {describe(exc)}") from None


def _read_bytes(url: str) -> bytes | None:
    """An object's bytes (None: there is none), retried; an unreachable store stops the run."""
    fs, path = store_path(url)
    try:
        return retried(lambda: fs.cat_file(path))
    except Exception as exc:
        if missing(exc):
            return None
        raise CheckpointError(f"{redact(url)}: cannot be read: {describe(exc)}", False) from None


@dataclass(frozen=True)
class Commit:
    """A checkpoint's commit object: its step, the run that wrote it and every object by name
    (relative to the checkpoint's prefix) with its size and xxh3-64."""

    url: str
    step: int
    run_id: str
    objects: dict[str, tuple[int, str]]

    def to_json(self) -> bytes:
        objects = {name: {"size": s, "xxh3": d} for name, (s, d) in sorted(self.objects.items())}
        return storage.json_bytes({"step": self.step, "run_id": self.run_id, "objects": objects})

    @classmethod
    def parse(cls, url: str, data: bytes) -> Commit:
        where = redact(join(url, COMMIT))
        try:
            value = storage.parse_json(data, where)
        except storage.Damaged as exc:
            raise CheckpointError(str(exc)) from None
        objects = value.get("objects")
        good = isinstance(value.get("step"), int) and isinstance(value.get("run_id"), str)
        good = good and isinstance(objects, dict) and META in objects
        listed: dict[str, tuple[int, str]] = {}
        for name, entry in (objects or {}).items() if good else ():
            entry = entry if isinstance(entry, dict) else {}
            size, digest = entry.get("size"), entry.get("xxh3")
            if not (_plain(name) and isinstance(size, int) and size >= 0):
                good = False
            listed[name] = (size, digest)
            good = good and isinstance(digest, str)
        folders = {name.rsplit("/", 1)[0] for name in listed if "/" in name}
        step = url.rstrip("/").rsplit("/", 1)[-1][len(PREFIX) :]
        good = good and not folders & set(listed) and step.isdigit()
        if not good or int(step) != value["step"]:
            raise CheckpointError(
                f"{where}: not a commit object (its step, run_id and objects, each a plain "
                "relative name with a size and xxh3)"
            )
        return cls(url, value["step"], value["run_id"], listed)


def _plain(name: str) -> bool:
    """A relative name of plain parts, none of them "." or ".."."""
    parts = name.split("/")
    return all(_PART.fullmatch(p) and p not in (".", "..") for p in parts)


def read_commit(url: str) -> Commit | None:
    """The commit object of the checkpoint at `url`; None where it has none (not committed)."""
    data = _read_bytes(join(url, COMMIT))
    return None if data is None else Commit.parse(url, data)


def steps(root: str) -> list[str]:
    """The `step-N` prefixes under `root`, oldest first, committed or not (asked afresh: a
    listing cached by fsspec may predate the last save)."""
    fs, path = store_path(root)
    try:
        fs.invalidate_cache()
        names = retried(lambda: fs.ls(path, detail=False))
    except Exception as exc:
        if missing(exc):
            return []
        raise CheckpointError(f"{redact(root)}: cannot be listed: {describe(exc)}", False) from None
    found = sorted(
        base for name in names
        if (base := name.rstrip("/").rsplit("/", 1)[-1]).startswith(PREFIX)
        and base[len(PREFIX) :].isdigit()
    )  # fmt: skip
    return [join(root, name) for name in found]


def commit(url: str, listing: Commit) -> None:
    """Write the commit object of the checkpoint at `url`: the checkpoint exists from now."""
    _put_bytes(listing.to_json(), join(url, COMMIT))


def uncommit(url: str) -> None:
    """Delete the commit object of `url` (this run's, about to be written again): from now
    the prefix is not a checkpoint, before any of its objects changes (`Uploader`)."""
    _delete(join(url, COMMIT))


def remove(listing: Commit) -> None:
    """Delete a committed checkpoint: the objects it lists, then its commit object."""
    for name in sorted(listing.objects):
        _delete(join(listing.url, name))
    _delete(join(listing.url, COMMIT))


def _delete(url: str) -> None:
    fs, path = store_path(url)
    try:
        retried(lambda: fs.rm_file(path))
    except Exception as exc:
        if not missing(exc):
            raise UploadFailed(f"{redact(url)}: cannot be deleted: {describe(exc)}") from None


# -- writing ------------------------------------------------------------------------------------


class Uploader(storage.ChecksumWriter):
    """DCP's checksummed file writer into a local staging directory, whose every rank then
    uploads the files it wrote under `url` (its shards, and `extra`: files it wrote before
    DCP, relative names) and hands their listing to rank 0 in one more write result; rank 0's
    `finish` writes `.metadata`, uploads it and `meta.json` (after `seal` records the
    `.metadata` digest in it), then the commit object. Each file, once uploaded, leaves the
    staging directory: into `copy` (the node's copy of this checkpoint) or deleted, by the rank
    that wrote it, so that no node's disk fills with staging, whatever the node."""

    def __init__(
        self,
        staging: str,
        url: str,
        extra: list[str],
        concurrency: int,
        seal: Callable[[str], None],
        identity: tuple[int, str],
        copy: str | None,
        after: Callable[[], str | None],
    ) -> None:
        super().__init__(staging)
        self.staging, self.url, self.extra = staging, url, extra
        self.concurrency, self.seal, self.identity = concurrency, seal, identity
        self.copy, self.after = copy, after
        self.warning: str | None = None  # what `after` (keep's deletes) could not do

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """Rank 0, before any rank writes: a save of a step again (after falling back from
        its damaged checkpoint) first makes it no checkpoint while its objects change; a
        commit object it cannot read is kept aside, another run's is never written over."""
        commit_url = join(self.url, COMMIT)
        data = _read_bytes(commit_url)
        if data is not None:
            try:
                owner = Commit.parse(self.url, data).run_id
            except CheckpointError:
                owner = None
                _put_bytes(data, f"{commit_url}.unreadable-{uuid.uuid4().hex[:8]}")
            if owner not in (None, self.identity[1]):
                raise UploadFailed(
                    f"{redact(self.url)} is a checkpoint of another run ({owner}): hp writes "
                    "over no other run's checkpoint; give each run its own checkpoint.dir"
                )
            uncommit(self.url)
        return super().prepare_global_plan(plans)

    def _upload(self, name: str) -> tuple[int, str]:
        local = os.path.join(self.staging, name)
        listed = upload(local, join(self.url, name), self.concurrency)
        if self.copy is None:
            os.remove(local)
        else:
            os.makedirs(os.path.dirname(os.path.join(self.copy, name)), exist_ok=True)
            os.replace(local, os.path.join(self.copy, name))
        return listed

    def write_data(self, plan: Any, planner: Any) -> Any:
        results = list(super().write_data(plan, planner).wait())
        names = sorted({r.storage_data.relative_path for r in results}) + self.extra
        listing = {name: self._upload(name) for name in names}
        index = MetadataIndex(f"{_LISTING}.{uuid.uuid4().hex}")
        results.append(WriteResult(index=index, size_in_bytes=0, storage_data=listing))
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        objects: dict[str, tuple[int, str]] = {}
        kept = []
        for rank_results in results:
            for result in rank_results:
                if result.index.fqn.startswith(_LISTING):
                    objects.update(result.storage_data)
            kept.append([r for r in rank_results if not r.index.fqn.startswith(_LISTING)])
        super().finish(metadata, kept)
        self.seal(self.staging)
        for name in (".metadata", META):  # meta.json last: sealed with .metadata's digest
            objects[name] = self._upload(name)
        step, run_id = self.identity
        commit(self.url, Commit(self.url, step, run_id, objects))
        self.warning = self.after()  # keep's deletes, here in the background too


# -- reading ------------------------------------------------------------------------------------


def _whole(path: str, size: int, digest: str) -> bool:
    try:
        return os.path.getsize(path) == size and file_digest(path) == (size, digest)
    except FileNotFoundError:
        return False


def fetch(listing: Commit, name: str, directory: str) -> None:
    """Object `name` of a committed checkpoint at `directory/name`, unless a file of its
    listed size and digest is there; the download checked against the listing first."""
    size, digest = listing.objects[name]
    target = os.path.join(directory, name)
    if _whole(target, size, digest):
        return
    url = join(listing.url, name)
    part = f"{target}.part-{uuid.uuid4().hex}"
    fs, path = store_path(url)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            retried(lambda: fs.get_file(path, part))
        except Exception as exc:
            if missing(exc):  # damage: an older checkpoint may do
                raise CheckpointError(f"{redact(url)}: missing") from None
            reason = f"{redact(url)}: cannot be read: {describe(exc)}"
            raise CheckpointError(reason, False) from None
        if not _whole(part, size, digest):
            raise CheckpointError(
                f"{redact(url)}: not the bytes its commit object lists ({size} bytes, xxh3 "
                f"{digest})"
            )
        os.replace(part, target)
    except OSError as exc:  # this node's disk, not the checkpoint: no falling back for it
        raise CheckpointError(
            f"{redact(url)}: cannot be copied to {directory}: {exc.strerror or exc}", False
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(part)


def _is_shard(name: str) -> bool:
    return name.endswith(".distcp")


def committed_listing(url: str) -> Commit:
    """The commit object of `url`, which must have one."""
    listing = read_commit(url)
    if listing is None:
        raise CheckpointError(
            f"{redact(url)}: no {COMMIT} (a save that did not finish): not a checkpoint"
        )
    return listing


def mirror(listing: Commit, directory: str, rank: int | None = None) -> None:
    """The committed checkpoint `listing` names, in `directory` (on this node's disk): its
    `meta.json` and DCP's `.metadata`, and `rank`'s random states, each checked; its shards
    are fetched by `fetcher` as they are read. Every rank of a node may call it at once."""
    own = None if rank is None else f"extra/rank-{rank:05d}.json"
    for name in sorted(listing.objects):
        if not _is_shard(name) and (not name.startswith("extra/") or name == own):
            fetch(listing, name, directory)
    _drop_unlisted(listing, directory)


def _drop_unlisted(listing: Commit, directory: str) -> None:
    """Files in a mirror (hp's own directory) that this checkpoint does not list: another
    checkpoint's of the same name, never to be read as this one's (downloads under way,
    `.part-*`, are another rank's)."""
    for parent, _, files in os.walk(directory):
        for file in files:
            name = os.path.relpath(os.path.join(parent, file), directory).replace(os.sep, "/")
            if name not in listing.objects and ".part-" not in file:
                with contextlib.suppress(OSError):  # what stays is never read as listed
                    os.remove(os.path.join(parent, file))


def fetcher(listing: Commit, directory: str) -> Callable[[set[str]], None]:
    """What the reader calls with the shard files a rank's reads need."""

    def fetch_all(names: set[str]) -> None:
        for name in sorted(names):
            if name not in listing.objects:
                raise CheckpointError(f"{redact(listing.url)}: {name} is not in its {COMMIT}")
            fetch(listing, name, directory)

    return fetch_all


def opened(path: str, directory: str | None = None) -> tuple[str, Commit | None]:
    """`path` as the readers take it: a local checkpoint as it is; a remote one's mirror in
    `directory` (by default the shared cache's `checkpoints/KEY`), its small files fetched,
    with the listing its shards are fetched by (`fetcher`)."""
    if not is_remote(path):
        return path, None
    if directory is None:
        key = xxhash.xxh3_64_hexdigest(canonical_url(path).encode())
        directory = os.path.join(resolve_cache_dir(None), "checkpoints", key)
    listing = committed_listing(path)
    mirror(listing, directory)
    return directory, listing
