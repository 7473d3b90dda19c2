"""Multi-head latent attention (DeepSeek-V2/V3): keys and values through a low-rank latent,
a rotated part of each query and key apart from the rest. Like `Attention`, it knows nothing
about parallelism: head counts come from the local shapes of `wq`/`wq_b` and `wkv_b`."""

from __future__ import annotations

import math

import torch
from torch import nn

from hp_runtime.model.attention import Layout, attend
from hp_runtime.model.config import ModelConfig
from hp_runtime.model.norm import RMSNorm
from hp_runtime.model.rotary import apply_rotary, positions_of

# DeepSeek's latent norms keep their own epsilon whatever the model's (its reference code and
# transformers' DeepseekV3Attention both build them with the default 1e-6).
LATENT_EPS = 1e-6


class LatentAttention(nn.Module):
    """q = wq(x) or wq_b(q_norm(wq_a(x))); [latent, k_rope] = wkv_a(x); [k_nope, v] =
    wkv_b(kv_norm(latent)); each head attends with q = [q_nope, rotary(q_rope)] and k =
    [k_nope, rotary(k_rope)] (k_rope one for all heads), softmax scaled by qk_head_dim^-½
    times YaRN's mscale² (`RopeScaling.softmax_factor`).

    The kernels (`attention.attend`) take one width for q, k and v and scale by the q width's
    -½ power: v is padded with zeros to the q width (and q, k to v's where v is wider), the
    output cut back, and q multiplied so the kernel's scale gives DeepSeek's. Zeros add
    nothing to a dot product or to a weighted sum, so this is exact."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.nope, self.rope, self.v_dim = (
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
        )
        self.kv_rank = mla.kv_lora_rank
        heads, q_width = config.n_heads, config.n_heads * mla.qk_head_dim
        self.wq = self.wq_a = self.q_norm = self.wq_b = None
        if mla.q_lora_rank is None:
            self.wq = nn.Linear(config.dim, q_width, bias=False)
        else:
            self.wq_a = nn.Linear(config.dim, mla.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(mla.q_lora_rank, LATENT_EPS)
            self.wq_b = nn.Linear(mla.q_lora_rank, q_width, bias=False)
        self.wkv_a = nn.Linear(config.dim, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, config.dim, bias=False)
        scaling = config.rope_scaling
        self.softmax_scale = mla.qk_head_dim**-0.5 * (
            1.0 if scaling is None else scaling.softmax_factor()
        )
        self.kernel = attend  # context parallelism wraps it, as `Attention.kernel`

    def forward(self, x: torch.Tensor, tables: torch.Tensor, layout: Layout) -> torch.Tensor:
        batch, seq = x.shape[:2]
        if self.wq is not None:
            q = self.wq(x)
        else:
            assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(batch, seq, -1, self.nope + self.rope)
        heads = q.shape[2]
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        positions = positions_of(layout, seq, x.device)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = apply_rotary(q_rope, tables, positions)
        k_rope = apply_rotary(k_rope.unsqueeze(2), tables, positions)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, heads, -1)), dim=-1)
        width = max(self.nope + self.rope, self.v_dim)
        q, k, v = (_pad(t, width) for t in (q, k, v))
        q = q * (self.softmax_scale * math.sqrt(width))  # the kernel divides by √width
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout)
        out = out.transpose(1, 2)[..., : self.v_dim]
        return self.wo(out.reshape(batch, seq, -1))


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (..., d) with zeros to `width` columns (x itself where it is that wide)."""
    return x if x.shape[-1] == width else nn.functional.pad(x, (0, width - x.shape[-1]))
