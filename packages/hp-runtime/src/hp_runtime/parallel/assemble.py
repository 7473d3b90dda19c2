"""A rank's whole share of a parallel model, assembled in the one order that works.

The protocol is order-sensitive, so it lives here once: build on meta → cut pipeline stages →
parallelize each stage (float8 → TP → EP → CP → AC → compile → FSDP) → `to_empty` →
`init_weights` (which re-ties) → broadcast the tied embedding from the first stage to the
last → build the schedule. After backward, `Assembly.finish_gradients` sums the tied copies'
gradients and clips, counting the last stage's copy out of the norm; after the optimizer
step or a load, `Assembly.weights_changed` precomputes the float8 all-gather's scales. The trainer
and the parity tests both call this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_runtime.model import ModelConfig, Transformer
from hp_runtime.parallel.clip import clip_grad_norm
from hp_runtime.parallel.cp import ContextParallel
from hp_runtime.parallel.float8 import precompute_scales
from hp_runtime.parallel.init import init_weights
from hp_runtime.parallel.mesh import ParallelDims, data_parallel_mesh, dp_cp_mesh
from hp_runtime.parallel.options import Float8, ParallelOptions
from hp_runtime.parallel.parallelize import parallelize
from hp_runtime.parallel.pp import build_schedule, stage_modules
from hp_runtime.parallel.tied import broadcast_tied, stage_groups, sync_tied_grads, tied_weight


@dataclass
class Assembly:
    """This rank's stages (one `(0, model)` without a pipeline), its schedule and groups."""

    stages: list[tuple[int, nn.Module]]
    total_stages: int
    device: torch.device
    mesh: DeviceMesh | None
    dp_mesh: DeviceMesh | None
    dims: ParallelDims
    schedule: object | None = None
    pp_group: dist.ProcessGroup | None = None
    tied: nn.Parameter | None = None
    tied_group: dist.ProcessGroup | None = None
    parameters: list[nn.Parameter] = field(default_factory=list)
    dp_cp_mesh: DeviceMesh | None = None
    cp: ContextParallel | None = None  # context parallelism's plan: this rank's rows
    expert_mesh: DeviceMesh | None = None  # expert parallelism's (`ParallelDims.build_expert_mesh`)
    float8: Float8 | None = None  # `train.float8`, applied in `parallelize`

    @property
    def stage_ids(self) -> list[int]:
        return [stage for stage, _ in self.stages]

    @property
    def modules(self) -> list[nn.Module]:
        return [module for _, module in self.stages]

    @property
    def model(self) -> nn.Module:
        """The whole model, when there is no pipeline."""
        if self.schedule is not None:
            raise ValueError("a pipeline-parallel rank holds stages, not the whole model")
        return self.stages[0][1]

    @property
    def has_first_stage(self) -> bool:
        """Feeds tokens into the model (needs the inputs)."""
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        """Computes the loss (needs the labels)."""
        return self.total_stages - 1 in self.stage_ids

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp_mesh is None else self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None if self.dp_mesh is None else self.dp_mesh.get_group()

    @property
    def dp_cp_size(self) -> int:
        """Ranks a global batch's loss tokens are spread over; FSDP averages gradients over
        them (dp_size x cp)."""
        return self.dims.dp_cp_size

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        return None if self.dp_cp_mesh is None else self.dp_cp_mesh.get_group()

    @property
    def tp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh["tp"].get_local_rank()

    @property
    def _last_tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the embedding (a tied head, or the one its multi-token
        prediction modules read) on a rank without the first stage."""
        return self.tied if self.tied is not None and not self.has_first_stage else None

    def finish_gradients(self, max_norm: float, sync_tied: bool = True) -> torch.Tensor:
        """After backward: sum the tied copies' gradients, then clip; the global grad norm.
        `sync_tied=False` exists for the negative-control test only."""
        if sync_tied:
            sync_tied_grads(self.tied, self.tied_group)
        return clip_grad_norm(self.parameters, max_norm, self.pp_group, skip=self._last_tied_copy)

    def weights_changed(self) -> None:
        """After each optimizer step and each load of weights: the float8 all-gather's scales
        of the new weights. Without them FSDP's float8 all-gather scales each weight by the
        amax of the data-parallel shards alone, one scale per tp shard under TP."""
        if self.float8 is not None and self.float8.fsdp_all_gather:
            precompute_scales(self.modules)


def shard_stages(
    config: ModelConfig,
    dims: ParallelDims,
    device_type: str,
    options: ParallelOptions,
    param_dtype: torch.dtype | None = None,
    float8: Float8 | None = None,
) -> tuple[list[tuple[int, nn.Module]], DeviceMesh | None, DeviceMesh | None]:
    """This rank's stages of the model, parallelized but still on the meta device (no memory
    of the model's is allocated), and the meshes: the part of `assemble` that decides every
    shard. `hp-train plan` runs it over a fake process group of any world size."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims.validate(world, config)
    mesh = expert_mesh = None
    if dist.is_initialized():
        mesh = dims.build_mesh(device_type, world)
        if dims.ep > 1:
            expert_mesh = dims.build_expert_mesh(device_type, world)
    with torch.device("meta"):
        model = Transformer(config)
    stages: list[tuple[int, nn.Module]] = [(0, model)]
    if dims.pp > 1:
        assert mesh is not None
        stages = stage_modules(
            model, mesh["pp"].get_local_rank(), dims.pp, options.pp_virtual_stages
        )
    for _, module in stages:
        parallelize(
            module,
            dims,
            mesh,
            options,
            param_dtype=param_dtype,
            expert_mesh=expert_mesh,
            float8=float8,
            device_type=device_type,
        )
    return stages, mesh, expert_mesh


