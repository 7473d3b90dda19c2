"""Train the tiny model for a few steps in one layout and report what parity tests compare."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel
import torch.nn.functional as F
from hp_runtime.model import Transformer, canonical_name, init_weights, preset
from hp_runtime.parallel import ParallelDims, parallelize
from hp_runtime.parallel.clip import clip_grad_norm
from hp_runtime.parallel.pp import build_schedule, pipeline_step, stage_modules
from hp_runtime.parallel.tied import broadcast_tied, stage_groups, sync_tied_grads, tied_weight

STEPS = 10
BATCH = 4
SEQ = 32
MAX_NORM = 1.0  # small enough that clipping acts on some steps


def batches(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(
    rank: int,
    world: int,
    dims: dict[str, int] | None,
    optimizer: str,
    model_overrides: dict[str, Any],
    pipeline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Per-step global losses, gradient norms and the final full parameters of one layout.

    `pipeline`: schedule, microbatches, virtual_stages, and sync_tied (False: the negative
    control that leaves the tied copies' gradients apart)."""
    config = preset("tiny", **model_overrides)
    pipeline = pipeline or {}
    with torch.device("meta"):
        model = Transformer(config)
    layout = ParallelDims(**(dims or {}))
    stages = [(0, model)]
    total_stages, pp_group, tied, first_rank = 1, None, None, 0
    if dims is not None:
        layout.validate(world, config)
        mesh = layout.build_mesh("cpu", world)
        dp_rank = mesh["dp_replicate", "dp_shard"]._flatten().get_local_rank()
        dp_size = layout.dp_replicate * layout.dp_shard
        if layout.pp > 1:
            virtual = pipeline.get("virtual_stages", 1)
            total_stages = layout.pp * virtual
            stages = stage_modules(model, mesh["pp"].get_local_rank(), layout.pp, virtual)
            pp_group, group = stage_groups(mesh)
            first_rank = int(mesh["pp"].mesh[0])
        for _, module in stages:
            parallelize(
                module,
                layout,
                mesh,
                loss_parallel=pipeline.get("loss_parallel", False),
                activation_checkpointing=pipeline.get("ac"),
                compile_blocks=pipeline.get("compile", False),
            )
    else:
        dp_rank, dp_size = 0, 1
    for _, module in stages:
        module.to_empty(device="cpu")
        init_weights(module, seed=7)
    if layout.pp > 1 and config.tie_embeddings:
        tied = tied_weight(stages)
        broadcast_tied(tied, group, first_rank)
    params = [p for _, module in stages for p in module.parameters()]
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=0.5)
    else:
        opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, foreach=False)
    schedule = None
    if layout.pp > 1:
        microbatches = pipeline.get("microbatches", 2)
        schedule = build_schedule(
            stages,
            mesh["pp"],
            torch.device("cpu"),
            pipeline.get("schedule", "1f1b"),
            microbatches,
            loss_fn,
        )
    losses, norms = [], []
    for data in batches(config.vocab_size):
        local = data.chunk(dp_size)[dp_rank]
        if schedule is None and pipeline.get("loss_parallel"):
            # Logits stay sharded over the vocabulary; the loss is computed on the shards.
            with torch.distributed.tensor.parallel.loss_parallel():
                loss = loss_fn(model(local[:, :-1]), local[:, 1:])
                loss.backward()
        elif schedule is None:
            loss = loss_fn(model(local[:, :-1]), local[:, 1:])
            loss.backward()
        else:
            loss = pipeline_step(
                schedule,
                [s for s, _ in stages],
                total_stages,
                local[:, :-1],
                local[:, 1:],
                pipeline.get("microbatches", 2),
            )
        if tied is not None and pipeline.get("sync_tied", True):
            sync_tied_grads(tied, group)
        last_copy = tied if tied is not None and stages[0][1].tok_embeddings is None else None
        norms.append(float(clip_grad_norm(params, MAX_NORM, pp_group, skip=last_copy)))
        opt.step()
        opt.zero_grad()
        if loss is not None and hasattr(loss, "full_tensor"):  # loss_parallel gives a DTensor
            loss = loss.full_tensor()
        reported = loss.detach().clone() if loss is not None else torch.zeros(())
        if dims is not None:  # mean over data-parallel lines; tp copies and pp stages counted once
            dist.all_reduce(reported)
            reported /= world // layout.pp
        losses.append(float(reported))
    full = {}
    for _, module in stages:
        for name, param in module.named_parameters():
            value = param.full_tensor() if hasattr(param, "full_tensor") else param
            full[canonical_name(name)] = (
                value.detach().numpy().copy()
            )  # numpy: crosses process boundaries
    return {"losses": losses, "norms": norms, "params": full}
