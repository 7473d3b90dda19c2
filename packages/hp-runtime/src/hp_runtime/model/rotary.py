"""Rotary position embedding: the frequencies under a scaling (llama3, YaRN), their cos and
sin tables, and the rotation of q and k."""

from __future__ import annotations

import math

import torch

from hp_runtime.model.attention import Layout
from hp_runtime.model.config import ModelConfig, RopeScaling


def inverse_frequencies(
    config: ModelConfig, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The (rope_dim/2,) rotary frequencies under the config's scaling: llama3's (Meta's
    `apply_scaling` of Llama 3.1, elementwise: long wavelengths slowed `factor` times, short
    ones kept, the band between interpolated) or YaRN's (transformers' `_compute_yarn_parameters`:
    a linear ramp, over the frequency index, from interpolated to kept)."""
    half = config.rope_dim // 2
    exponents = torch.arange(0, half, device=device, dtype=dtype) / half
    powers = config.rope_theta**exponents
    inv_freq = 1.0 / powers
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.type == "yarn":
        return _yarn(powers, scaling, config.rope_theta, config.rope_dim)
    assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
    wavelength = 2 * math.pi / inv_freq
    old = scaling.original_max_seq_len
    smooth = (old / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    between = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    slowed = torch.where(
        wavelength > old / scaling.low_freq_factor, inv_freq / scaling.factor, between
    )
    return torch.where(wavelength < old / scaling.high_freq_factor, inv_freq, slowed)


def _yarn(powers: torch.Tensor, scaling: RopeScaling, theta: float, dim: int) -> torch.Tensor:
    """YaRN: index i of the frequencies keeps its own (turns more than beta_fast times over
    the original length), is divided by `factor` (fewer than beta_slow), or a linear mix
    between, the bounds being the indices where those turn counts fall, rounded outwards."""

    def index(turns: float) -> float:  # the (fractional) index turning `turns` times
        return (
            dim
            * math.log(scaling.original_max_seq_len / (turns * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(index(scaling.fast_rotations)), 0)
    high = min(math.ceil(index(scaling.slow_rotations)), dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)
    kept = (1 - ramp.clamp(0, 1)).to(powers.device)
    return 1.0 / (scaling.factor * powers) * (1 - kept) + 1.0 / powers * kept


def rotary_tables(config: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin for every position up to max_seq_len, stacked: (2, max_seq_len, rope_dim/2),
    times YaRN's attention factor where it scales."""
    inv_freq = inverse_frequencies(config, device)
    angles = torch.outer(torch.arange(config.max_seq_len, device=device).float(), inv_freq)
    tables = torch.stack((angles.cos(), angles.sin()))
    factor = 1.0 if config.rope_scaling is None else config.rope_scaling.attention_factor()
    return tables if factor == 1.0 else tables * factor


def apply_rotary(x: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of x (b, s, heads, head_dim) by position."""
    cos = tables[0][positions].unsqueeze(2)  # (b, s, 1, half)
    sin = tables[1][positions].unsqueeze(2)
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.type_as(x)


def positions_of(layout: Layout, seq: int, device: torch.device) -> torch.Tensor:
    """The positions rotating q and k: the layout's, else counted here, where the sequence is
    whole (after SP gathers): its rows, or 0..seq-1."""
    if layout.positions is not None:
        return layout.positions
    rows = layout.rows if layout.rows is not None else torch.arange(seq, device=device)
    return rows.unsqueeze(0)
