"""hp-train of the `deepseek-v3-tiny` preset (latent attention with a query latent, YaRN with
DeepSeek's softmax factor, a dense first layer, group-limited sigmoid routing over shared and
routed experts, the balancing bias, one multi-token prediction module) on one process, against
a plain loop over transformers' own DeepseekV3ForCausalLM started from the same weights, its
MTP module written here from the paper's definition around transformers' decoder layer:
torch's AdamW and clipping, the bias moved as DeepSeek-V3's paper states, on the same samples,
for 20 steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.train import records
from tests.runtime.train.test_moe_train import _train

transformers = pytest.importorskip("transformers")

STEPS, MICRO, GLOBAL, SEQ, LR, RATE = 20, 2, 4, 32, 1e-3, 0.01
RUN = [
    "model.preset=deepseek-v3-tiny", "data.type=dummy", f"data.seq_length={SEQ}",
    "data.split=90,10,0", f"train.steps={STEPS}", f"train.micro_batch_size={MICRO}",
    f"train.global_batch_size={GLOBAL}", "train.max_norm=1.0", f"optim.lr={LR}",
    "optim.decay_style=constant", "optim.weight_decay=0", f"model.moe.bias_update_rate={RATE}",
    "metrics.log_interval=1",
]  # fmt: skip


class _MTP(torch.nn.Module):
    """DeepSeek-V3's MTP module 1 as its paper defines it, around transformers' own decoder
    layer: h'_i = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)] (the order of its checkpoints'
    `eh_proj`), h = TRM(h'), P_{i+2} = OutHead(RMSNorm(h)) with the model's embedding and
    head, h_i the model's last hidden state as transformers hands it to its MTP layers (after
    the final norm); loaded from the export's `model.layers.3.*`."""

    def __init__(self, hf, tensors: dict[str, torch.Tensor]) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        super().__init__()
        config, dim = hf.config, hf.config.hidden_size
        self.enorm = DeepseekV3RMSNorm(dim, config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(dim, config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * dim, dim, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.norm = DeepseekV3RMSNorm(dim, config.rms_norm_eps)
        prefix = f"model.layers.{config.num_hidden_layers}."
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        state = {("norm." + k[len("shared_head.norm."):] if k.startswith("shared_head.norm.")
                  else k if k.split(".")[0] in ("enorm", "hnorm", "eh_proj") else "block." + k): v
                 for k, v in state.items()
                 if not k.startswith(("embed_tokens", "shared_head.head"))}  # fmt: skip
        experts = "block.mlp.experts"  # one tensor an expert, fused as transformers 5 holds them
        count = len({k.split(".")[3] for k in state if k.startswith(experts + ".")})
        for part in ("gate_proj", "up_proj", "down_proj"):
            state[f"{experts}.{part}"] = torch.stack(
                [state.pop(f"{experts}.{e}.{part}.weight") for e in range(count)]
            )
        state[f"{experts}.gate_up_proj"] = torch.cat(
            (state.pop(f"{experts}.gate_proj"), state.pop(f"{experts}.up_proj")), dim=1
        )
        self.load_state_dict(state, strict=True)

    def forward(self, hf, h: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(hf.model.embed_tokens(ahead)), self.hnorm(h)), -1))
        positions = torch.arange(x.shape[1])[None]
        cos_sin = hf.model.rotary_emb(x, positions)
        x = self.block(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return hf.lm_head(self.norm(x))


def _reference(directory: str) -> dict[str, Any]:
    """The plain loop: transformers' model from hp's initial weights (exported), each step's
    loss the mean cross-entropy of its tokens plus 0.3 times the MTP module's (t_{i+2} from
    position i, over the same T tokens' count, as the paper's 1/T), AdamW (hp's defaults:
    betas 0.9, 0.95), the gradient clipped to 1, then each MoE layer's (the MTP module's
    too) e_score_correction_bias moved by RATE towards the mean load."""
    from hp_data.registry import DatasetConfig, build_dataset
    from hp_runtime.model import Transformer, preset
    from hp_runtime.parallel.init import init_weights
    from hp_runtime.train.hf import write_hf
    from safetensors.torch import load_file

    config = preset("deepseek-v3-tiny")
    assert config.mtp is not None and config.mtp.depth == 1 and config.mtp.loss_weight == 0.3
    model = Transformer(config)
    init_weights(model, seed=0)  # train.seed's initial weights
    write_hf(model.state_dict(), config, directory, "float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="sdpa"
    )
    mtp = _MTP(hf, load_file(f"{directory}/model.safetensors"))
    hf.train(), mtp.train()
    last: list[torch.Tensor] = []  # the model's last hidden state (its final norm's output)
    hf.model.norm.register_forward_hook(lambda _, __, out: last.append(out))
    picked: dict[str, list[torch.Tensor]] = {}
    routers = {n: m for n, m in [*hf.named_modules(), *mtp.named_modules()]
               if n.endswith("mlp.gate")}  # fmt: skip
    for name, router in routers.items():
        router.register_forward_hook(
            lambda _, __, out, name=name: picked.setdefault(name, []).append(out[2])
        )
    samples = build_dataset(
        DatasetConfig(type="dummy", seq_length=SEQ, vocab_size=config.vocab_size,
                      split="90,10,0"), "train", STEPS * GLOBAL)  # fmt: skip
    params = [*hf.parameters(), *mtp.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0)
    ce = torch.nn.functional.cross_entropy
    out: dict[str, list[float]] = {"losses": [], "grad_norms": [], "mtp": []}
    for step in range(STEPS):
        main_total = mtp_total = 0.0
        picked.clear()
        for j in range(GLOBAL // MICRO):
            first = step * GLOBAL + j * MICRO
            rows = [samples[i] for i in range(first, first + MICRO)]
            inputs = torch.tensor(np.stack([r["tokens"] for r in rows]))
            labels = torch.tensor(np.stack([r["labels"] for r in rows]))
            last.clear()
            logits = hf(inputs).logits
            main = ce(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (GLOBAL * SEQ)
            # module 1 at position i embeds t_{i+1} = labels[i] and predicts labels[i + 1]:
            # a loss up to i = s - 2; at s - 1 it runs (t_s is in the sample: it is routed and
            # loads the experts) but has nothing to predict
            predicted = mtp(hf, last[0], labels)[:, :-1]
            extra = ce(predicted.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
            extra = extra / (GLOBAL * SEQ)
            (main + 0.3 * extra).backward()
            main_total += float(main.detach())
            mtp_total += float(extra.detach())
        out["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for name, router in routers.items():
                load = torch.bincount(torch.cat(picked[name]).reshape(-1), minlength=8).float()
                router.e_score_correction_bias += RATE * torch.sign(load.mean() - load)
        out["losses"].append(main_total)
        out["mtp"].append(mtp_total)
    return out


@pytest.mark.slow
def test_deepseek_v3_tiny_trains_like_transformers_and_adamw(tmp_path):
    got = run_ranks(_train, 1, [*RUN, f"train.run_dir={tmp_path / 'run'}"])[0]
    assert not got["skipped"]
    want = _reference(str(tmp_path / "hf"))
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-4, atol=0)
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=1e-4, atol=0)
    logged = records(tmp_path / "run")
    np.testing.assert_allclose([r["mtp_loss"] for r in logged], want["mtp"], rtol=1e-4)
    moved = np.abs(np.diff(want["losses"])).max()
    assert moved > 1e-2  # the losses move 100x the tolerance: a changed update would show
