"""Gradient-norm clipping over DTensors and across pipeline stages, equal to one process's.

Built for GPUs: the local norms of all gradients that share a mesh and placements are combined
first and reduced in one collective per such group (not one `full_tensor()` per parameter),
every tensor stays on the gradients' device (NCCL takes no CPU tensors), and the scale is
applied as a tensor, so clipping never waits on the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_partial_sum(grad: torch.Tensor) -> bool:
    return isinstance(grad, DTensor) and any(
        isinstance(p, Partial) and p.reduce_op == "sum" for p in grad.placements
    )


def reduce_partial_grads(parameters: list[torch.nn.Parameter]) -> None:
    """Turn gradients still pending a sum (a replicated weight used on sequence shards, such
    as a norm under sequence parallel, gets a Partial gradient) into replicated ones, with
    one all-reduce per mesh and placements instead of one per gradient."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None and _is_partial_sum(param.grad):
            groups.setdefault((param.grad.device_mesh, param.grad.placements), []).append(param)
    for (mesh, placements), members in groups.items():
        locals_ = [p.grad.to_local() for p in members]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        done = list(placements)
        for dim, placement in enumerate(placements):
            if isinstance(placement, Partial):
                dist.all_reduce(flat, group=mesh.get_group(dim))
                done[dim] = Replicate()
        for param, piece in zip(members, flat.split([t.numel() for t in locals_]), strict=True):
            grad = param.grad
            param.grad = DTensor.from_local(
                piece.view_as(grad.to_local()),
                mesh,
                done,
                run_check=False,
                shape=grad.shape,
                stride=grad.stride(),
            )


_PIECE = 1 << 16  # elements: 256 kB of float32 and its 512 kB float64 copy stay in L2


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element, accumulated in float64 (a 0-d tensor on the
    tensors' device).

    On CUDA `_foreach_norm` reads float32 and accumulates in float64 as it goes. On CPU it
    first copies each whole tensor to float64 (twice its bytes, through main memory), so there
    the tensors are cut into cache-sized pieces: the same float64 sum, in less than half the time.
    """
    if tensors and tensors[0].device.type == "cpu":
        tensors = [piece for t in tensors for piece in t.reshape(-1).split(_PIECE)]
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


@torch.no_grad()
def grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    pp_group: dist.ProcessGroup | None = None,
    skip: torch.nn.Parameter | None = None,
) -> torch.Tensor:
    """The global L2 norm of the gradients (on their device), every rank the same.

    Squares are accumulated in float64 (a float32 sum over millions of elements is off by
    about 1e-5 on CPU). Each group of gradients sharing a mesh and placements adds its local
    squares and sums them over its sharded mesh dims in one collective per dim; stages add
    theirs over `pp_group`; `skip` (the last stage's copy of a tied embedding) is left out, so
    the tied weight counts once, by the first stage.
    """
    parameters = list(parameters)
    reduce_partial_grads(parameters)
    groups: dict[object, list[torch.Tensor]] = {}
    device = None
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        device = _local(grad).device
        if param is skip:
            continue
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(_local(grad))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for key, grads in groups.items():
        squares = sum_of_squares(grads)
        if key is not None:
            mesh, placements = key  # type: ignore[misc]
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():  # Shard and _StridedShard alike
                    dist.all_reduce(squares, group=mesh.get_group(dim))
        total += squares
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt().float()


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    skip: torch.nn.Parameter | None = None,
) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm` (no clipping when it is
    0 or less); returns the norm before clipping. See `grad_norm` for `pp_group` and `skip`
    (a skipped tied copy is scaled like every other gradient)."""
    parameters = list(parameters)
    norm = grad_norm(parameters, pp_group, skip)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].device, grads[0].dtype))
    return norm
