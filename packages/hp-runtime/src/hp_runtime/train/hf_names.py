"""hp's tensor names as each transformers family's checkpoints spell them (`hf_families.py`).

hp stacks a layer's experts (`experts.w1`: (experts, hidden, dim)). HF checkpoints hold one
tensor per expert (`mlp.experts.{e}.gate_proj.weight`; Mixtral's
`block_sparse_moe.experts.{e}.w1.weight`), which is what `save_pretrained` writes in
transformers 4 and 5; transformers 5's models hold them fused (`mlp.experts.gate_up_proj`:
(experts, 2 hidden, dim), the gate's rows first, and `mlp.experts.down_proj`) and load either
layout. `hf_names` gives both.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import torch

from hp_runtime.model import ModelConfig
from hp_runtime.train.hf_families import Family

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# A layer's tensors outside its feed-forward, in every family.
_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Latent attention's, as DeepSeek-V3's checkpoints name them (hp's names are torchtitan's).
_MLA = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
# A multi-token prediction module's own tensors (`layers.{n_layers + k}`), as DeepSeek-V3's
# checkpoints hold its MTP layers; they also hold copies of the embedding and the head there
# (`MTP_COPIES`), which hp shares with the model.
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "head_norm.weight": "shared_head.norm.weight",
}
MTP_COPIES = {
    "embed_tokens.weight": "tok_embeddings.weight",
    "shared_head.head.weight": "output.weight",
}
# A SwiGLU's weights as HF's MLPs name them (dense layers, shared experts, Qwen's experts).
_SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
STACKED = re.compile(r"layers\.\d+\.feed_forward\.experts\.w[123]")  # (experts, ...)


def hf_names(family: Family, config: ModelConfig, name: str, fused: bool = False) -> list[str]:
    """hp's tensor `name` in `family`'s checkpoints: one HF name, or one per expert for hp's
    stacked experts (in order); with `fused`, transformers 5's fused expert tensor (w1 and w3
    both in `gate_up_proj`). Empty: the family has no such tensor (hp's balancing bias in a
    family without one: `export_family` saw it chooses nothing)."""
    if name in _TOP:
        return [_TOP[name]]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None:
        raise KeyError(f"no HF name for {name}")
    layer, rest = f"model.layers.{match.group(1)}.", match.group(2)
    if rest in _MTP:
        return [layer + _MTP[rest]]
    if config.mla is not None and rest in _MLA:
        return [layer + _MLA[rest]]
    if rest in _ATTENTION:
        return [layer + _ATTENTION[rest]]
    part = re.fullmatch(r"feed_forward\.(w[123])\.weight", rest)
    if part:
        return [f"{layer}mlp.{_SWIGLU[part.group(1)]}.weight"]
    block = layer + ("mlp" if fused else family.moe_block)
    if rest == "feed_forward.router.gate.weight":
        return [f"{block}.gate.weight"]
    if rest == "feed_forward.router.expert_bias":
        return [f"{block}.gate.e_score_correction_bias"] if family.bias else []
    part = re.fullmatch(r"feed_forward\.shared\.(w[123])\.weight", rest)
    if part:
        return [f"{block}.shared_experts.{_SWIGLU[part.group(1)]}.weight"]
    part = re.fullmatch(r"feed_forward\.experts\.(w[123])", rest)
    if part and config.moe is not None:
        if fused:
            return [f"{block}.experts.{'down_proj' if part.group(1) == 'w2' else 'gate_up_proj'}"]
        local = family.expert_parts[("w1", "w3", "w2").index(part.group(1))]
        return [f"{block}.experts.{e}.{local}.weight" for e in range(config.moe.experts)]
    raise KeyError(f"no HF name for {name}")


def is_fused(names: Collection[str], name: str) -> bool:
    """Whether hp's `name` is in a layer whose experts `names` (an HF checkpoint's) hold
    fused, as transformers 5's models do."""
    match = re.match(r"layers\.(\d+)\.feed_forward\.", name)
    if match is None:
        return False
    block = f"model.layers.{match.group(1)}.mlp.experts"
    return f"{block}.gate_up_proj" in names or f"{block}.down_proj" in names


def rope_rows(config: ModelConfig, name: str, to_hf: bool) -> torch.Tensor | None:
    """The row order taking hp's tensor `name` to DeepSeek's checkpoint (`to_hf`) or back;
    None where the rows keep their order. DeepSeek rotates interleaved pairs (x0, y0, x1, y1,
    ...) of a head's rotary columns, hp the halves (x0, x1, ..., y0, y1, ...), as transformers
    does (`rope_interleave`): the projections making those columns are reordered to match."""
    mla = config.mla
    if mla is None or not name.endswith(
        ("attention.wq.weight", "attention.wq_b.weight", "attention.wkv_a.weight")
    ):
        return None
    width, half = mla.qk_rope_head_dim, mla.qk_rope_head_dim // 2
    j = torch.arange(width)
    order = j // 2 + half * (j % 2) if to_hf else torch.cat([2 * j[:half], 2 * j[:half] + 1])
    if name.endswith("attention.wkv_a.weight"):
        return torch.cat([torch.arange(mla.kv_lora_rank), mla.kv_lora_rank + order])
    rows = torch.arange(config.n_heads * mla.qk_head_dim).view(config.n_heads, mla.qk_head_dim)
    rows[:, mla.qk_nope_head_dim :] = rows[:, mla.qk_nope_head_dim :][:, order]
    return rows.flatten()
