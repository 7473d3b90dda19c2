"""A checkpoint as its readers find it: the names of a run's checkpoint directories, the
`meta.json` rank 0 writes (checked field by field before anything trusts it), and the tensors'
keys, the same for the side that writes them (`checkpoint.py`) and the side that loads them
(`checkpoint_load.py`). A checkpoint that cannot be read, or that this run does not fit, is a
`CheckpointError`.
"""

from __future__ import annotations

import os
import tomllib
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from hp_runtime.train import storage
from hp_runtime.train.errors import TrainError
from hp_runtime.train.state import TrainState

CHECKPOINTS = "checkpoints"
PREFIX = "step-"
META = "meta.json"
METADATA_KEY = "dcp_metadata_xxh3"  # meta.json's checksum of DCP's .metadata
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
    return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))]


# meta.json's fields and their types: a file that parses but is not a checkpoint's is damage.
_META_FIELDS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "consumed_samples": int,
    "global_batch_size": int,
    "world_size": int,
    "config": str,
    "data": dict,
    "guard": dict,
}


def read_meta(path: str) -> dict[str, Any]:
    """A checkpoint's `meta.json`, checked field by field (damage is a fallback error)."""
    file = os.path.join(path, META)
    try:
        meta = storage.read_json(file, checked=False)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; {path} is not a hp-train checkpoint") from None
    except (OSError, storage.Damaged) as exc:
        reason = str(exc) if isinstance(exc, storage.Damaged) else f"{file}: {exc}"
        raise CheckpointError(reason) from None
    for key, kind in _META_FIELDS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{file}: field {key!r} is {value!r}, not a {kind.__name__}")
        if kind is int and value < (1 if key in ("global_batch_size", "world_size") else 0):
            raise CheckpointError(f"{file}: field {key!r} is {value}")
    data, guard = meta["data"], meta["guard"]
    if not (isinstance(data.get("config"), dict) and isinstance(data.get("fingerprint"), dict)):
        raise CheckpointError(f"{file}: field 'data' lacks its config or fingerprint")
    for key in ("losses", "norms"):
        values = guard.get(key)
        if not isinstance(values, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            raise CheckpointError(f"{file}: field 'guard.{key}' is not a list of numbers")
    if not isinstance(meta.get("run_id", ""), str):
        raise CheckpointError(f"{file}: field 'run_id' is not a string")
    mixture = meta.get("mixture", {})  # with data.phases: phases begun, per-stream counts
    if not (
        isinstance(mixture, dict)
        and isinstance(mixture.get("phases", []), list)
        and isinstance(mixture.get("streams", []), list)
        and all(isinstance(p, dict) for p in mixture.get("phases", []) + mixture.get("streams", []))
    ):
        raise CheckpointError(f"{file}: field 'mixture' is not the phases and streams of a run")
    try:
        saved = tomllib.loads(meta["config"])
    except tomllib.TOMLDecodeError as exc:
        raise CheckpointError(f"{file}: field 'config' is not the run's TOML ({exc})") from None
    if not isinstance(saved.get("model"), dict):
        raise CheckpointError(f"{file}: field 'config' has no [model] table")
    return meta


def tensors(state: TrainState) -> dict[str, dict[str, Any]]:
    """The model's and optimizer's tensors by parameter name (this rank's shards), merged over
    the model parts a pipeline rank holds; each a plain tensor (`plain`)."""
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for module, opt in zip(state.modules, state.optimizer.optimizers, strict=True):
        model.update(get_model_state_dict(module, options=OPTIONS))
        optim.update(get_optimizer_state_dict(module, opt, options=OPTIONS))
    return {
        "model": {k: plain(v) for k, v in model.items()},
        "optim": {k: plain(v) for k, v in optim.items()},
    }


def plain(value: Any) -> Any:
    """A tensor as a plain one (a DTensor of plain local shards) over the same memory.
    torchao's float8 wraps weights (and what is made like them, AdamW's moments) in tensor
    subclasses of its own; saved as they are, a checkpoint names their classes and loads only
    where torchao is imported and its classes are allowed, so that a float8 run could not
    resume without float8 nor be exported. Writing and loading through the wrapped data keeps
    checkpoints free of them."""
    if isinstance(value, DTensor):
        local = value.to_local()
        inner = _unwrapped(local)
        if inner is local:
            return value
        with torch.no_grad():
            return DTensor.from_local(
                inner, value.device_mesh, value.placements, run_check=False,
                shape=value.shape, stride=value.stride(),
            )  # fmt: skip
    return _unwrapped(value) if isinstance(value, torch.Tensor) else value


def _unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The data a wrapper subclass holds (its first flattened tensor, of its own shape)."""
    while type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(
        tensor, "__tensor_flatten__"
    ):
        inner = getattr(tensor, tensor.__tensor_flatten__()[0][0])
        if not isinstance(inner, torch.Tensor) or inner.shape != tensor.shape:
            break
        tensor = inner
    return tensor
