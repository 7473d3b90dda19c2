"""Checkpoints that resume exactly, on any layout: DCP for the tensors, an atomic commit.

A checkpoint of step N is written into `RUN_DIR/checkpoints/.tmp-step-000000N` by every rank
(DCP shards of the model and optimizer, keyed by parameter names, so any layout can load them;
each rank's RNG states in `extra/`; `meta.json` from rank 0 with the step, `consumed_samples`,
the resolved config and the data fingerprint) and committed by one rename to `step-000000N`
once every rank's writes are done. A directory that was never renamed is never loaded and is
removed at the next start; older checkpoints beyond `checkpoint.keep` are deleted only after a
newer one is committed.

With `checkpoint.async` the tensors are copied to host memory and written by a background
thread (`dcp.async_save`, over a gloo group of its own so its collectives never interleave with
training's); the commit happens at the first step boundary after the write finished.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hp_runtime.train.config import CheckpointConfig, Config
from hp_runtime.train.data import same_data
from hp_runtime.train.launch import Runtime, TrainError
from hp_runtime.train.state import TrainState

CHECKPOINTS = "checkpoints"
PREFIX = "step-"
TMP = ".tmp-"
META = "meta.json"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(TrainError):
    """A checkpoint that cannot be read (`fallback`: an older one may do), or one this run
    does not fit (the user decides)."""

    def __init__(self, message: str, fallback: bool = True) -> None:
        super().__init__(message)
        self.fallback = fallback


def step_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def committed(root: str) -> list[str]:
    """Committed checkpoint directories under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(
        n for n in os.listdir(root) if n.startswith(PREFIX) and n[len(PREFIX) :].isdigit()
    )
    return [os.path.join(root, n) for n in names]


def read_meta(path: str) -> dict[str, Any]:
    meta = os.path.join(path, META)
    try:
        with open(meta, encoding="utf-8") as stream:
            return json.load(stream)
    except FileNotFoundError:
        raise CheckpointError(f"{meta}: missing; {path} is not a hp-train checkpoint") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{meta}: unreadable ({exc})") from None


def tensors(state: TrainState) -> dict[str, dict[str, Any]]:
    """The model's and optimizer's tensors by parameter name (this rank's shards), merged over
    the model parts a pipeline rank holds."""
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for module, opt in zip(state.modules, state.optimizer.optimizers, strict=True):
        model.update(get_model_state_dict(module, options=OPTIONS))
        optim.update(get_optimizer_state_dict(module, opt, options=OPTIONS))
    return {"model": model, "optim": optim}


def _apply(state: TrainState, loaded: dict[str, dict[str, Any]]) -> None:
    for module, opt in zip(state.modules, state.optimizer.optimizers, strict=True):
        own_model = get_model_state_dict(module, options=OPTIONS)
        set_model_state_dict(module, {k: loaded["model"][k] for k in own_model}, options=OPTIONS)
        own_optim = get_optimizer_state_dict(module, opt, options=OPTIONS)
        set_optimizer_state_dict(
            module, opt, {k: loaded["optim"][k] for k in own_optim}, options=OPTIONS
        )


def _rng_states(device: torch.device) -> dict[str, Any]:
    states = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _restore_rng(states: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def _metadata(path: str) -> Any:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"{path}/.metadata: unreadable ({first_line(exc)})") from None


def check_files(path: str, metadata: Any) -> None:
    """Name a data file that is missing or shorter than `metadata` (DCP's, of `path`) says (a
    checkpoint cut by a crash or a full disk), before DCP fails somewhere inside it."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: missing")
        if os.path.getsize(file) < size:
            raise CheckpointError(f"{file}: truncated ({os.path.getsize(file)} of {size} bytes)")


def check_shapes(path: str, metadata: Any, model: dict[str, Any]) -> None:
    """Name the first parameter whose shape differs from the checkpoint's (before DCP would
    fail with a less helpful message). A DTensor's shape is its global one."""
    saved = metadata.state_dict_metadata
    for name, value in model.items():
        key = f"model.{name}"
        if key not in saved:
            raise CheckpointError(
                f"{path}: has no parameter {name}: the model changed", fallback=False
            )
        want = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        have = tuple(getattr(saved[key], "size", ()))
        if want is not None and have != want:
            raise CheckpointError(
                f"{path}: parameter {name} has shape {list(have)} in the checkpoint but "
                f"{list(want)} in this model: the model changed",
                fallback=False,
            )


@dataclass
class Pending:
    step: int
    future: Future
    tmp: str


