"""Checkpoints that resume exactly, on any layout: DCP for the tensors, an atomic commit.

A checkpoint of step N is written into its staging directory in `RUN_DIR/checkpoints/` (hidden:
`hp_data.fs.staging_name`) by every rank
(DCP shards of the model and optimizer, keyed by parameter names, so any layout can load them;
each rank's RNG states in `extra/`; `meta.json` from rank 0 with the step, `consumed_samples`,
the run's id, the resolved config and the data's identity, stored as "fingerprint") and
committed by one rename to `step-000000N` once every rank's writes are done. A directory that
was never renamed is never loaded and is removed at the next start; older checkpoints of the
same run beyond `checkpoint.keep` are deleted only after a newer one is committed. Every file
carries a checksum taken while it was written and checked while it is read (`storage.py`);
nothing in a checkpoint is unpickled beyond plain data.

A run directory holds one run. `checkpoint.resume = "auto"` continues it; `"none"` starts
fresh only where no checkpoint is yet; an explicit path seeds a run directory that has no
checkpoints of its own (once it has, the same command continues from them: "run the same
command to resume" stays true).

With `checkpoint.async` the tensors are copied to host memory and written by a background
thread (`dcp.async_save`, over a gloo group of its own so its collectives never interleave with
training's); the commit happens at the first step boundary after the write finished.

This module is the saving side, and the choice of what to resume (`Checkpointer.candidates`).
What a checkpoint is as read (its names, `meta.json`) is `checkpoint_format.py`; whether this
run may resume one, `compat.py`; loading it, `checkpoint_load.py`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from hp_data.fs import first_line, fsync_path, is_staging, staging_name
from hp_data.redact import redact
from hp_data.remote import local_path
from torch.distributed.checkpoint.api import CheckpointException

from hp_runtime.train import checkpoint_remote as remote
from hp_runtime.train import rng, storage
from hp_runtime.train.checkpoint_format import (
    CHECKPOINTS,
    META,
    METADATA_KEY,
    CheckpointError,
    committed,
    read_meta,
    step_name,
    tensors,
)
from hp_runtime.train.config import CheckpointConfig
from hp_runtime.train.errors import TrainError
from hp_runtime.train.launch import Runtime, agree
from hp_runtime.train.state import TrainState


class SaveFailed(TrainError):
    """A save that could not be written."""

    def __init__(self, message: str, everywhere: bool) -> None:
        super().__init__(message)
        self.everywhere = everywhere  # DCP's failures reach every rank; a rank's own file not


def seal(tmp: str) -> None:
    """Record the checksum of DCP's `.metadata` (written last, by DCP) in `meta.json`, so that
    every file of the checkpoint is covered before it is committed."""
    file = os.path.join(tmp, META)
    meta = storage.read_json(file)
    meta[METADATA_KEY] = storage.file_digest(os.path.join(tmp, ".metadata"))
    storage.write_json(file, meta)


@dataclass
class Pending:
    """A save between its start and its commit."""

    step: int
    future: Future | None  # a background save's (None: written already)
    staging: str
    started: float
    nbytes: int
    blocked: float = 0.0  # seconds the step boundary waited for it
    writer: Any = None  # a URL dir's `Uploader`: what its background prune could not do


@dataclass(frozen=True)
class Saved:
    """A committed checkpoint, for the log."""

    step: int
    path: str
    seconds: float
    background: bool
    blocked: float  # of `seconds`, those the step boundary waited (async: the staging)
    warning: str | None = None  # older checkpoints that could not be deleted (kept)


def _nbytes(payload: dict[str, dict[str, Any]]) -> int:
    """This rank's bytes in `payload` (a DTensor counts its local shard)."""
    total = 0
    for part in payload.values():
        for value in part.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            if isinstance(local, torch.Tensor):
                total += local.numel() * local.element_size()
    return total


def _no_space(exc: BaseException) -> bool:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        for inner in (getattr(current, "failures", None) or {}).values():
            todo.append(inner[0] if isinstance(inner, tuple) else inner)
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return "No space left on device" in str(exc)


