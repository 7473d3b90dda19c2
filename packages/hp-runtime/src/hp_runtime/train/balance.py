"""MoE load balancing across a step, on this rank's stages: the weight of the auxiliary loss
before the step, and after it the global load per expert, the balancing bias moved by it, and
the figures the metrics log.

One collective a step: each MoE layer's tokens per expert (and auxiliary losses) summed over
the data-parallel ranks (the ranks that see different tokens; tensor-parallel ranks see the
same ones, pipeline stages hold other layers). No host sync: the figures stay on the device
until the metrics read them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hp_runtime.model.moe import MoE


def moe_layers(modules: list[nn.Module]) -> list[tuple[int, MoE]]:
    """(layer index, MoE) of every routed feed-forward in `modules` (a model or stages)."""
    found = []
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, MoE):
                found.append((int(name.split(".")[1]), sub))  # "layers.{i}.feed_forward"
    return sorted(found, key=lambda item: item[0])


class Balance:
    """The MoE layers of this rank's stages and the data-parallel group their loads sum over
    (None: one process)."""

    def __init__(self, modules: list[nn.Module], group: dist.ProcessGroup | None) -> None:
        self.layers = moe_layers(modules)
        self.group = group
        self.ranks = 1 if group is None else dist.get_world_size(group)
        self.micro_batches = 1
        self.load: torch.Tensor | None = None  # (layers, experts): the last step's, global

    def start_step(self, micro_batches: int) -> None:
        """Before a step of `micro_batches` micro-batches on this rank: each micro-batch's
        auxiliary loss weighs `aux_loss_coef / micro_batches` (FSDP averages the gradients
        over the data-parallel ranks: the step's loss holds the mean over all micro-batches)."""
        self.micro_batches = micro_batches
        for _, moe in self.layers:
            moe.aux_scale.fill_(moe.moe.aux_loss_coef / micro_batches)
            # What ran since the last step (an evaluation, a stray forward) is not this step's.
            moe.load.zero_()
            moe.aux_total.zero_()

    def finish_step(self) -> torch.Tensor:
        """After the step's backward: sum the loads over the data-parallel ranks (the next
        `start_step` zeroes the buffers). Returns (layers here, 3): [mean auxiliary loss per
        micro-batch, max tokens per expert / mean tokens per expert, total tokens routed] per
        layer."""
        if not self.layers:
            return torch.zeros(0, 3)
        loads = torch.stack([moe.load for _, moe in self.layers])
        aux = torch.stack([moe.aux_total for _, moe in self.layers])
        packed = torch.cat([loads, aux.unsqueeze(1)], dim=1)
        if self.group is not None:
            dist.all_reduce(packed, group=self.group)
        self.load = packed[:, :-1]
        mean = self.load.mean(dim=1)
        return torch.stack(
            [
                packed[:, -1] / (self.micro_batches * self.ranks),
                self.load.max(dim=1).values / mean.clamp(min=1e-9),
                self.load.sum(dim=1),
            ],
            dim=1,
        )

    @torch.no_grad()
    def update_bias(self) -> None:
        """DeepSeek-V3's auxiliary-loss-free step, after the optimizer's: each expert's bias
        moves by `bias_update_rate` towards the mean load (down when it had more tokens than
        the mean, up when fewer). Every data-parallel rank moves it alike."""
        if self.load is None:
            return
        for (_, moe), load in zip(self.layers, self.load, strict=True):
            if moe.moe.load_balance == "bias":
                bias = moe.router.expert_bias
                bias += moe.moe.bias_update_rate * torch.sign(load.mean() - load).to(bias.dtype)
