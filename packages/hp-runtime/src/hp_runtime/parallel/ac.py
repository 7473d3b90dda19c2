"""Activation checkpointing: recompute blocks in backward instead of keeping activations.

`full` wraps every block; `selective` every k-th. Recomputation repeats the same ops on the
same inputs, so results match up to float noise (tested against a run without it).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    checkpoint_wrapper,
)

# What the wrapper adds to the names of the parameters inside (`parallelize.canonical_name`).
AC_NAME_PREFIX = _CHECKPOINT_PREFIX


def apply_ac(model: nn.Module, mode: str = "full", every: int = 2) -> None:
    """Wrap blocks of `model.layers` in place: all (`full`) or every `every`-th (`selective`)."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use 'full' or 'selective'")
    if every < 1:
        raise ValueError(f"every={every} must be at least 1")
    for position, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" or position % every == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
