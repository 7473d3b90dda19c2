"""A routed (mixture-of-experts) feed-forward, free of parallelism like the rest of the model.

A token's hidden state goes to its `top_k` experts (chosen by `Router`), each a SwiGLU; their
outputs are summed with the router's weights, plus the always-active shared experts. Dropless:
every token reaches all of its top-k experts, however uneven the load (no capacity factor).

The experts see their tokens grouped: sorted by expert (stable, so a token's order inside its
expert is its order in the batch), with the count per expert. `Experts.kernel` is the hook
expert parallelism wraps (`parallel/ep.py`): it sends each group to the rank that owns the
expert and brings the outputs back, as `Attention.kernel` is context parallelism's.

Load balancing acts through two side channels, so that the layer's output is all a pipeline
stage passes on: the auxiliary loss enters the backward directly (`AddAuxLoss`, Megatron's
`MoEAuxLossAutoScaler`), and the load per expert accumulates in a buffer the trainer reads
after each step (`MoE.load`, `MoE.aux_total`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hp_runtime.model.config import ModelConfig, MoEConfig
from hp_runtime.model.ffn import FeedForward

# (tokens grouped by expert (n, dim), tokens per expert (E,), w1, w2, w3) -> outputs (n, dim)
ExpertKernel = Callable[..., torch.Tensor]


def expert_ffn(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU of each expert on its rows of `x`: rows are grouped by expert, `counts[e]` of
    them for expert e (w1, w3: (E, hidden, dim); w2: (E, dim, hidden)). An exact loop over
    experts (one host read of the counts: CPU path)."""
    out = []
    for e, rows in enumerate(x.split(counts.tolist())):
        out.append((F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t())
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


class Experts(nn.Module):
    """`experts` SwiGLUs as three stacked weights, so one grouped matrix multiply can run
    them all and expert parallelism can shard them along their first dim."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.kernel: ExpertKernel = expert_ffn

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, counts, self.w1, self.w2, self.w3)


class Router(nn.Module):
    """Scores each token against every expert and picks its top-k, ties to the lower index."""

    def __init__(self, dim: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.experts, bias=False)
        # DeepSeek-V3's balancing bias: chooses experts, never weights them. State of the run
        # (checkpointed with the model), moved by the trainer after each step.
        self.register_buffer("expert_bias", torch.zeros(moe.experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights (T, k), experts (T, k), scores (T, E)) of tokens `x` (T, dim); scores are
        the probabilities the auxiliary loss reads (softmax), or the sigmoid scores."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.moe.router == "softmax" else logits.sigmoid()
        choice = scores
        if self.moe.load_balance == "bias":
            choice = scores + self.expert_bias
        # A stable sort keeps equal scores in index order: ties go to the lower expert.
        experts = choice.sort(dim=-1, descending=True, stable=True).indices[:, : self.moe.top_k]
        weights = scores.gather(-1, experts)
        if self.moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.moe.route_scale, experts, scores


def aux_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Switch auxiliary loss: E · Σ_e f_e · P_e, with f_e the share of the T·k routed
    slots that went to expert e and P_e its mean probability over the T tokens (1 at a
    perfectly even load)."""
    tokens, experts = scores.shape
    share = counts.float() / (tokens * top_k)
    return experts * (share * scores.mean(dim=0)).sum()


class AddAuxLoss(torch.autograd.Function):
    """Returns `x` unchanged; its backward gives `aux` the gradient `scale`, so the auxiliary
    loss adds `scale · aux` to the training loss without travelling with the activations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (scale,) = ctx.saved_tensors
        return grad, scale.to(grad.dtype).expand(()), None


def _recomputing() -> bool:
    """Whether this forward runs inside a backward (activation checkpointing's recompute),
    where the load was already counted."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The routed feed-forward of one layer (in place of `FeedForward`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe = moe
        self.router = Router(config.dim, moe)
        self.experts = Experts(config.dim, moe.expert_ffn_hidden, moe.experts)
        self.shared = None
        if moe.shared_experts:
            self.shared = FeedForward(config.dim, moe.shared_hidden)
        # The weight of this layer's auxiliary loss in the step's loss: the trainer sets it
        # to aux_loss_coef / micro-batches per rank before each step (see `train/step.py`).
        self.register_buffer("aux_scale", torch.ones(()), persistent=False)
        # Summed over a step's forwards, read and zeroed by the trainer.
        self.register_buffer("load", torch.zeros(moe.experts), persistent=False)
        self.register_buffer("aux_total", torch.zeros(()), persistent=False)

    def reset_buffers(self) -> None:
        """The non-persistent buffers' starting values (`to_empty` leaves them garbage)."""
        self.aux_scale.fill_(1.0)
        self.load.zero_()
        self.aux_total.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts, scores = self.router(flat)
        top_k = experts.shape[-1]
        counts = torch.bincount(experts.reshape(-1), minlength=self.moe.experts)
        order = experts.reshape(-1).argsort(stable=True)  # slots grouped by expert
        routed = self.experts(flat[order // top_k], counts)
        # Back to (token, slot) order, then the weighted sum over a token's k slots: a
        # gather, not a scatter-add, so the sum's order is fixed on every device.
        slots = torch.empty_like(routed).index_copy_(0, order, routed)
        out = (slots.view(-1, top_k, shape[-1]) * weights.unsqueeze(-1).to(slots.dtype)).sum(1)
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.moe.load_balance == "aux_loss" and self.training:
            aux = aux_loss(scores, counts, top_k)
            out = AddAuxLoss.apply(out, aux, self.aux_scale)
            if not _recomputing():
                self.aux_total += aux.detach()
        if self.training and not _recomputing():  # an evaluation's tokens are no step's load
            self.load += counts.to(self.load.dtype)
        return out.view(shape).to(x.dtype)
