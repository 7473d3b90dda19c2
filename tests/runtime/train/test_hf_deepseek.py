"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) through init_from and export: what its config.json
may say and what hp refuses, its multi-token prediction layers left out as transformers leaves
them, a dense model and a full-rank query. The logits of a random transformers model and of an
export are `test_hf_moe.py`'s (the "deepseek_v3" family there)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from hp_runtime.model import ModelConfig
from hp_runtime.model.config import MLAConfig

from tests.runtime.train.test_hf_moe import HP, TINY, TOKENS, _config, _randomise, _read

transformers = pytest.importorskip("transformers")

DENSE_FULL_Q = {**TINY, "n_kv_heads": 4, "attention_kind": "mla", "mla": MLAConfig(16, 8, 4, 6)}
NOT = "is not supported; "


def _model(config: ModelConfig, seed: int = 3):
    from hp_runtime.model import Transformer

    model = Transformer(config)
    _randomise(model.state_dict(keep_vars=True).items(), seed)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_a_dense_mla_model_with_a_full_rank_query_exports_and_reads_back(tmp_path, tied):
    """No MoE layer (first_k_dense_replace covers them all), q_proj instead of the latent,
    v narrower than q, plain rotary: transformers' logits, and init_from gives the tensors."""
    from hp_runtime.model import Transformer
    from hp_runtime.train.hf import check_hf_config, init_from_hf, write_hf

    config = ModelConfig(**DENSE_FULL_Q, tie_embeddings=tied)
    model = _model(config)
    state = {name: t.detach() for name, t in model.state_dict().items()}
    write_hf(state, config, str(tmp_path), "float32")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["first_k_dense_replace"] == 2 and written["q_lora_rank"] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        np.testing.assert_allclose(hf(TOKENS).logits.numpy(), model(TOKENS).numpy(), atol=1e-4)
    check_hf_config(config, str(tmp_path))
    assert _read(tmp_path, written) == {
        **{k: getattr(config, k) for k in ("vocab_size", "dim", "n_layers", "n_heads",
                                           "n_kv_heads", "max_seq_len", "norm_eps",
                                           "tie_embeddings", "rope_theta", "rope_scaling",
                                           "qk_norm", "moe", "attention_kind", "mla",
                                           "ffn_hidden")},
    }  # fmt: skip
    again = Transformer(config)
    init_from_hf([again], config, str(tmp_path))
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_rotary_rows_are_deepseeks_interleaved_pairs(tmp_path):
    """The checkpoint's rows are DeepSeek's layout, not hp's: written with rope_interleave
    false (transformers then rotates halves, as hp does) the same tensors give other logits."""
    from hp_runtime.train.hf import write_hf

    config = _config("deepseek_v3")
    model = _model(config)
    write_hf(model.state_dict(), config, str(tmp_path), "float32")
    hp_logits = model(TOKENS).detach().numpy()
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "rope_interleave": False}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert np.abs(hf(TOKENS).logits.numpy() - hp_logits).max() > 1e-3


