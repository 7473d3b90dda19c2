"""Tied input/output embeddings across pipeline stages.

The first stage owns the embedding, the last the head that shares its weight. Each keeps its
own copy; they start equal (broadcast from the first stage) and stay equal because, after
backward, their gradients are summed over a group of exactly the two stages before the
optimizer step. With FSDP the local shards are summed (both are sharded alike over the same
data-parallel ranks); with TP likewise. Every data-parallel/TP line has its own group; all
ranks create all groups in the same order, so nobody deadlocks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tied_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group of this rank's first and last pipeline stage (same dp/tp coordinates)."""
    pp = mesh["pp"].size()
    if pp == 2:
        return mesh["pp"].get_group()  # the pipeline group already spans exactly the pair
    ranks = mesh.mesh  # shape (pp, dp_replicate, dp_shard, tp)
    mine = None
    for line in ranks.reshape(pp, -1).T.tolist():
        group = dist.new_group([line[0], line[-1]])
        if dist.get_rank() in (line[0], line[-1]):
            mine = group
    return mine  # type: ignore[return-value]


def tied_weight(stages: list) -> torch.nn.Parameter | None:
    """This rank's copy of the tied weight: the embedding on the first stage, the head on the
    last (None in between)."""
    for _, module in stages:
        if module.tok_embeddings is not None:
            return module.tok_embeddings.weight
        if module.output is not None:
            return module.output.weight
    return None


def broadcast_tied(
    weight: torch.nn.Parameter | None, group: dist.ProcessGroup | None, first_rank: int
) -> None:
    """Copy the first stage's weight to the last stage (skipped on the meta device)."""
    if weight is None or group is None or weight.device.type == "meta":
        return
    with torch.no_grad():
        dist.broadcast(_local(weight), src=first_rank, group=group)


def sync_tied_grads(weight: torch.nn.Parameter | None, group: dist.ProcessGroup | None) -> None:
    """Sum the gradient of the tied weight over its two stages (call after backward)."""
    if weight is None or group is None or weight.grad is None:
        return
    dist.all_reduce(_local(weight.grad), group=group)
