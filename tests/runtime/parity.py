"""Train the tiny model for a few steps in one layout and report what parity tests compare."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hp_runtime.model import Transformer, init_weights, preset
from hp_runtime.parallel import ParallelDims, parallelize

STEPS = 10
BATCH = 4
SEQ = 32


def batches(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def train(
    rank: int,
    world: int,
    dims: dict[str, int] | None,
    optimizer: str,
    model_overrides: dict[str, Any],
) -> dict[str, Any]:
    """Per-step global losses and the final full parameters of one layout."""
    config = preset("tiny", **model_overrides)
    with torch.device("meta"):
        model = Transformer(config)
    layout = ParallelDims(**(dims or {}))
    if dims is not None:
        layout.validate(world, config)
        mesh = layout.build_mesh("cpu", world)
        parallelize(model, layout, mesh)
        dp_rank = mesh["dp_replicate", "dp_shard"]._flatten().get_local_rank()
        dp_size = layout.dp_replicate * layout.dp_shard
    else:
        dp_rank, dp_size = 0, 1
    model.to_empty(device="cpu")
    init_weights(model, seed=7)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    losses = []
    for data in batches(config.vocab_size):
        local = data.chunk(dp_size)[dp_rank]
        logits = model(local[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        reported = loss.detach().clone()
        if dims is not None:  # mean over data-parallel ranks; tp ranks hold equal copies
            dist.all_reduce(reported)
            reported /= world
        losses.append(float(reported))
    params = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        params[name] = full.detach().numpy().copy()  # numpy: crosses process boundaries
    return {"losses": losses, "params": params}
