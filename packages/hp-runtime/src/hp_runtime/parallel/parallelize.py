"""The order the parallel dimensions are applied in, in one place: float8, TP, EP, CP, AC,
compile, FSDP (pipeline stages are cut before, in `pp.py`, and each stage goes through here);
and the parameter names as they were before these wrappers."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_runtime.parallel.ac import AC_NAME_PREFIX, apply_ac
from hp_runtime.parallel.compile import COMPILE_NAME_PREFIX, apply_compile
from hp_runtime.parallel.cp import ContextParallel, apply_cp
from hp_runtime.parallel.ep import apply_ep
from hp_runtime.parallel.float8 import apply_float8
from hp_runtime.parallel.fsdp import apply_fsdp
from hp_runtime.parallel.mesh import ParallelDims, expert_fsdp_mesh, fsdp_mesh
from hp_runtime.parallel.options import Float8, ParallelOptions
from hp_runtime.parallel.tp import apply_tp


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    options: ParallelOptions | None = None,
    *,
    param_dtype: torch.dtype | None = None,
    expert_mesh: DeviceMesh | None = None,
    float8: Float8 | None = None,
    device_type: str = "cpu",
) -> nn.Module:
    """Convert the linears to float8 (`float8`), then apply tensor parallel, then expert
    parallel, then context parallel, then activation checkpointing, then per-block
    torch.compile, then FSDP/HSDP (over dp_shard x cp), to a model (or a pipeline stage) still
    on the meta device. `mesh` is None for one process without a process group.
    `param_dtype` is FSDP's compute dtype (default: bf16 on GPU, fp32 on CPU). `expert_mesh`
    (`ParallelDims.build_expert_mesh`) is required when `dims.ep > 1`."""
    options = options or ParallelOptions()
    if float8 is not None:
        apply_float8(model, float8, device_type, dims.tp)
    if dims.tp > 1:
        assert mesh is not None
        reduce_dtype = getattr(torch, options.tp_reduce_dtype) if options.tp_reduce_dtype else None
        # torchao's float8 styles move float8 tensors, which gloo cannot carry, and do not
        # round scales to powers of two: there the converted linears cast after torch's
        # styles gather (`tp.py`).
        tensorwise = (
            float8 is not None
            and float8.recipe == "tensorwise"
            and not float8.round_scales_to_power_of_2
            and device_type == "cuda"
        )
        apply_tp(model, mesh["tp"], options.loss_parallel, reduce_dtype, tensorwise)
    if dims.ep > 1:
        if expert_mesh is None:
            raise ValueError(f"ep={dims.ep} needs the expert mesh (ParallelDims.build_expert_mesh)")
        apply_ep(model, expert_mesh["ep"])
    if dims.cp > 1:
        apply_cp(model, ContextParallel(mesh["cp"]))
    if options.activation_checkpointing != "none":
        apply_ac(model, options.activation_checkpointing, options.ac_every)
    if options.compile:
        apply_compile(model)
    if dims.dp_cp_size > 1:
        assert mesh is not None
        reshard = options.fsdp_reshard_after_forward == "always"
        experts = expert_fsdp_mesh(expert_mesh, dims) if dims.ep > 1 else None  # type: ignore[arg-type]
        apply_fsdp(
            model,
            fsdp_mesh(mesh, dims),
            mesh.device_type,
            reshard,
            param_dtype,
            expert_mesh=experts,
            divide_factor=dims.dp_cp_size,
        )
    return model


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model, without the activation-checkpoint or compile
    wrappers `parallelize` adds, so seeds and comparisons see the same names in every
    layout (FSDP and TP keep the names)."""
    for prefix in (AC_NAME_PREFIX, COMPILE_NAME_PREFIX):
        name = name.replace(prefix, "")
    return name
