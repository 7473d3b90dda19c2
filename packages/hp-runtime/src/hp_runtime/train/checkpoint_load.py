"""Loading a checkpoint into a run's state, on any layout: DCP's metadata checked against
its checksum, every shard file's size and every tensor's name and shape checked before
anything is read, then the tensors and (on the world size that saved them) each rank's
random states applied.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp
from hp_data.fs import first_line
from hp_data.redact import redact
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hp_runtime.model import ModelConfig
from hp_runtime.train import rng, storage
from hp_runtime.train.checkpoint_format import (
    METADATA_KEY,
    OPTIONS,
    CheckpointError,
    plain,
    tensors,
)
from hp_runtime.train.checkpoint_remote import Commit, fetcher
from hp_runtime.train.compat import check_tensors
from hp_runtime.train.launch import Runtime
from hp_runtime.train.state import TrainState


def _apply(state: TrainState, loaded: dict[str, dict[str, Any]]) -> None:
    for module, opt in zip(state.modules, state.optimizer.optimizers, strict=True):
        own_model = get_model_state_dict(module, options=OPTIONS)
        set_model_state_dict(module, {k: loaded["model"][k] for k in own_model}, options=OPTIONS)
        own_optim = get_optimizer_state_dict(module, opt, options=OPTIONS)
        set_optimizer_state_dict(
            module, opt, {k: loaded["optim"][k] for k in own_optim}, options=OPTIONS
        )


def _metadata(path: str, meta: dict[str, Any]) -> Any:
    """DCP's metadata of `path`, its checksum checked against `meta` first (when recorded)."""
    try:
        if METADATA_KEY in meta:
            found = storage.file_digest(os.path.join(path, ".metadata"))
            if found != meta[METADATA_KEY]:
                raise CheckpointError(f"{path}/.metadata: fails its checksum")
        return storage.CheckedReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{path}/.metadata: missing") from None
    except storage.Damaged as exc:
        raise CheckpointError(str(exc)) from None
    except OSError as exc:
        raise CheckpointError(f"{path}/.metadata: unreadable ({exc.strerror})") from None


def check_files(path: str, metadata: Any, listing: Commit | None = None) -> None:
    """Name a data file that is missing or shorter than `metadata` (DCP's, of `path`) says (a
    checkpoint cut by a crash or a full disk), before DCP fails somewhere inside it. For a
    mirror of a remote checkpoint, its commit object's listing stands for the files (fetched
    as they are read, each checked against it)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if listing is not None:
            found = listing.objects.get(name, (None,))[0]
            file = redact(f"{listing.url}/{name}")
        else:
            found = os.path.getsize(file) if os.path.exists(file) else None
        if found is None:
            raise CheckpointError(f"{file}: missing")
        if found < size:
            raise CheckpointError(f"{file}: truncated ({found} of {size} bytes)")


def checked_metadata(path: str, meta: dict[str, Any], listing: Commit | None = None) -> Any:
    """DCP's metadata of a checkpoint, its checksum and its shard files' sizes checked."""
    metadata = _metadata(path, meta)
    check_files(path, metadata, listing)
    return metadata


def _read_rng(path: str, runtime: Runtime) -> dict[str, Any] | None:
    """This rank's saved random states (None when none were saved)."""
    base = os.path.join(path, "extra", f"rank-{runtime.rank:05d}")
    file = base + ".json" if os.path.exists(base + ".json") else base + ".pt"
    if not os.path.exists(file):
        return None
    try:
        if file.endswith(".json"):
            return storage.read_json(file)
        return rng.read_legacy(file)  # written before hp saved them as data
    except ValueError as exc:  # storage.Damaged, or a refused type
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # a cut or garbled file
        raise CheckpointError(f"{file}: unreadable ({type(exc).__name__})") from None


def _read_tensors(path: str, payload: dict[str, Any], listing: Commit | None) -> None:
    """DCP's load of `payload` from `path`, each file checked as it is read; a remote shard's
    failed fetch keeps its own verdict (and whether an older checkpoint may be tried)."""
    try:
        dcp.load(
            payload,
            storage_reader=storage.CheckedReader(path, listing and fetcher(listing, path)),
            planner=storage.SafeLoadPlanner(),
        )
    except (Exception, CheckpointException) as exc:  # DCP's wraps every rank's failure
        for failure in (getattr(exc, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                raise CheckpointError(str(inner), inner.fallback) from None
        raise CheckpointError(f"{path}: cannot be loaded: {first_line(exc, named=True)}") from None


def load(
    path: str,
    state: TrainState,
    runtime: Runtime,
    meta: dict[str, Any],
    config: ModelConfig,
    listing: Commit | None = None,
) -> None:
    """Load `path` into `state` (any layout), every file checked before anything is applied.
    RNG states come back when the world size is the one that saved them. `listing`: `path`
    mirrors the remote checkpoint it lists, whose shards are fetched as they are read."""
    metadata = checked_metadata(path, meta, listing)  # read once for every check
    check_tensors(path, metadata, config)
    states = _read_rng(path, runtime) if meta["world_size"] == runtime.world_size else None
    payload = tensors(state)
    _read_tensors(path, payload, listing)
    if states is not None:
        try:
            rng.restore(states, runtime.device)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"{path}/extra: random states malformed ({type(exc).__name__})"
            ) from None
    _apply(state, payload)
    state.load_scalars(meta)


def load_model(
    path: str,
    modules: list[Any],
    meta: dict[str, Any],
    config: ModelConfig,
    listing: Commit | None = None,
) -> None:
    """Only the model's tensors of `path` into `modules` (this rank's parts, any layout), its
    files checked as `load` checks them: what evaluation reads (no optimizer state is read)."""
    metadata = checked_metadata(path, meta, listing)
    check_tensors(path, metadata, config)
    own: dict[str, Any] = {}
    for module in modules:
        own.update(get_model_state_dict(module, options=OPTIONS))
    payload = {"model": {k: plain(v) for k, v in own.items()}}
    _read_tensors(path, payload, listing)
    for module in modules:
        mine = get_model_state_dict(module, options=OPTIONS)
        set_model_state_dict(module, {k: payload["model"][k] for k in mine}, options=OPTIONS)
