"""Latent attention (`model/mla.py`) on its own: packed documents stay apart under every
kernel (checked against each document run alone), its gradients through the padded kernel
equal a plain softmax written here, and a latent-attention table that cannot work is refused
before any rank starts. Its logits against transformers' DeepseekV3 are `test_hf_moe.py`'s."""

from __future__ import annotations

import math

import pytest
import torch
from hp_runtime.model.attention import Layout, document_ids
from hp_runtime.model.config import MLAConfig, ModelConfig, RopeScaling
from hp_runtime.model.mla import LatentAttention
from hp_runtime.model.rotary import rotary_tables

from tests.helpers.train import hp_train_here

YARN = RopeScaling("yarn", 4.0, original_max_seq_len=8, mscale=1.0, mscale_all_dim=0.8)
SHAPES = {
    "latent q, v wider": MLAConfig(16, 8, 4, 12, q_lora_rank=24),
    "full q, v narrower": MLAConfig(16, 8, 4, 6),
    "no nope part": MLAConfig(16, 0, 8, 8, q_lora_rank=12),
}


def _attention(mla: MLAConfig, seed: int = 0) -> tuple[LatentAttention, ModelConfig]:
    config = ModelConfig(dim=32, n_heads=4, n_kv_heads=4, max_seq_len=64, rope_scaling=YARN,
                         attention_kind="mla", mla=mla)  # fmt: skip
    torch.manual_seed(seed)
    module = LatentAttention(config)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.ndim == 1 else 0.2) + (p.ndim == 1))
    return module, config


def _reference(module: LatentAttention, config: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """The paper's attention written out: q = [q_nope, rope(q_rope)], k = [k_nope,
    rope(k_rope)] with k_rope one for all heads, softmax(q·k · scale) v, causal; no padding."""
    mla, (b, s, _) = config.mla, x.shape
    assert mla is not None
    q = module.wq(x) if module.wq is not None else module.wq_b(module.q_norm(module.wq_a(x)))
    q = q.view(b, s, -1, mla.qk_head_dim)
    latent, k_rope = module.wkv_a(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
    kv = module.wkv_b(module.kv_norm(latent)).view(b, s, -1, mla.qk_nope_head_dim + mla.v_head_dim)
    k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], -1)
    cos, sin = rotary_tables(config)[:, :s]

    def rope(t: torch.Tensor) -> torch.Tensor:  # halves (x, y) rotated by position
        a, c = t.chunk(2, -1)
        cs, sn = cos[None, :, None], sin[None, :, None]
        return torch.cat((a * cs - c * sn, a * sn + c * cs), -1)

    q = torch.cat((q[..., : mla.qk_nope_head_dim], rope(q[..., mla.qk_nope_head_dim :])), -1)
    k_rope = rope(k_rope.unsqueeze(2)).expand(-1, -1, q.shape[2], -1)
    k = torch.cat((k_nope, k_rope), -1)
    scale = mla.qk_head_dim**-0.5 * (0.1 * 0.8 * math.log(4.0) + 1) ** 2  # DeepSeek's mscale²
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)
    return module.wo(out.reshape(b, s, -1))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_padded_kernel_equals_the_softmax_written_out(shape):
    """Outputs and every parameter's gradient: padding v (or q, k) with zeros and scaling q
    for the kernel's own 1/√width change nothing."""
    module, config = _attention(SHAPES[shape])
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    ours = module(x, rotary_tables(config), Layout(mode="sdpa"))
    ours.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    theirs = _reference(module, config, x)
    theirs.square().sum().backward()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("mode", ["sdpa", "segments", "flex"])
def test_packed_documents_attend_alone_under_every_kernel(mode):
    """Three documents packed into a row (position ids restarting at 0), each as if it ran
    alone: the rule `attention.py` states, with MLA's shared rotated key."""
    module, config = _attention(SHAPES["latent q, v wider"])
    lengths = [5, 9, 6]
    x = torch.randn(1, sum(lengths), 32, generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    layout = Layout(mode=mode, positions=positions, documents=document_ids(positions))
    with torch.no_grad():  # flex on CPU: forward only
        packed = module(x, rotary_tables(config), layout)
        alone = torch.cat([module(part, rotary_tables(config), Layout(mode=mode))
                           for part in x.split(lengths, dim=1)], dim=1)  # fmt: skip
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.mla.qk_rope_head_dim=7", "model.mla.qk_rope_head_dim: must be even for rotary, "
         "got 7"),
        ("model.mla.kv_lora_rank=0", "model.mla.kv_lora_rank: must be from 1 to 2**31 - 1, "
         "got 0"),
        ("model.mla.q_lora_rank=0", "model.mla.q_lora_rank: must be from 1 to 2**31 - 1, got 0"),
        ("model.mla.qk_nope_head_dim=-1", "model.mla.qk_nope_head_dim: must be from 0 to "
         "2**31 - 1, got -1"),
        ("model.mla.v_head_dim=2.5", "model.mla.v_head_dim: expected an integer, got 2.5 (float)"),
        ("model.mla.q_rank=8", "model.mla.q_rank: unknown field; did you mean "
         "model.mla.q_lora_rank? its fields: q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
         "qk_rope_head_dim, v_head_dim"),
        ("model.attention_kind=gqa", 'model: mla is set, but attention_kind="gqa"; set '
         'attention_kind="mla", or mla = "none" for grouped-query attention'),
        ("model.n_kv_heads=2", 'model: n_kv_heads=2 with attention_kind="mla": latent '
         "attention's shapes are mla's; set n_kv_heads = n_heads=4"),
        ("model.qk_norm=true", 'model: qk_norm=True with attention_kind="mla": latent '
         "attention's shapes are mla's; set qk_norm = false"),
        ("model.mla=none", 'model: attention_kind="mla" needs mla = {kv_lora_rank, ...}'),
    ],
)  # fmt: skip
def test_a_latent_attention_table_that_cannot_work_is_refused_before_any_rank(
    tmp_path, override, message
):
    """Through hp-train with two ranks asked for: one line naming the field, exit 2 (a bad
    config, as every config error), and no
    run directory (nothing started)."""
    run = tmp_path / "run"
    done = hp_train_here("model.preset=deepseek-v3-tiny", "data.type=dummy", "train.steps=1",
                         "data.seq_length=32", "parallel.dp_shard=2", f"train.run_dir={run}",
                         override)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"hp-train: error: {message}"]
    assert not run.exists()
