"""FSDP2 (`fully_shard`) per block and at the root; HSDP when the mesh has two dp dims."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def mixed_precision(device_type: str) -> MixedPrecisionPolicy:
    """bf16 parameters with fp32 gradient reduction on GPU; fp32 throughout on CPU."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    device_type: str,
    reshard_after_forward: bool = True,
) -> None:
    """Shard each block, then the root (embedding, norm, head), over `mesh` (1-D: FSDP;
    2-D (replicate, shard): HSDP)."""
    policy = mixed_precision(device_type)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