def test_multi_token_prediction_layers_are_left_out_as_transformers_leaves_them(tmp_path):
    """DeepSeek-V3's checkpoints hold its MTP module as the layer after the last
    (num_nextn_predict_layers): init_from takes the model's layers and leaves those, as
    transformers' model does; any other tensor hp has no place for is still refused."""
    from hp_runtime.model import Transformer
    from hp_runtime.train.hf import init_from_hf, write_hf
    from hp_runtime.train.launch import TrainError
    from safetensors.torch import load_file, save_file

    config = _config("deepseek_v3")
    model = _model(config)
    write_hf(model.state_dict(), config, str(tmp_path), "float32")
    weights = load_file(tmp_path / "model.safetensors")
    mtp = {
        k.replace("layers.1.", "layers.2."): v.clone()
        for k, v in weights.items()
        if "layers.1." in k
    }
    mtp["model.layers.2.eh_proj.weight"] = torch.zeros(32, 64)
    save_file({**weights, **mtp}, tmp_path / "model.safetensors")
    written = json.loads((tmp_path / "config.json").read_text())
    depth = {"num_nextn_predict_layers": 1, "num_mtp_layers": 1}  # as DeepSeek's say it
    (tmp_path / "config.json").write_text(json.dumps({**written, **depth}))
    again = Transformer(config)
    init_from_hf([again], config, str(tmp_path))
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    save_file({**weights, "model.layers.1.self_attn.q_a_proj.bias": torch.zeros(24)},
              tmp_path / "model.safetensors")  # fmt: skip
    with pytest.raises(TrainError, match="has no place for: model.layers.1.self_attn.q_a_proj"):
        init_from_hf([Transformer(config)], config, str(tmp_path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_interleave": False}, f"rope_interleave=false {NOT}hp's DeepSeek-V3 has "
         "rope_interleave=true only"),
        ({"qk_rope_head_dim": 5}, "qk_rope_head_dim=5 must be even for rotary"),
        ({"kv_lora_rank": 0}, "kv_lora_rank=0 must be an integer of at least 1"),
        ({"q_lora_rank": 0}, "q_lora_rank=0 must be an integer of at least 1"),
        ({"v_head_dim": "12"}, 'v_head_dim="12" must be an integer of at least 1'),
        ({"qk_head_dim": 16}, "qk_head_dim=16 is not qk_nope_head_dim + qk_rope_head_dim = 12"),
        ({"attention_bias": True}, f"attention_bias=true {NOT}hp's DeepSeek-V3 has "
         "attention_bias=false only"),
        ({"n_group": 3}, "n_group=3 must divide experts=8"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 8, "truncate": False}},
         "rope_parameters.truncate=false is not supported; hp's YaRN rounds its ramp's bounds "
         "outwards (truncate true)"),
    ],
)  # fmt: skip
def test_init_from_refuses_a_deepseek_config_hp_cannot_represent(tmp_path, change, message):
    from hp_runtime.train.hf import write_hf
    from hp_runtime.train.launch import TrainError

    write_hf(_model(_config("deepseek_v3")).state_dict(), _config("deepseek_v3"),
             str(tmp_path / "hf"), "float32")  # fmt: skip
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    written.pop("rope_scaling")  # transformers 5's field alone, so a change is the only one
    with pytest.raises(TrainError) as error:
        _read(tmp_path, {**written, **change})
    assert str(error.value) == f"{tmp_path / 'config.json'}: {message}"


def test_export_refuses_latent_attention_with_the_softmax_router(tmp_path):
    from hp_runtime.train.hf import write_hf
    from hp_runtime.train.launch import TrainError

    moe = dataclasses.replace(HP["deepseek_v3"]["moe"], router="softmax", groups=1,
                              topk_groups=1, route_scale=1.0, load_balance="aux_loss")  # fmt: skip
    config = ModelConfig(**{**TINY, **HP["deepseek_v3"], "moe": moe})
    with pytest.raises(TrainError) as error:
        write_hf({}, config, str(tmp_path / "hf"))
    assert str(error.value) == (
        'model.moe.router = "softmax" with model.attention_kind = "mla" is in no transformers '
        'family (DeepSeek-V3 routes by sigmoid); set router = "sigmoid"'
    )
    assert not (tmp_path / "hf").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize(
    "name", ["deepseek-v3-tiny", "moonlight-16b-a3b", "deepseek-v3-671b", "kimi-k2-1t"]
)
def test_presets_count_the_parameters_of_transformers_models(name):
    """Each preset's total and active parameters, with and without its MTP module, against
    transformers' DeepseekV3ForCausalLM built from the config.json hp writes, on the meta
    device: the model's own; with MTP, one more of transformers' decoder layers (a MoE one,
    its index after the model's), its three norms and its 2·dim x dim projection. Active: a
    token uses top_k of a MoE layer's routed experts."""
    from hp_runtime.model import PRESETS
    from hp_runtime.train.hf_config import config_json
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config = PRESETS[name]
    written = config_json(config, "bfloat16")
    hf = transformers.DeepseekV3Config(**{k: v for k, v in written.items()
                                          if k not in ("architectures", "model_type")})  # fmt: skip
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(hf)
        extra = [DeepseekV3DecoderLayer(hf, layer_idx=hf.num_hidden_layers + k)
                 for k in range(config.mtp.depth if config.mtp else 0)]  # fmt: skip
    moe = config.moe

    def counts(modules) -> tuple[int, int]:
        total = active = 0
        for module in modules:
            for pname, p in module.named_parameters():
                total += p.numel()
                routed = "mlp.experts." in pname and "shared" not in pname
                active += p.numel() * moe.top_k // moe.experts if routed else p.numel()
        return total, active

    total, active = counts([model])
    assert config.num_params(mtp=False) == total
    assert config.num_params(mtp=False, active=True) == active
    more_total, more_active = counts(extra)
    dim = config.dim
    own = len(extra) * (2 * dim * dim + 3 * dim)  # eh_proj, enorm, hnorm, shared_head.norm
    assert config.num_params() == total + more_total + own
    assert config.num_params(active=True) == active + more_active + own
    if name == "deepseek-v3-671b":  # DeepSeek's own figures: 671B total, 37B active
        assert round(total / 1e9) == 671 and round(active / 1e9) in (37, 38)
