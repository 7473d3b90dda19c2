"""Cross-entropy of the output head, a chunk of the sequence at a time.

At a 128k vocabulary the fp32 logits of one 8k-token sample are 4 GiB, and a plain
`F.cross_entropy(head(h).float(), ...)` keeps them, and the log-softmax beside them, from the
forward to the backward. Here the head and the loss run on `chunk` tokens at a time, each chunk
under activation checkpointing: its logits are freed after its forward and recomputed in its
backward, so only one chunk's logits (upcast to fp32 for the softmax) exist at once. The values
and gradients are those of the whole-sequence computation; the head's matmul runs twice.

The head is called as a module, once per chunk, inside the model's forward: the plans that act
on it (a tensor-parallel head, vocabulary-sharded logits under `loss_parallel`, FSDP's gathered
weight) see an ordinary call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hp_runtime.model.config import CHUNK_TOKENS  # there, torch-free, for the trainer's config

IGNORE = -100  # the label of a token without loss (F.cross_entropy's default ignore_index)


def _chunk_losses(head: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(h).float()  # bf16 under autocast or bf16 parameters: fp32 for the softmax
    losses = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE
    )
    return losses.view(labels.shape)


def token_losses(
    head: nn.Module, h: torch.Tensor, labels: torch.Tensor, chunk: int = CHUNK_TOKENS
) -> torch.Tensor:
    """Each token's cross-entropy (b, s), fp32, 0 where `labels` is IGNORE, of the logits
    `head(h)` for hidden states `h` (b, s, dim). Chunks span `chunk // b` positions (at least
    one) of every sample; `chunk = 0`, or a chunk that holds the whole micro-batch, computes
    it at once, without recompute."""
    if chunk == 0 or chunk >= labels.numel():  # one chunk: nothing to free, nothing to redo
        parts = [_chunk_losses(head, h, labels)]
    else:
        positions = max(1, chunk // labels.shape[0])
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
