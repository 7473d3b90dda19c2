"""The order the parallel dimensions are applied in, in one place: TP, AC, compile, FSDP
(pipeline stages are cut before, in `pp.py`, and each stage goes through here)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_runtime.parallel.ac import apply_ac
from hp_runtime.parallel.compile import apply_compile
from hp_runtime.parallel.fsdp import apply_fsdp
from hp_runtime.parallel.mesh import ParallelDims
from hp_runtime.parallel.tp import apply_tp


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device_type: str = "cpu",
    loss_parallel: bool = False,
    activation_checkpointing: str | None = None,
    ac_every: int = 2,
    compile_blocks: bool = False,
    tp_reduce_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Apply tensor parallel, then activation checkpointing, then per-block torch.compile, then
    FSDP/HSDP, to a model (or a pipeline stage) still on the meta device. `param_dtype` is
    FSDP's compute dtype (default: bf16 on GPU, fp32 on CPU)."""
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], loss_parallel, tp_reduce_dtype)
    if activation_checkpointing is not None:
        apply_ac(model, activation_checkpointing, ac_every)
    if compile_blocks:
        apply_compile(model)
    if dims.dp_shard > 1 or dims.dp_replicate > 1:
        hsdp = dims.dp_replicate > 1
        dp_mesh = mesh["dp_replicate", "dp_shard"] if hsdp else mesh["dp_shard"]
        apply_fsdp(model, dp_mesh, device_type, param_dtype=param_dtype)
    return model