class Checkpointer:
    """Saves and finds this run's checkpoints (every rank holds one; rank 0 commits)."""

    def __init__(self, run_dir: str, config: CheckpointConfig, runtime: Runtime) -> None:
        self.root = os.path.join(run_dir, CHECKPOINTS)
        self.config, self.runtime = config, runtime
        self.pending: Pending | None = None
        self.last_save_seconds = 0.0
        # A group of its own for the background writes (created by every rank, in order).
        self.group = dist.new_group(backend="gloo") if config.async_save else None

    def clean(self) -> None:
        """Remove what a killed run left uncommitted (rank 0), before anyone saves."""
        if self.runtime.is_main and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(TMP):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        dist.barrier()

    def save(self, state: TrainState, meta: dict[str, Any], block: bool = False) -> str:
        """Checkpoint `state`; asynchronous when configured unless `block`. Returns the final
        path (committed now, or at a later `poll`)."""
        self.wait()  # one save in flight at a time
        start = time.perf_counter()
        final = os.path.join(self.root, step_name(state.step))
        tmp = os.path.join(self.root, TMP + step_name(state.step))
        extra = os.path.join(tmp, "extra")
        os.makedirs(extra, exist_ok=True)
        torch.save(
            _rng_states(self.runtime.device),
            os.path.join(extra, f"rank-{self.runtime.rank:05d}.pt"),
        )
        if self.runtime.is_main:
            with open(os.path.join(tmp, META), "w", encoding="utf-8") as stream:
                json.dump(
                    {**meta, **state.scalars(), "world_size": self.runtime.world_size},
                    stream,
                    indent=1,
                )
        payload = tensors(state)
        if self.config.async_save and not block:
            future = dcp.async_save(payload, checkpoint_id=tmp, process_group=self.group)
            self.pending = Pending(state.step, future, tmp)
        else:
            dcp.save(payload, checkpoint_id=tmp)
            self._commit(tmp, final)
        self.last_save_seconds = time.perf_counter() - start
        return final

    def poll(self) -> str | None:
        """Commit a finished background save (call at step boundaries); its path, if any.
        Rank 0's write finishing means all ranks' did: DCP gathers every rank's result
        before writing its metadata."""
        if self.pending is None or not self.pending.future.done():
            return None
        return self.wait()

    def wait(self) -> str | None:
        """Finish the save in flight, if any, and commit it."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        pending.future.result()  # raises what the background write raised
        final = os.path.join(self.root, step_name(pending.step))
        self._commit(pending.tmp, final)
        return final

    def _commit(self, tmp: str, final: str) -> None:
        if not self.runtime.is_main:
            return
        if os.path.exists(final):  # the same step saved again (a resumed run's last step)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.config.keep:
            for old in committed(self.root)[: -self.config.keep]:
                shutil.rmtree(old, ignore_errors=True)

    def candidates(self) -> list[str]:
        """What `checkpoint.resume` asks to load, newest first ([] for a fresh start)."""
        resume = self.config.resume
        if resume == "none":
            return []
        if resume == "auto":
            return list(reversed(committed(self.root)))
        if not os.path.isdir(resume):
            raise CheckpointError(f"checkpoint.resume = {resume!r}: no such checkpoint directory")
        return [resume]


def check_compatible(
    meta: dict[str, Any],
    path: str,
    config: Config,
    global_batch_size: int,
    fingerprint: dict[str, Any],
    warn: Callable[[str], None],
) -> None:
    """Refuse a resume that would not continue the same run: another global batch size, or
    other data (unless `checkpoint.allow_data_change`), naming what changed."""
    saved_gbs = meta["global_batch_size"]
    if saved_gbs != global_batch_size:
        raise CheckpointError(
            f"train.global_batch_size={global_batch_size}, but {path} was trained with "
            f"{saved_gbs}: keep it to resume (the data-parallel size may change)",
            fallback=False,
        )
    saved = meta["data"]
    changes = [
        f"data.{key} changed from {saved['config'][key]!r} to {getattr(config.data, key)!r}"
        for key in saved["config"]
        if saved["config"][key] != getattr(config.data, key)
    ]
    if not changes and not same_data(saved["fingerprint"], fingerprint):
        changes = ["the corpus files behind the data paths changed"]
    if not changes:
        return
    message = f"{'; '.join(changes)} since {path}"
    if not config.checkpoint.allow_data_change:
        raise CheckpointError(
            message + ": set checkpoint.allow_data_change = true to resume anyway",
            fallback=False,
        )
    warn(f"hp-train: warning: {message}; resuming anyway (checkpoint.allow_data_change)")


def load(path: str, state: TrainState, runtime: Runtime, meta: dict[str, Any]) -> None:
    """Load `path` into `state` (any layout). RNG states come back when the world size is the
    one that saved them."""
    payload = tensors(state)
    metadata = _metadata(path)  # read once for both checks
    check_shapes(path, metadata, payload["model"])
    check_files(path, metadata)
    try:
        dcp.load(payload, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # DCP's wraps every rank's failure
        raise CheckpointError(f"{path}: cannot be loaded: {first_line(exc)}") from None
    _apply(state, payload)
    state.load_scalars(meta)
    if meta.get("world_size") == runtime.world_size:
        extra = os.path.join(path, "extra", f"rank-{runtime.rank:05d}.pt")
        if os.path.exists(extra):
            _restore_rng(torch.load(extra, weights_only=False), runtime.device)


def first_line(exc: BaseException) -> str:
    """The cause in one line: DCP wraps each rank's exception with its traceback."""
    failures = getattr(exc, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
