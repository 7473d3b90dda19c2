"""Gradient-norm clipping over DTensors and across pipeline stages, equal to one process's."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    skip: torch.nn.Parameter | None = None,
) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; returns the norm.

    Sharded gradients contribute their full norms; stages add their squares over `pp_group`;
    `skip` (the last stage's copy of a tied embedding) is scaled but counted once, by the
    first stage.
    """
    grads = [(p, p.grad) for p in parameters if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64)
    for param, grad in grads:
        if param is skip:
            continue
        norm = torch.linalg.vector_norm(grad, dtype=torch.float64)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total += norm.pow(2)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0).item()
    for _, grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(scale)
    return norm.float()
