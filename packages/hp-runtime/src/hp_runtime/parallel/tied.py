"""Tied input/output embeddings across pipeline stages, and the embedding the last stage's
multi-token prediction modules read (`model.mtp`): the same machinery, the same pair.

The first stage owns the embedding, the last the head that shares its weight (or its own copy
of the embedding). Each keeps its
own copy; they start equal (broadcast from the first stage) and stay equal because, after
backward, their gradients are summed over a group of exactly the two stages before the
optimizer step. With FSDP the local shards are summed (both are sharded alike over the same
data-parallel ranks); with TP likewise. Every data-parallel/TP line has its own group (not the
pipeline's: see `stage_groups`); all ranks create all groups in the same order, so nobody
deadlocks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def stage_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(all stages, first and last stage) of this rank's pipeline line, as new groups.

    New groups rather than the pipeline's own: a schedule can return from a step with
    point-to-point sends still in flight on its group, and a collective on that same group
    would be matched against them. Every rank creates every line's groups in the same order.
    """
    pp = mesh["pp"].size()
    lines = mesh.mesh.reshape(pp, -1).T.tolist()  # mesh shape: (pp, dp_replicate, dp_shard, tp)
    mine: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
    for line in lines:
        whole = dist.new_group(line)
        ends = dist.new_group([line[0], line[-1]]) if pp > 2 else whole
        if dist.get_rank() in line:
            mine = (whole, ends)
    assert mine is not None
    return mine


def tied_weight(stages: list) -> torch.nn.Parameter | None:
    """This rank's copy of the tied weight: the embedding on the first stage, the head on the
    last, or the embedding there where the prediction modules hold one (None in between)."""
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
    grad = weight.grad
    if isinstance(grad, DTensor) and grad.placements != weight.placements:
        # Under TP the embedding's gradient comes back replicated while the head's is sharded
        # like its weight: lay both out as their weights before summing the local pieces.
        grad = grad.redistribute(weight.device_mesh, weight.placements)
        weight.grad = grad
    dist.all_reduce(_local(grad), group=group)
