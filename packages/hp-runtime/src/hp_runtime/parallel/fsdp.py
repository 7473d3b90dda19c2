"""FSDP2 (`fully_shard`) per block and at the root; HSDP when the mesh has two dp dims."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hp_runtime.model.moe import Experts


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
    expert_mesh: DeviceMesh | None = None,
    divide_factor: int = 1,
) -> None:
    """Shard each block, then the root (embedding, norm, head), over `mesh` (1-D: FSDP;
    2-D (replicate, shard): HSDP; the shard dim is dp_shard x cp under context parallelism,
    see `mesh.fsdp_mesh`).

    Under expert parallelism the experts of each MoE layer are a unit of their own over
    `expert_mesh` (`mesh.expert_fsdp_mesh`: the data-parallel ranks an ep group leaves), their
    gradients divided by `divide_factor`, all the data-parallel ranks, as the dense ones are:
    each expert's gradient already sums the tokens of its whole ep group."""
    policy = mixed_precision(device_type, param_dtype)
    for block in model.layers.values():
        if expert_mesh is not None:
            for experts in (m for m in block.modules() if isinstance(m, Experts)):
                unit = fully_shard(
                    experts,
                    mesh=expert_mesh,
                    mp_policy=policy,
                    reshard_after_forward=reshard_after_forward,
                )
                divide_expert_gradients(unit, divide_factor, expert_mesh)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def divide_expert_gradients(unit: FSDPModule, factor: int, mesh: DeviceMesh) -> None:
    """Average `unit`'s gradients over `factor` ranks rather than over its own `mesh`'s (also
    when that mesh is one rank: FSDP divides then too). NCCL divides within the reduction (a
    pre-multiplied sum); gloo has none, so on CPU a reduce-scatter over more than one rank
    sums and divides after. Not on one rank: there FSDP would then divide twice (torch 2.15)."""
    unit.set_gradient_divide_factor(float(factor))
    if mesh.device_type == "cpu" and mesh.size(-1) > 1:
        unit.set_force_sum_reduction_for_comms(True)
