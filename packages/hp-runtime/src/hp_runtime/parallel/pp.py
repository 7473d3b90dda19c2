"""Pipeline parallel with torch.distributed.pipelining: split by layers, build the schedule.

Every stage is the whole Transformer built on meta with the layers it does not own deleted
(the embedding kept on the first stage, norm and head on the last; the multi-token prediction
modules and a copy of the embedding on the last too), so parameter names stay those of the
full model. With `virtual_stages` v > 1 a rank holds v stages, rank r owning
stages r, r + pp, r + 2 pp, ... (the interleaved layout).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

    from hp_runtime.parallel.cp import ContextParallel

# Class names in torch.distributed.pipelining.schedules, imported when a schedule is built:
# that module pulls in torch._dynamo, a second of start-up a run without a pipeline can skip.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
}


def layers_per_stage(n_layers: int, stages: int, counts: list[int] | None = None) -> list[int]:
    """Layers of each stage: `counts` as given (checked), else as even as possible, earlier
    stages taking the remainder."""
    if counts is not None:
        if len(counts) != stages or sum(counts) != n_layers or min(counts) < 1:
            raise ValueError(
                f"layers per stage {counts} must be {stages} positive counts adding up to "
                f"{n_layers}"
            )
        return counts
    if n_layers < stages:
        raise ValueError(f"n_layers={n_layers} is fewer than the {stages} pipeline stages")
    base, extra = divmod(n_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def stage_modules(
    model: nn.Module,
    pp_rank: int,
    pp_size: int,
    virtual_stages: int = 1,
    counts: list[int] | None = None,
) -> list[tuple[int, nn.Module]]:
    """(stage id, module) for each stage this rank owns, cut from a model on meta. The
    model's layers are split; its multi-token prediction modules (the layers after them) go
    to the last stage, with a copy of the embedding they read (kept equal to the first
    stage's as a tied embedding is: `tied.py`)."""
    total = pp_size * virtual_stages
    config = model.config
    sizes = layers_per_stage(config.n_layers, total, counts)
    starts = [sum(sizes[:i]) for i in range(total)]
    predictors = {str(i) for i in range(config.n_layers, config.total_layers)}
    owned = []
    for stage in range(pp_rank, total, pp_size):
        module = copy.deepcopy(model) if virtual_stages > 1 else model
        keep = {str(i) for i in range(starts[stage], starts[stage] + sizes[stage])}
        if stage == total - 1:
            keep |= predictors
        for name in list(module.layers):
            if name not in keep:
                del module.layers[name]
        if stage != 0 and not (stage == total - 1 and predictors):
            module.tok_embeddings = None
        if stage != total - 1:
            module.norm = None
            module.output = None
        owned.append((stage, module))
    return owned


def carry_positions(
    stages: list[tuple[int, nn.Module]],
    total_stages: int,
    names: tuple[str, ...],
    cp: ContextParallel | None = None,
) -> None:
    """Make every stage take `(h, *carried)` and each but the last return them, where
    `carried` are the batch's tensors named `names` (the forward's `position_ids` and/or
    `documents`), so they travel with the activations (a middle stage reads no data) and every
    stage rotates and masks by them. Call before the first step.

    torch infers a stage's shapes by running it once on uninitialised tensors of the shapes
    it receives: the ids a stage reads are clamped into the rotary table (a no-op on real
    ids, which lie below max_seq_len), so that run cannot index out of it.

    Under context parallelism (`cp`) the carried tensors cover the whole sequence while `h`
    holds this rank's rows: each stage takes its rows from their length."""
    for stage, module in stages:
        forward, last = module.forward, stage == total_stages - 1
        top = module.config.max_seq_len - 1

        def carried(
            h: torch.Tensor,
            *tensors: torch.Tensor,
            forward=forward,
            last=last,
            top=top,
            **kwargs: Any,
        ) -> torch.Tensor | tuple[torch.Tensor, ...]:
            named: dict[str, Any] = dict(zip(names, tensors, strict=True))
            if "position_ids" in named:
                named["position_ids"] = named["position_ids"].clamp(0, top)
            if cp is not None:
                named["rows"] = cp.rows(tensors[0].shape[1], tensors[0].device)
            out = forward(h, **named, **kwargs)
            return out if last else (out, *tensors)

        module.forward = carried


def build_schedule(
    stages: list[tuple[int, nn.Module]],
    pp_mesh: DeviceMesh,
    device: torch.device,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The pipeline schedule over this rank's stages. Gradients are not rescaled
    (`scale_grads=False`): `loss_fn` returns each micro-batch's share of the step's loss, so
    the gradients are those of the sum, as without a pipeline."""
    from torch.distributed.pipelining import PipelineStage, schedules

    try:
        kind = getattr(schedules, SCHEDULES[schedule])
    except KeyError:
        raise ValueError(f"unknown schedule {schedule!r}; choose {', '.join(SCHEDULES)}") from None
    total = pp_mesh.size() * len(stages)
    pipeline_stages = [
        PipelineStage(module, stage, total, device, group=pp_mesh.get_group())
        for stage, module in stages
    ]
    if issubclass(kind, schedules.PipelineScheduleMulti):
        return kind(
            pipeline_stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False
        )
    if len(pipeline_stages) != 1:
        raise ValueError(f"schedule {schedule!r} takes one stage per rank; use interleaved1f1b")
    return kind(pipeline_stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def pipeline_step(
    schedule: PipelineScheduleSingle | PipelineScheduleMulti,
    stage_ids: list[int],
    total_stages: int,
    inputs: torch.Tensor | tuple[torch.Tensor, ...] | None,
    targets: torch.Tensor | None,
    microbatches: int,
    backward: bool = True,
    kwargs: dict[str, Any] | None = None,
) -> torch.Tensor | None:
    """Run forward and backward (or, with `backward=False`, forward only) of one batch; on the
    last stage, the sum of the micro-batch losses (each already its share of the step's loss),
    else None. The first stage gives `inputs` (the tokens, or with `carry_positions` the
    tokens and the position ids), the last `targets`, the others neither. `kwargs` go to the
    forward of this rank's stages, tensors split into micro-batches."""
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    for batch in (*(inputs or ()), targets):
        if batch is not None and batch.shape[0] % microbatches:
            raise ValueError(
                f"a batch of {batch.shape[0]} does not divide into {microbatches} micro-batches"
            )
    run = schedule.step if backward else schedule.eval
    losses: list[torch.Tensor] = []
    kwargs = kwargs or {}
    if 0 in stage_ids:
        run(*inputs, target=targets, losses=losses, **kwargs)  # type: ignore[misc]
    elif total_stages - 1 in stage_ids:
        run(target=targets, losses=losses, **kwargs)
    else:
        run(**kwargs)
    return torch.stack(losses).sum() if losses else None
