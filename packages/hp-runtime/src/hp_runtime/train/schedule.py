"""The learning rate as a pure function of the step: nothing to save, the same on resume.

Steps count from 1 (the first optimizer update). Linear warmup over `warmup_steps` (Megatron's
`lr * step / warmup_steps`), then over `decay_steps` (default: the rest of the run) one of:
`cosine` and `linear` decay to `min_lr`; `constant`; `wsd` (warmup-stable-decay) holds `lr` and
spends the last `wsd_decay_fraction` of the span decaying to `min_lr` with a `linear`, `cosine`
or `sqrt` (1 - sqrt) shape. Past the span the rate stays at `min_lr` (`lr` for constant).
"""

from __future__ import annotations

import math

from hp_runtime.train.config import OptimConfig


def _shape(name: str, progress: float) -> float:
    """How far the rate has come down, 0 → 1, at `progress` through a decay."""
    if name == "cosine":
        return 0.5 * (1 - math.cos(math.pi * progress))
    if name == "sqrt":
        return math.sqrt(progress)
    return progress  # linear


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (1-based) of a `total_steps` run."""
    peak, floor, warmup = optim.lr, optim.min_lr, optim.warmup_steps
    if warmup and step <= warmup:
        return peak * step / warmup
    if optim.decay_style == "constant":
        return peak
    span = optim.decay_steps if optim.decay_steps is not None else max(total_steps - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if optim.decay_style == "wsd":
        stable = 1.0 - optim.wsd_decay_fraction
        if progress <= stable:
            return peak
        down = _shape(optim.wsd_decay_shape, (progress - stable) / optim.wsd_decay_fraction)
    else:
        down = _shape(optim.decay_style, progress)
    return peak - (peak - floor) * down
