"""FSDP2 (`fully_shard`) per block and at the root; HSDP when the mesh has two dp dims."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def mixed_precision(
    device_type: str, param_dtype: torch.dtype | None = None
) -> MixedPrecisionPolicy:
    """Parameters gathered in `param_dtype` for compute (default: bf16 on GPU, fp32 on CPU),
    gradients always reduced in fp32, fp32 shards kept for the optimizer."""
    if param_dtype is None:
        param_dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    if param_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    device_type: str,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
) -> None:
    """Shard each block, then the root (embedding, norm, head), over `mesh` (1-D: FSDP;
    2-D (replicate, shard): HSDP; the shard dim is dp_shard x cp under context parallelism,
    see `mesh.fsdp_mesh`)."""
    policy = mixed_precision(device_type, param_dtype)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
