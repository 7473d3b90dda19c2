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
from torch.distributed.checkpoint.api import CheckpointException

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
    step: int
    future: Future
    staging: str
    started: float
    nbytes: int


@dataclass(frozen=True)
class Saved:
    """A committed checkpoint, for the log."""

    step: int
    path: str
    seconds: float
    background: bool


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
        self.root = os.path.join(run_dir, CHECKPOINTS)
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
        """Remove what a killed run left uncommitted (rank 0), before anyone saves."""
        if self.runtime.is_main and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if is_staging(name):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
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
        tmp = os.path.join(self.root, staging_name(step_name(state.step)))
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
        if self.config.async_save and not block:
            future = dcp.async_save(
                payload, storage_writer=storage.ChecksumWriter(tmp), process_group=self.group
            )
            self.pending = Pending(state.step, future, tmp, start, nbytes)
            self.last_save_seconds = time.perf_counter() - start
            return
        try:
            dcp.save(payload, storage_writer=storage.ChecksumWriter(tmp))
        except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
            self._remove(tmp)
            raise self._failed(exc, tmp, nbytes) from None
        self.last_save_seconds = time.perf_counter() - start
        failure = None
        try:
            self._commit(state.step, tmp, start, nbytes, background=False)
        except SaveFailed as exc:  # rank 0's rename or seal
            failure = exc
        agree(failure, self.runtime)

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
            pending.future.result()
        except (Exception, CheckpointException) as exc:
            self._remove(pending.staging)
            raise self._failed(exc, pending.staging, pending.nbytes) from None
        self._commit(pending.step, pending.staging, pending.started, pending.nbytes, True)

    def _failed(
        self, exc: BaseException, tmp: str, nbytes: int, everywhere: bool = True
    ) -> SaveFailed:
        step = tmp.rsplit("-", 1)[-1].lstrip("0") or "0"
        need = nbytes * self.runtime.world_size
        free = shutil.disk_usage(self.root if os.path.isdir(self.root) else "/").free
        # torch's zip writer reports a failed write as "unexpected pos", without the errno
        hidden = "unexpected pos" in str(exc) or "unexpected pos" in first_line(exc, named=True)
        if _no_space(exc) or (hidden and free < need):
            reason = (
                f"no space left on the device holding {self.root} (the checkpoint needs "
                f"~{need / 1e9:.2g} GB, {free / 1e9:.2g} GB are free)"
            )
        else:
            reason = first_line(exc, named=True)
        return SaveFailed(
            f"checkpoint of step {step} not written: {reason}; the partial checkpoint was "
            f"removed and the previous ones are kept: free space or fix it, then run the same "
            f"command to resume",
            everywhere,
        )

    def _remove(self, tmp: str) -> None:
        """A save that failed leaves nothing (rank 0 removes its directory, hp's own)."""
        if self.runtime.is_main:
            shutil.rmtree(tmp, ignore_errors=True)

    def _commit(self, step: int, tmp: str, started: float, nbytes: int, background: bool) -> None:
        final = os.path.join(self.root, step_name(step))
        if self.runtime.is_main:
            try:
                seal(tmp)
                if os.path.exists(final):  # the same step again, after falling back from it
                    os.rename(final, self._aside(final))
                os.rename(tmp, final)
                fsync_path(self.root)
            except OSError as exc:
                self._remove(tmp)
                raise self._failed(exc, tmp, nbytes, everywhere=False) from None
            self._prune()
        self.done.append(Saved(step, final, time.perf_counter() - started, background))

    @staticmethod
    def _aside(final: str) -> str:
        """Where a checkpoint replaced by a new save of its step is kept: never deleted (it
        may be damaged, or not this run's), never loaded (not a `step-N` name)."""
        number = 1
        while os.path.exists(f"{final}.replaced-{number}"):
            number += 1
        return f"{final}.replaced-{number}"

    def _owned(self, path: str) -> bool:
        try:
            owner = read_meta(path).get("run_id")
        except CheckpointError:
            return False  # unreadable: not provably this run's, so never deleted
        # One written before run ids is this run's: `candidates` lets a directory hold one run.
        return owner == self.run_id or owner is None

    def _prune(self) -> None:
        if not self.config.keep:
            return
        ours = [path for path in committed(self.root) if self._owned(path)]
        for old in ours[: -self.config.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def candidates(self, say: Callable[[str], None]) -> list[str]:
        """What `checkpoint.resume` asks to load, newest first ([] for a fresh start)."""
        resume = self.config.resume
        own = committed(self.root)
        if resume == "none":
            if own:
                raise CheckpointError(
                    f"checkpoint.resume = 'none', but {self.root} already holds checkpoints "
                    f"(newest {os.path.basename(own[-1])}): a fresh run there would mix with "
                    f"them; continue it with checkpoint.resume = 'auto', or choose a new "
                    f"train.run_dir (nothing was changed)",
                    fallback=False,
                )
            return []
        if resume != "auto" and not own:  # an explicit path seeds an empty run directory
            if not os.path.isdir(resume):
                raise CheckpointError(
                    f"checkpoint.resume = {resume!r}: no such checkpoint directory",
                    fallback=False,
                )
            return [resume]
        if resume != "auto":
            inside = os.path.dirname(os.path.abspath(resume)) == os.path.abspath(self.root)
            if inside and os.path.abspath(resume) != os.path.abspath(own[-1]):
                raise CheckpointError(
                    f"checkpoint.resume = {resume!r} is an older checkpoint of this run "
                    f"directory, which goes on to {os.path.basename(own[-1])}: going back in "
                    f"place would overwrite the newer ones; seed a new train.run_dir with it, "
                    f"or use checkpoint.resume = 'auto'",
                    fallback=False,
                )
            if not inside:
                say(
                    f"hp-train: checkpoint.resume = {resume!r} seeds a run directory only "
                    f"while it has no checkpoints; {self.root} has its own: continuing from them"
                )
        owners: dict[str, str] = {}
        for path in own:
            with contextlib.suppress(CheckpointError):  # damage: met again when loaded
                owner = read_meta(path).get("run_id")
                if owner is not None:  # one written before run ids joins the run resuming it
                    owners.setdefault(owner, path)
        if len(owners) > 1:
            runs = ", ".join(f"{os.path.basename(p)} (run {r})" for r, p in owners.items())
            raise CheckpointError(
                f"{self.root} holds checkpoints of {len(owners)} runs ({runs}): move the other "
                f"run's aside, or name one with checkpoint.resume in a new train.run_dir",
                fallback=False,
            )
        return list(reversed(own))

    def seeds(self, path: str) -> bool:
        """Whether loading `path` seeds this run directory rather than continuing it."""
        return os.path.dirname(os.path.abspath(path)) != os.path.abspath(self.root)
