"""Cross-entropy of the output head, a chunk of the sequence at a time.

At a 128k vocabulary the fp32 logits of one 8k-token sample are 4 GiB, and a plain
`F.cross_entropy(head(h).float(), ...)` keeps them, and the log-softmax beside them, from the
forward to the backward. Here the head and the loss run on `chunk` tokens at a time, so only
one chunk's logits (upcast to fp32 for the softmax) exist at once, in one of two ways:

- **Gradients in the forward** (`_HeadLoss`; a head whose weight is a plain tensor: one
  process, FSDP, which has gathered the weight in the forward, a pipeline's last stage). Each
  chunk's softmax becomes the gradient of its logits at once, in place, and goes through the
  head's two gradient matmuls before the next chunk; the backward only scales them. No matmul
  runs twice and nothing logits-sized outlives its chunk (torchtitan's chunked loss does the
  same with a backward per chunk). Its one condition: every loss token's loss enters the
  step's loss with the same weight, as `train/step.py` sums them (a padded or masked token has
  the IGNORE label and no gradient). The backward checks it on the device, without a host
  sync: a head gradient made under other weights would be wrong, so it is NaN instead, which
  the step's non-finite check stops on.
- **Recomputed** (a head whose weight is a tensor subclass: a tensor-parallel head, whose
  logits are vocabulary-sharded DTensors under `loss_parallel`): each chunk under activation
  checkpointing, its logits freed after its forward and recomputed in its backward; the
  head's matmul runs twice.

Both give the values and gradients of the whole-sequence computation. The head is called as a
module on the recomputed path, so the plans that act on it (a tensor-parallel head,
vocabulary-sharded logits, FSDP's gathered weight) see an ordinary call; on the other path its
weight is read inside the model's forward, where FSDP has gathered it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hp_runtime.model.config import CHUNK_TOKENS  # there, torch-free, for the trainer's config

_PLAIN = (torch.Tensor, nn.Parameter)
IGNORE = -100  # the label of a token without loss (F.cross_entropy's default ignore_index)


def _chunk_losses(head: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(h).float()  # bf16 under autocast or bf16 parameters: fp32 for the softmax
    losses = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE
    )
    return losses.view(labels.shape)


def _head_losses(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    positions: int,
    grad_h: torch.Tensor | None = None,
    grad_w: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's cross-entropy of `h @ weight.T`, `positions` positions at a time; where
    given, `grad_h` (like `h`) and `grad_w` (zeros like `weight`) get their gradients for a
    unit weight on every token's loss."""
    keep = labels != IGNORE
    targets = labels.clamp(min=0).unsqueeze(-1)  # IGNORE's rows are masked below
    losses = torch.empty(labels.shape, dtype=torch.float32, device=h.device)
    for start in range(0, labels.shape[1], positions):
        span = slice(start, start + positions)
        part, target, kept = h[:, span], targets[:, span], keep[:, span]
        logits = F.linear(part, weight)  # autocast's dtype, as head(h) gives it
        matmul_dtype, logits = logits.dtype, logits.float()  # fp32 for the softmax
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, target).squeeze(-1)
        losses[:, span] = torch.where(kept, lse - picked, 0.0)
        if grad_h is None and grad_w is None:
            continue
        # d loss / d logits = softmax - one-hot on kept tokens, made in the logits' memory.
        probs = logits.sub_(lse.unsqueeze(-1)).exp_()
        probs.scatter_add_(-1, target, -kept.unsqueeze(-1).to(probs.dtype))
        g = probs.mul_(kept.unsqueeze(-1)).to(part.dtype)
        del logits, probs
        if grad_h is not None:
            grad_h[:, span] = g @ weight.to(g.dtype)
        if grad_w is None:
            continue
        rows, columns = g.flatten(0, 1).T, part.flatten(0, 1)
        if grad_w.dtype == g.dtype == matmul_dtype:  # no autocast changes the matmul's dtype
            grad_w.addmm_(rows, columns)  # into the sum: no weight-sized temporary per chunk
        else:  # autocast's matmul dtype, then added to the parameter's, as autograd does
            grad_w += (rows @ columns).to(grad_w.dtype)
    return losses


