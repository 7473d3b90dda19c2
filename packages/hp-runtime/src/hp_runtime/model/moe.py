"""A routed (mixture-of-experts) feed-forward, free of parallelism like the rest of the model.

A token's hidden state goes to its `top_k` experts (chosen by `Router`), each a SwiGLU; their
outputs are summed with the router's weights, plus the always-active shared experts. Dropless:
every token reaches all of its top-k experts, however uneven the load (no capacity factor).

The experts see their tokens grouped: sorted by expert (stable, so a token's order inside its
expert is its order in the batch), with the count per expert. `Experts.kernel` is the hook
expert parallelism wraps (`parallel/ep.py`): it sends each group to the rank that owns the
expert and brings the outputs back, as `Attention.kernel` is context parallelism's. The
kernel runs the experts as one grouped matrix multiply where torch has it for the device and
dtype (`grouped_expert_ffn`), else as an exact loop (`expert_ffn`, the reference).

Load balancing acts through two side channels, so that the layer's output is all a pipeline
stage passes on: the auxiliary loss enters the backward directly (`AddAuxLoss`, Megatron's
`MoEAuxLossAutoScaler`), and the load per expert accumulates in a buffer the trainer reads
after each step (`MoE.load`, `MoE.aux_total`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hp_runtime.model.config import ModelConfig, MoEConfig
from hp_runtime.model.ffn import FeedForward

# (tokens grouped by expert (n, dim), tokens per expert (E,), w1, w2, w3) -> outputs (n, dim)
ExpertKernel = Callable[..., torch.Tensor]


def _autocast_on(kind: str) -> bool:
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A context without autocast on `device` (a no-op where autocast is off or unknown)."""
    if _autocast_on(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What a matmul on `x` computes in: autocast's dtype where it is on, else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if _autocast_on(kind) else x.dtype


def expert_ffn(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU of each expert on its rows of `x`: rows are grouped by expert, `counts[e]` of
    them for expert e (w1, w3: (E, hidden, dim); w2: (E, dim, hidden)). An exact loop over
    experts, the reference: it reads the counts on the host (a sync on a GPU)."""
    out = []
    for e, rows in enumerate(x.split(counts.tolist())):
        out.append((F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t())
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


def grouped_expert_ffn(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """`expert_ffn` as three grouped matrix multiplies (`torch._grouped_mm`), one per weight
    over all experts. The groups' ends are the cumulative counts, int32 on the device: no
    host read, so no sync on a GPU."""
    dtype = compute_dtype(x)
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    ends = counts.cumsum(0, dtype=torch.int32)
    with _autocast_off(x.device):
        gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends)
        up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=ends)
        out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=ends)
    return _DenseGrad.apply(out)


class _DenseGrad(torch.autograd.Function):
    """The identity, whose backward hands on a dense gradient: the grouped multiply's
    backward refuses an expanded one (a sum's, stride 0) in torch 2.15, empty ones too
    (which `contiguous` keeps as they are)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what _grouped_mm takes
# (device type, device index, dtype) -> whether `torch._grouped_mm` runs there and agrees.
_GROUPED_RUNS: dict[tuple[str, int | None, torch.dtype], bool] = {}


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `grouped_expert_ffn` runs on `device` in `dtype` and equals the loop, forward
    and backward: tried once on a tiny problem (a host read, the first time only), then
    remembered. torch 2.15 has the grouped multiply on CPU and CUDA in fp32, bf16 and fp16,
    but a build or a GPU generation may lack it, so nothing is assumed."""
    key = (device.type, device.index, dtype)
    if key not in _GROUPED_RUNS:
        _GROUPED_RUNS[key] = _try_grouped(device, dtype)
    return _GROUPED_RUNS[key]


# `torch._dynamo.assume_constant_result`'s mark, set without importing dynamo (2 s): compiled
# code asks once, while tracing, and keeps the answer as a constant.
grouped_mm_runs._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _try_grouped(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm") or dtype not in _GROUPED_DTYPES:
        return False
    if device.type == "meta":  # shapes only: the grouped path has a meta kernel
        return True
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5])  # an expert without tokens among them
    # A context of its own: no autocast, gradients on, and saved tensors kept plainly even
    # inside activation checkpointing's forward (whose hooks would otherwise take them).
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        _autocast_off(device),
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    ):
        x = torch.randn(8, 16, generator=generator)
        weights = [torch.randn(3, 16, 16, generator=generator) / 4 for _ in range(3)]
        leaves = [t.to(device, dtype).requires_grad_() for t in (x, *weights)]
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        try:
            results = []
            for kernel in (grouped_expert_ffn, expert_ffn):
                out = kernel(leaves[0], counts.to(device), *leaves[1:])
                results.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
            return all(
                torch.allclose(a.float(), b.float(), rtol=tolerance, atol=tolerance)
                for a, b in zip(*results, strict=True)
            )
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return False  # not on this device, dtype or build


def _aligned(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """The grouped multiply's layout rule: each operand's rows start 16 bytes apart, so the
    model width and the expert width must be multiples of 16 bytes (8 bf16 values)."""
    size = compute_dtype(x).itemsize
    return (w1.shape[-1] * size) % 16 == 0 and (w1.shape[-2] * size) % 16 == 0


def auto_expert_ffn(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """The default kernel: `grouped_expert_ffn` where the grouped multiply runs for x's
    device and compute dtype and the widths fit its layout, else the loop `expert_ffn`."""
    grouped = _aligned(x, w1) and grouped_mm_runs(x.device, compute_dtype(x))
    return (grouped_expert_ffn if grouped else expert_ffn)(x.contiguous(), counts, w1, w2, w3)


class Experts(nn.Module):
    """`experts` SwiGLUs as three stacked weights, so one grouped matrix multiply can run
    them all and expert parallelism can shard them along their first dim."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.kernel: ExpertKernel = auto_expert_ffn
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's weights as `nn.Linear` initialises its own (Kaiming-uniform over its
        input width), so a plain `Experts` (or `Transformer(config)`) holds numbers, not
        `torch.empty`'s garbage; the trainer's `init_weights` overwrites them."""
        for weight in (self.w1, self.w2, self.w3):
            bound = 1 / weight.shape[-1] ** 0.5  # kaiming_uniform_(a=sqrt(5)) of a Linear
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, counts, self.w1, self.w2, self.w3)


class Router(nn.Module):
    """Scores each token against every expert and picks its top-k, ties to the lower index.
    The scores are computed in fp32 (fp64 stays fp64) whatever the parameters' dtype, so a
    bf16 run ranks the experts as an fp32 one would, up to its bf16 inputs."""

    def __init__(self, dim: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.experts, bias=False)
        # DeepSeek-V3's balancing bias: chooses experts, never weights them. State of the run
        # (checkpointed with the model), moved by the trainer after each step.
        self.register_buffer("expert_bias", torch.zeros(moe.experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights (T, k), experts (T, k), scores (T, E)) of tokens `x` (T, dim); scores are
        the probabilities the auxiliary loss reads (softmax), or the sigmoid scores. Weights
        and scores are fp32 (or fp64)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with _autocast_off(x.device):
            logits = F.linear(x.to(dtype), self.gate.weight.to(dtype))
        scores = logits.softmax(dim=-1) if self.moe.router == "softmax" else logits.sigmoid()
        choice = scores
        if self.moe.load_balance == "bias":
            choice = scores + self.expert_bias.to(dtype)
        if self.moe.topk_groups < self.moe.groups:
            choice = self._within_best_groups(choice)
        # A stable sort keeps equal scores in index order: ties go to the lower expert.
        experts = choice.sort(dim=-1, descending=True, stable=True).indices[:, : self.moe.top_k]
        weights = scores.gather(-1, experts)
        if self.moe.renormalize:  # the 1e-20 keeps k sigmoid scores that underflow finite
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.moe.route_scale, experts, scores

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` (T, E) with the experts outside each token's best `topk_groups` groups
        set to -inf (group-limited routing, `MoEConfig`)."""
        grouped = choice.unflatten(-1, (self.moe.groups, -1))  # (T, groups, experts a group)
        if self.moe.router == "sigmoid":  # DeepSeek-V3: a group's two best scores
            rank = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:  # DeepSeek-V2: a group's best
            rank = grouped.amax(dim=-1)
        best = rank.sort(dim=-1, descending=True, stable=True).indices[:, : self.moe.topk_groups]
        kept = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)


def aux_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Switch auxiliary loss: E · Σ_e f_e · P_e, with f_e the share of the T·k routed
    slots that went to expert e and P_e the mean over the T tokens of their probability for
    e (`probs` (T, E), rows summing to 1). 1 at a perfectly even load, E / k at the worst."""
    tokens, experts = probs.shape
    share = counts.to(probs.dtype) / max(tokens * top_k, 1)
    return experts * (share * probs.mean(dim=0)).sum()


class AddAuxLoss(torch.autograd.Function):
    """Returns `x` unchanged; its backward gives `aux` the gradient `scale`, so the auxiliary
    loss adds `scale · aux` to the training loss without travelling with the activations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        ctx.aux_dtype = aux.dtype  # the gradient in aux's precision, not the activations'
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (scale,) = ctx.saved_tensors
        return grad, scale.to(ctx.aux_dtype).expand(()), None


def _recomputing() -> bool:
    """Whether this forward runs inside a backward (activation checkpointing's recompute),
    where the load was already counted. (torch's reentrant checkpoint, which hp does not
    use, runs the first forward without a graph: its loads would not be counted at all.)
    A compiled forward counts once: its backward recomputes inside the compiled graph."""
    if torch.compiler.is_compiling():
        return False
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
        # The weight of this layer's auxiliary loss in the step's loss: aux_loss_coef for one
        # forward; the trainer sets it to aux_loss_coef / micro-batches per rank before each
        # step (see `train/balance.py`).
        self.register_buffer("aux_scale", torch.tensor(moe.aux_loss_coef), persistent=False)
        # Summed over a step's forwards; the trainer zeroes them before a step, reads them after.
        self.register_buffer("load", torch.zeros(moe.experts), persistent=False)
        self.register_buffer("aux_total", torch.zeros(()), persistent=False)

    def reset_buffers(self) -> None:
        """The non-persistent buffers' starting values (`to_empty` leaves them garbage)."""
        self.aux_scale.fill_(self.moe.aux_loss_coef)
        self.load.zero_()
        self.aux_total.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts, scores = self.router(flat)
        top_k = experts.shape[-1]
        slots = experts.reshape(-1)  # token t's k choices at t*k .. t*k + k-1
        # Tokens per expert by a scatter-add on the device (CUDA's bincount reads its input's
        # max on the host); integer sums, so the same on every device and in every order.
        counts = torch.zeros(self.moe.experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, slots, torch.ones_like(slots))
        order = slots.argsort(stable=True)  # slots grouped by expert
        routed = self.experts(flat[order // top_k], counts)
        # Back to (token, slot) order, then each token's weighted sum of its k outputs as one
        # (1 x k) @ (k x dim) product: a gather, not a scatter-add, so the order is fixed on
        # every device, and accumulated in fp32 by the matmul (weights in the outputs' dtype).
        slotted = torch.empty_like(routed).index_copy_(0, order, routed)
        mixed = weights.to(routed.dtype).unsqueeze(1)
        out = torch.bmm(mixed, slotted.reshape(-1, top_k, shape[-1])).squeeze(1)
        if self.shared is not None:
            out = out + self.shared(flat)
        # A training forward builds a graph: evaluation (no_grad) neither counts nor balances.
        graph = torch.is_grad_enabled()
        if self.moe.load_balance == "aux_loss" and self.training and graph:
            probs = scores
            if self.moe.router == "sigmoid":  # DeepSeek-V3's normalised scores
                probs = scores / scores.sum(dim=-1, keepdim=True)
            aux = aux_loss(probs, counts, top_k)
            out = AddAuxLoss.apply(out, aux, self.aux_scale)
            if not _recomputing():
                self.aux_total.add_(aux.detach())
        # An evaluation's tokens (eval mode, or no graph) are no step's load.
        if self.training and graph and not _recomputing():
            self.load.add_(counts.to(self.load.dtype))
        return out.view(shape).to(x.dtype)