def assemble(
    config: ModelConfig,
    dims: ParallelDims,
    device: torch.device,
    *,
    seed: int,
    options: ParallelOptions | None = None,
    param_dtype: torch.dtype | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    float8: Float8 | None = None,
) -> Assembly:
    """Build, parallelize, materialise and initialise this rank's share of the model.

    Without an initialised process group `dims` must describe one process. `param_dtype` is
    FSDP's compute dtype (see `parallelize`); `float8` converts the linears (`float8.py`).
    Under a pipeline,
    `loss_fn(logits, targets)` returns a micro-batch's share of the step's loss (gradients are
    not rescaled); it is required then, and ignored otherwise.
    """
    options = options or ParallelOptions()
    if dims.pp > 1 and loss_fn is None:
        raise ValueError("a pipeline needs loss_fn: the last stage computes the loss")
    stages, mesh, expert_mesh = shard_stages(
        config, dims, device.type, options, param_dtype, float8
    )
    dp_mesh = data_parallel_mesh(mesh) if mesh is not None else None
    dp_cp = dp_cp_mesh(mesh, dims) if mesh is not None else None
    total_stages = dims.pp * options.pp_virtual_stages if dims.pp > 1 else 1
    pp_group = tied_group = None
    if dims.pp > 1:
        pp_group, tied_group = stage_groups(mesh)  # type: ignore[arg-type]
    for _, module in stages:
        module.to_empty(device=device)
        init_weights(module, seed=seed)
    assembly = Assembly(
        stages,
        total_stages,
        device,
        mesh,
        dp_mesh,
        dims,
        pp_group=pp_group,
        dp_cp_mesh=dp_cp,
        cp=ContextParallel(mesh["cp"]) if dims.cp > 1 else None,  # type: ignore[index]
        expert_mesh=expert_mesh,
        float8=float8,
    )
    if dims.pp > 1 and (config.tie_embeddings or config.mtp is not None):
        assembly.tied, assembly.tied_group = tied_weight(stages), tied_group
        first_rank = int(mesh["pp"].mesh[0])  # type: ignore[index]
        broadcast_tied(assembly.tied, tied_group, first_rank)
    if dims.pp > 1:
        assembly.schedule = build_schedule(
            stages,
            mesh["pp"],
            device,
            options.pp_schedule,
            options.pp_microbatches or 1,
            loss_fn,  # type: ignore[index]
        )
    # A tied pair inside one module is one parameter here, as `parameters()` yields it once.
    assembly.parameters = [p for module in assembly.modules for p in module.parameters()]
    assembly.weights_changed()
    return assembly
