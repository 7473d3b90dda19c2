"""hp-train of the `deepseek-v3-tiny` preset (latent attention with a query latent, YaRN with
DeepSeek's softmax factor, a dense first layer, group-limited sigmoid routing over shared and
routed experts, the balancing bias) on one process, against a plain loop over transformers'
own DeepseekV3ForCausalLM started from the same weights: torch's AdamW and clipping, the
bias moved as DeepSeek-V3's paper states, on the same samples, for 20 steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.runtime.train.test_moe_train import _train

transformers = pytest.importorskip("transformers")

STEPS, MICRO, GLOBAL, SEQ, LR, RATE = 20, 2, 4, 32, 3e-3, 0.01
RUN = [
    "model.preset=deepseek-v3-tiny", "data.type=dummy", f"data.seq_length={SEQ}",
    "data.split=90,10,0", f"train.steps={STEPS}", f"train.micro_batch_size={MICRO}",
    f"train.global_batch_size={GLOBAL}", "train.max_norm=1.0", f"optim.lr={LR}",
    "optim.decay_style=constant", "optim.weight_decay=0", f"model.moe.bias_update_rate={RATE}",
]  # fmt: skip


def _reference(directory: str) -> dict[str, Any]:
    """The plain loop: transformers' model from hp's initial weights (exported), each step's
    loss the mean cross-entropy of its tokens, AdamW (hp's defaults: betas 0.9, 0.95), the
    gradient clipped to 1, then each MoE layer's e_score_correction_bias moved by RATE towards
    the mean load: bias += RATE * sign(mean load - load)."""
    from hp_data.registry import DatasetConfig, build_dataset
    from hp_runtime.model import Transformer, preset
    from hp_runtime.parallel.init import init_weights
    from hp_runtime.train.hf import write_hf

    config = preset("deepseek-v3-tiny")
    model = Transformer(config)
    init_weights(model, seed=0)  # train.seed's initial weights
    write_hf(model.state_dict(), config, directory, "float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    hf.train()
    picked: dict[str, list[torch.Tensor]] = {}
    routers = {n: m for n, m in hf.named_modules() if n.endswith("mlp.gate")}
    for name, router in routers.items():
        router.register_forward_hook(
            lambda _, __, out, name=name: picked.setdefault(name, []).append(out[2])
        )
    samples = build_dataset(
        DatasetConfig(type="dummy", seq_length=SEQ, vocab_size=config.vocab_size,
                      split="90,10,0"), "train", STEPS * GLOBAL)  # fmt: skip
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        picked.clear()
        for j in range(GLOBAL // MICRO):
            rows = [
                samples[i]
                for i in range(step * GLOBAL + j * MICRO, step * GLOBAL + (j + 1) * MICRO)
            ]
            inputs = torch.tensor(np.stack([r["tokens"] for r in rows]))
            labels = torch.tensor(np.stack([r["labels"] for r in rows]))
            logits = hf(inputs).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
            ) / (GLOBAL * SEQ)
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for name, router in routers.items():
                load = torch.bincount(torch.cat(picked[name]).reshape(-1), minlength=8).float()
                router.e_score_correction_bias += RATE * torch.sign(load.mean() - load)
        losses.append(total)
    return {"losses": losses, "grad_norms": norms}


@pytest.mark.slow
def test_deepseek_v3_tiny_trains_like_transformers_and_adamw(tmp_path):
    got = run_ranks(_train, 1, [*RUN, f"train.run_dir={tmp_path / 'run'}"])[0]
    assert not got["skipped"]
    want = _reference(str(tmp_path / "hf"))
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-4, atol=0)
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=1e-4, atol=0)
    moved = np.abs(np.diff(want["losses"])).max()
    assert moved > 1e-2  # the losses move 100x the tolerance: a changed update would show