class Checkpointer:
    """Saves and finds this run's checkpoints (every rank holds one; rank 0 commits)."""

    def __init__(
        self, run_dir: str, config: CheckpointConfig, runtime: Runtime, identity: str = ""
    ) -> None:
        # Staging (and, with a URL dir, the mirrors read from) on a disk; the checkpoints in
        # `root`: RUN_DIR/checkpoints, another directory, or a URL (`checkpoint_remote`).
        self.root = local_path(config.dir) if config.dir else os.path.join(run_dir, CHECKPOINTS)
        self.remote = remote.is_remote(self.root)
        self.local = os.path.join(run_dir, CHECKPOINTS) if self.remote else self.root
        self.listings: dict[str, remote.Commit] = {}  # a URL dir's committed, as last listed
        self.config, self.runtime = config, runtime
        self.pending: Pending | None = None
        self.last_save_seconds = 0.0
        # The run's id, in every checkpoint it writes: `keep` prunes only these. A fresh or a
        # seeded run's is a hash of where it runs and its resolved config (`identity`), so the
        # same run started twice writes the same bytes; a resumed run keeps the one it had.
        where = os.path.abspath(run_dir) + "\0" + identity
        self.run_id = xxhash.xxh3_64_hexdigest(where.encode())
        self.done: list[Saved] = []  # committed, not yet logged
        self.failure: SaveFailed | None = None  # a background save's, until `finish`
        # A group of its own for the background writes (created by every rank, in order).
        self.group = dist.new_group(backend="gloo") if config.async_save else None

    def clean(self) -> None:
        """Remove what a killed run left uncommitted, and copies of remote checkpoints but
        the node's newest (`checkpoint.local_copy`), before anyone saves (each node's first
        rank: a run directory on a node's own disk is cleaned too)."""
        if self.runtime.local_rank == 0 and os.path.isdir(self.local):  # each node's disk
            for name in os.listdir(self.local):
                mirror = name.startswith(remote.MIRROR) and not self.config.local_copy
                if is_staging(name) or mirror:
                    shutil.rmtree(os.path.join(self.local, name), ignore_errors=True)
        dist.barrier()

    def adopt(self, meta: dict[str, Any]) -> None:
        """Continue the run that wrote `meta` (a checkpoint of this run directory)."""
        if meta.get("run_id"):
            self.run_id = meta["run_id"]

    def save(self, state: TrainState, meta: dict[str, Any], block: bool = False) -> None:
        """Checkpoint `state`; asynchronous when configured unless `block`. What is committed
        (now, or by a later `poll`) is handed out by `take`. Every rank calls it."""
        self.finish()  # one save in flight at a time
        start = time.perf_counter()
        tmp = os.path.join(self.local, staging_name(step_name(state.step)))
        payload = tensors(state)
        nbytes = _nbytes(payload)
        failure: BaseException | None = None
        try:
            os.makedirs(os.path.join(tmp, "extra"), exist_ok=True)
            storage.write_json(
                os.path.join(tmp, "extra", f"rank-{self.runtime.rank:05d}.json"),
                rng.capture(self.runtime.device),
            )
            if self.runtime.is_main:
                storage.write_json(
                    os.path.join(tmp, META),
                    {
                        **meta,
                        **state.scalars(),
                        "world_size": self.runtime.world_size,
                        "run_id": self.run_id,
                    },
                )
        except OSError as exc:
            failure = exc
        try:
            agree(self._failed(failure, tmp, nbytes) if failure else None, self.runtime)
        except TrainError:
            self._remove(tmp)
            raise
        writer = self._writer(tmp, state.step)
        if self.config.async_save and not block:
            future = dcp.async_save(payload, storage_writer=writer, process_group=self.group)
            self.last_save_seconds = time.perf_counter() - start
            blocked = self.last_save_seconds
            self.pending = Pending(state.step, future, tmp, start, nbytes, blocked, writer)
            return
        try:
            dcp.save(payload, storage_writer=writer)
        except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
            self._remove(tmp)
            raise self._failed(exc, tmp, nbytes) from None
        failure = None
        try:
            self._commit(Pending(state.step, None, tmp, start, nbytes, 0, writer), False)
        except SaveFailed as exc:  # rank 0's rename or seal
            failure = exc
        agree(failure, self.runtime)

    def _writer(self, tmp: str, step: int) -> storage.ChecksumWriter:
        """DCP's writer: into `tmp`, and with a URL dir uploaded from there and committed."""
        if not self.remote:
            return storage.ChecksumWriter(tmp)
        url = remote.join(self.root, step_name(step))
        copy = None
        if self.config.local_copy:  # the node's copy of the newest: the one before it goes
            copy = self.mirror_dir(url)
            self._drop_mirrors(but=os.path.basename(copy))
        return remote.Uploader(
            tmp,
            url,
            [f"extra/rank-{self.runtime.rank:05d}.json"],
            self.config.upload_concurrency,
            seal,
            (step, self.run_id),
            copy,
            self._prune,
        )

    def _drop_mirrors(self, but: str = "") -> None:
        """This node's copies of remote checkpoints, but `but` (each node's first rank)."""
        if self.runtime.local_rank == 0 and os.path.isdir(self.local):
            for name in os.listdir(self.local):
                if name.startswith(remote.MIRROR) and name != but:
                    shutil.rmtree(os.path.join(self.local, name), ignore_errors=True)

    def take(self) -> list[Saved]:
        """The checkpoints committed since the last call, for the log."""
        done, self.done = self.done, []
        return done

    def save_failed(self) -> bool:
        """Whether the background save has failed on this rank (no collective: the loop's
        stop flag carries it to every rank, which then meet in `finish`)."""
        pending = self.pending
        failed = bool(pending and pending.future.done() and pending.future.exception())
        return failed or self.failure is not None

    def poll(self) -> None:
        """Commit a finished background save (call at step boundaries). Rank 0's write
        finishing means all ranks' did: DCP gathers every rank's result before writing its
        metadata. A failure is kept for `finish`, which every rank reaches together."""
        if self.pending is None or not self.pending.future.done() or self.save_failed():
            return
        try:
            self._wait()
        except SaveFailed as exc:
            self.failure = exc

    def finish(self) -> None:
        """Every rank together: the save in flight finished and committed, or its failure
        raised (by the lowest rank that saw it; the others stop quietly)."""
        failure = None
        try:
            self._wait()
        except SaveFailed as exc:
            failure = exc
        failure, self.failure = failure or self.failure, None
        agree(failure, self.runtime)

    def _wait(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            pending.future.result()  # type: ignore[union-attr]
        except (Exception, CheckpointException) as exc:
            self._remove(pending.staging)
            raise self._failed(exc, pending.staging, pending.nbytes) from None
        self._commit(pending, background=True)

    def _failed(
        self, exc: BaseException, tmp: str, nbytes: int, everywhere: bool = True
    ) -> SaveFailed:
        step = tmp.rsplit("-", 1)[-1].lstrip("0") or "0"
        need = nbytes * self.runtime.world_size
        free = shutil.disk_usage(self.local if os.path.isdir(self.local) else "/").free
        # torch's zip writer reports a failed write as "unexpected pos", without the errno
        hidden = "unexpected pos" in str(exc) or "unexpected pos" in first_line(exc, named=True)
        if _no_space(exc) or (hidden and free < need):
            reason = (
                f"no space left on the device holding {self.local} (the checkpoint needs "
                f"~{need / 1e9:.2g} GB, {free / 1e9:.2g} GB are free)"
            )
        else:
            reason = redact(first_line(exc, named=True))
        left = "the partial checkpoint was removed"
        if self.remote:
            url = redact(remote.join(self.root, step_name(int(step))))
            left = f"what reached {url} has no {remote.COMMIT} and is never loaded"
        return SaveFailed(
            f"checkpoint of step {step} not written: {reason}; {left}, and the previous "
            f"checkpoints are kept: free space or fix it, then run the same command to resume",
            everywhere,
        )

    def _remove(self, tmp: str) -> None:
        """A save that failed leaves nothing (rank 0 removes its directory, hp's own; with a
        URL dir each node's first rank, whose node staged its part)."""
        if self.runtime.is_main or (self.remote and self.runtime.local_rank == 0):
            shutil.rmtree(tmp, ignore_errors=True)

    def _commit(self, save: Pending, background: bool) -> None:
        step, tmp = save.step, save.staging
        final = self._join(step_name(step))
        warning = None
        if self.remote:  # committed, and older ones pruned, by the upload's finish
            if self.runtime.local_rank == 0:  # each node's staging, emptied by the upload
                shutil.rmtree(tmp, ignore_errors=True)
            warning = save.writer.warning if self.runtime.is_main else None
        elif self.runtime.is_main:
            try:
                seal(tmp)
                if os.path.exists(final):  # the same step again, after falling back from it
                    os.rename(final, self._aside(final))
                os.rename(tmp, final)
                fsync_path(self.root)
            except OSError as exc:
                self._remove(tmp)
                raise self._failed(exc, tmp, save.nbytes, everywhere=False) from None
            warning = self._prune()
        seconds = time.perf_counter() - save.started
        blocked = save.blocked if background else seconds
        self.last_save_seconds = blocked
        self.done.append(Saved(step, final, seconds, background, blocked, warning))

    def mirror_dir(self, url: str) -> str:
        """Where the remote checkpoint `url` is read from on this node's disk."""
        return os.path.join(self.local, remote.MIRROR + url.rstrip("/").rsplit("/", 1)[-1])

    def open(self, path: str) -> tuple[str, remote.Commit | None]:
        """`path` as the readers take it: a directory on this node's disk, and for a remote
        checkpoint its mirror there (its small files fetched) with the listing its shards
        are fetched by."""
        if not remote.is_remote(path):
            return path, None
        listing = self._from_main(lambda: remote.committed_listing(path))
        directory, failure = self.mirror_dir(path), None
        if self.runtime.local_rank == 0:  # each node's first rank fetches; the others find it
            try:
                remote.mirror(listing, directory)
            except TrainError as exc:
                failure = exc
            except Exception as exc:  # never a rank left waiting in the barrier below
                failure = CheckpointError(f"{directory}: {first_line(exc, named=True)}", False)
        dist.barrier()
        if failure is not None:
            raise failure
        remote.mirror(listing, directory, self.runtime.rank)  # checked, and its own RNG file
        return directory, listing

    def _from_main(self, ask: Callable[[], Any]) -> Any:
        """`ask()` of the store by rank 0 alone, its answer handed to every rank (a thousand
        ranks do not each ask); a `CheckpointError` of rank 0's is raised on every rank."""
        if self.runtime.world_size == 1:
            return ask()
        box: list[Any] = [None, None]
        if self.runtime.is_main:
            try:
                box[0] = ask()
            except CheckpointError as exc:
                box[1] = (str(exc), exc.fallback)
            except Exception as exc:  # never a rank left waiting in the broadcast below
                box[1] = (f"{redact(self.root)}: {redact(first_line(exc, named=True))}", False)
        dist.broadcast_object_list(box, src=0)
        if box[1] is not None:
            raise CheckpointError(*box[1])
        return box[0]

    def close(self, path: str) -> None:
        """After every rank loaded `path`: its mirror goes, unless it is the node's copy of
        this run's newest (`checkpoint.local_copy`)."""
        ours = self.config.local_copy and self._inside(path)
        if remote.is_remote(path) and self.runtime.local_rank == 0 and not ours:
            shutil.rmtree(self.mirror_dir(path), ignore_errors=True)

    @staticmethod
    def _aside(final: str) -> str:
        """Where a checkpoint replaced by a new save of its step is kept: never deleted (it
        may be damaged, or not this run's), never loaded (not a `step-N` name)."""
        number = 1
        while os.path.exists(f"{final}.replaced-{number}"):
            number += 1
        return f"{final}.replaced-{number}"

    # -- the checkpoints of `root` -------------------------------------------------------------

    def _join(self, name: str) -> str:
        return remote.join(self.root, name) if self.remote else os.path.join(self.root, name)

    def _shared(self, say: Callable[[str], None]) -> list[str]:
        """`_committed`, of a URL dir listed by rank 0 alone for every rank."""
        if not self.remote:
            return self._committed(say)
        self.listings = self._from_main(lambda: (self._committed(say), self.listings)[1])
        return list(self.listings)

    def _committed(self, say: Callable[[str], None] = lambda _: None) -> list[str]:
        """The committed checkpoints of `root`, oldest first. A URL dir's are those with a
        commit object (each listing kept); a prefix without one is named and skipped."""
        if not self.remote:
            return committed(self.root)
        self.listings = {}
        for url in remote.steps(self.root):
            try:
                listing = remote.read_commit(url)
            except CheckpointError as exc:
                if not exc.fallback:
                    raise
                say(f"hp-train: warning: {exc}: skipped")
                continue
            if listing is None:
                say(
                    f"hp-train: {redact(url)} has no {remote.COMMIT} (a save that did not "
                    f"finish): skipped, never loaded"
                )
            else:
                self.listings[url] = listing
        return list(self.listings)

    def _owner(self, path: str) -> str | None:
        """The run that wrote `path` (None: one written before run ids)."""
        if self.remote:
            return self.listings[path].run_id
        return read_meta(path).get("run_id")

    def _owned(self, path: str) -> bool:
        try:
            owner = self._owner(path)
        except CheckpointError:
            return False  # unreadable: not provably this run's, so never deleted
        # One written before run ids is this run's: `candidates` lets a directory hold one run.
        return owner == self.run_id or owner is None

    def _prune(self) -> str | None:
        """Delete this run's checkpoints older than the newest `keep`. A store that fails to
        list or delete leaves them (said, and tried again at the next save): the new
        checkpoint is committed either way."""
        if not self.config.keep:
            return None
        try:
            ours = [path for path in self._committed() if self._owned(path)]
            for old in ours[: -self.config.keep]:
                if self.remote:
                    remote.remove(self.listings[old])  # what it lists, and nothing else
                else:
                    shutil.rmtree(old, ignore_errors=True)
        except (OSError, CheckpointError) as exc:
            return f"older checkpoints not deleted ({redact(str(exc))}): kept until a later save"
        return None

    def _inside(self, path: str) -> bool:
        """Whether `path` names a checkpoint of `root` (a sibling of its own)."""
        if self.remote or remote.is_remote(path):
            return path.rstrip("/").rsplit("/", 1)[0] == self.root.rstrip("/")
        return os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.root)

    def _exists(self, path: str) -> bool:
        if remote.is_remote(path):
            return remote.read_commit(path) is not None
        return os.path.isdir(path)

    def candidates(self, say: Callable[[str], None]) -> list[str]:
        """What `checkpoint.resume` asks to load, newest first ([] for a fresh start)."""
        resume = self.config.resume
        own = self._shared(say)
        where = redact(self.root)
        if resume == "none":
            if own:
                raise CheckpointError(
                    f"checkpoint.resume = 'none', but {where} already holds checkpoints "
                    f"(newest {_base(own[-1])}): a fresh run there would mix with "
                    f"them; continue it with checkpoint.resume = 'auto', or choose a new "
                    f"train.run_dir (nothing was changed)",
                    fallback=False,
                )
            return []
        if resume != "auto" and not own:  # an explicit path seeds an empty run directory
            if not self._exists(resume):
                raise CheckpointError(
                    f"checkpoint.resume = {redact(resume)!r}: no such checkpoint "
                    f"{'(no ' + remote.COMMIT + ')' if remote.is_remote(resume) else 'directory'}",
                    fallback=False,
                )
            return [resume]
        if resume != "auto":
            inside = self._inside(resume)
            if inside and _base(resume) != _base(own[-1]):
                raise CheckpointError(
                    f"checkpoint.resume = {redact(resume)!r} is an older checkpoint of this "
                    f"run directory, which goes on to {_base(own[-1])}: going back in "
                    f"place would overwrite the newer ones; seed a new train.run_dir with it, "
                    f"or use checkpoint.resume = 'auto'",
                    fallback=False,
                )
            if not inside:
                say(
                    f"hp-train: checkpoint.resume = {redact(resume)!r} seeds a run directory "
                    f"only while it has no checkpoints; {where} has its own: continuing from them"
                )
        owners: dict[str, str] = {}
        for path in own:
            with contextlib.suppress(CheckpointError):  # damage: met again when loaded
                owner = self._owner(path)
                if owner is not None:  # one written before run ids joins the run resuming it
                    owners.setdefault(owner, path)
        if len(owners) > 1:
            runs = ", ".join(f"{_base(p)} (run {r})" for r, p in owners.items())
            raise CheckpointError(
                f"{where} holds checkpoints of {len(owners)} runs ({runs}): move the other "
                f"run's aside, or name one with checkpoint.resume in a new train.run_dir",
                fallback=False,
            )
        return list(reversed(own))

    def seeds(self, path: str) -> bool:
        """Whether loading `path` seeds this run directory rather than continuing it."""
        return not self._inside(path)


def _base(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