class _HeadLoss(torch.autograd.Function):
    """`_head_losses` with its gradients made in the forward; the backward scales them by the
    weight each token's loss has in what is differentiated (the module docstring says why it
    must be one weight for all)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, positions: int
    ) -> torch.Tensor:
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        losses = _head_losses(h, weight, labels, positions, grad_h, grad_w)
        ctx.save_for_backward(grad_h, grad_w, labels != IGNORE)
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, keep = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * grad_losses.unsqueeze(-1).to(grad_h.dtype)
        if grad_w is not None:
            # One weight for every kept token, else NaN (loudly); no kept token: no gradient.
            low = torch.where(keep, grad_losses, torch.inf).amin()
            high = torch.where(keep, grad_losses, -torch.inf).amax()
            nan = torch.full_like(high, torch.nan)
            scale = torch.where(low == high, high, torch.where(keep.any(), nan, 0.0))
            grad_w = grad_w * scale.to(grad_w.dtype)
        return grad_h, grad_w, None, None


def token_losses(
    head: nn.Module, h: torch.Tensor, labels: torch.Tensor, chunk: int = CHUNK_TOKENS
) -> torch.Tensor:
    """Each token's cross-entropy (b, s), fp32, 0 where `labels` is IGNORE, of the logits
    `head(h)` for hidden states `h` (b, s, dim). Chunks span `chunk // b` positions (at least
    one) of every sample; `chunk = 0` computes the whole micro-batch at once. Through
    `_HeadLoss` where the head's weight is a plain tensor, else recomputed per chunk."""
    positions = labels.shape[1] if chunk == 0 else max(1, chunk // labels.shape[0])
    weight = getattr(head, "weight", None)
    # A plain tensor: a subclass (a tensor-parallel DTensor) computes its ops its own way.
    if isinstance(head, nn.Linear) and head.bias is None and type(weight) in _PLAIN:
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return _HeadLoss.apply(h, weight, labels, positions)
        return _head_losses(h, weight, labels, positions)  # validation, replay: no gradients
    if chunk == 0 or chunk >= labels.numel():  # one chunk: nothing to free, nothing to redo
        parts = [_chunk_losses(head, h, labels)]
    else:
        pairs = zip(h.split(positions, dim=1), labels.split(positions, dim=1), strict=True)
        parts = [
            checkpoint(
                _chunk_losses, head, part, target, use_reentrant=False, preserve_rng_state=False
            )
            for part, target in pairs
        ]
    # A new tensor even from one part, not a view: FSDP hooks the output of a forward, and
    # warns that an in-place op on a view would lose that hook.
    return torch.cat(parts, dim=1)


def whole(total: torch.Tensor) -> torch.Tensor:
    """A summed loss as a plain tensor: a vocabulary-parallel loss's sum (a DTensor) gathered."""
    gather = getattr(total, "full_tensor", None)
    return gather() if gather is not None else total


def mtp_inputs(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    depth: int,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a micro-batch's whole rows (b, s): the token each module k (1..depth) embeds at
    position i, t[i + k], and the one it predicts there, t[i + k + 1], stacked (b, s, depth)
    each. A target is IGNORE past the sample, where its own loss_mask is 0 (Megatron's rolled
    loss mask), and, under document masking (`documents`, (b, s)), where the token it embeds,
    t[i + k], lies in another document than position i: attention stays in i's document, and
    so do the module's inputs (Megatron's packed roll stops at a boundary too). t[s] is the
    last label: a sample holds s + 1 tokens. Made from whole rows, before context parallelism
    takes a rank's."""
    ids = torch.cat((tokens, labels[:, -1:]), dim=1)  # t[0..s]
    targets = labels.masked_fill(loss_mask == 0, IGNORE)
    pad_ids = torch.zeros_like(tokens[:, :1])
    pad_targets = torch.full_like(targets[:, :1], IGNORE)
    inputs, predicted = [], []
    for k in range(1, depth + 1):
        inputs.append(torch.cat((ids[:, k:], pad_ids.expand(-1, k - 1)), dim=1))
        ahead = torch.cat((targets[:, k:], pad_targets.expand(-1, k)), dim=1)
        if documents is not None:
            crossed = documents[:, k:] != documents[:, :-k]  # (b, s - k)
            ahead[:, : crossed.shape[1]] = ahead[:, : crossed.shape[1]].masked_fill(crossed, IGNORE)
        predicted.append(ahead)
    return torch.stack(inputs, dim=-1), torch.stack(predicted, dim=-1)
