"""Hugging Face interop of the MoE families (Mixtral, Qwen3-MoE, Dots1, GLM-4-MoE) and of
qk_norm (Qwen3), checked against transformers' own models: its logits, its config classes'
defaults, what its save_pretrained writes and what its models hold (fused experts)."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hp_runtime.model import ModelConfig
from hp_runtime.model.config import MLAConfig, MoEConfig, RopeScaling

from tests.helpers.distributed import run_ranks
from tests.helpers.train import FAST, hp_train_here, train_ranks

transformers = pytest.importorskip("transformers")

TINY = {
    "vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
    "ffn_hidden": 48, "max_seq_len": 32,
}  # fmt: skip
# Each family's hp config, exercising what it can say: renormalised or not, dense first
# layers, shared experts, a routing scale, the balancing bias, group-limited routing.
HP = {
    "mixtral": {"moe": MoEConfig(4, 2, 16)},
    "qwen3_moe": {"qk_norm": True, "moe": MoEConfig(4, 2, 16, renormalize=False,
                                                    first_dense_layers=1)},
    "dots1": {"qk_norm": True, "moe": MoEConfig(8, 2, 16, shared_experts=2, router="sigmoid",
                                                route_scale=2.5, first_dense_layers=1,
                                                load_balance="bias", groups=4,
                                                topk_groups=2)},
    "glm4_moe": {"moe": MoEConfig(4, 2, 16, shared_experts=1, router="sigmoid",
                                  renormalize=False)},
    "qwen3": {"qk_norm": True},
    # latent attention (q through its latent, v wider than q's nope part), YaRN with
    # DeepSeek's softmax factor, a dense first layer, group-limited sigmoid routing
    "deepseek_v3": {"n_kv_heads": 4, "attention_kind": "mla",
                    "mla": MLAConfig(16, 8, 4, 12, q_lora_rank=24),
                    "rope_scaling": RopeScaling("yarn", 4.0, original_max_seq_len=8, mscale=1.0,
                                                mscale_all_dim=0.8),
                    "moe": MoEConfig(8, 2, 16, shared_experts=1, router="sigmoid",
                                     route_scale=2.5, first_dense_layers=1,
                                     load_balance="bias", groups=4, topk_groups=2)},
}  # fmt: skip
ARCHITECTURE = {
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "dots1": "Dots1ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}  # fmt: skip
_COMMON = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip
# The same models as transformers' configs, written from its documented fields (not from
# hp's writer).
HF = {
    "mixtral": ("MixtralConfig", {"intermediate_size": 16, "num_local_experts": 4,
                                  "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"intermediate_size": 48, "moe_intermediate_size": 16,
                                     "num_experts": 4, "num_experts_per_tok": 2,
                                     "norm_topk_prob": False, "mlp_only_layers": [0],
                                     "head_dim": 8}),
    "dots1": ("Dots1Config", {"intermediate_size": 48, "moe_intermediate_size": 16,
                              "n_routed_experts": 8, "num_experts_per_tok": 2,
                              "n_group": 4, "topk_group": 2,
                              "n_shared_experts": 2, "routed_scaling_factor": 2.5,
                              "first_k_dense_replace": 1, "norm_topk_prob": True}),
    "glm4_moe": ("Glm4MoeConfig", {"intermediate_size": 48, "moe_intermediate_size": 16,
                                   "n_routed_experts": 4, "num_experts_per_tok": 2,
                                   "n_shared_experts": 1, "first_k_dense_replace": 0,
                                   "norm_topk_prob": False, "use_qk_norm": False,
                                   "partial_rotary_factor": 1.0}),
    "qwen3": ("Qwen3Config", {"intermediate_size": 48, "head_dim": 8}),
    "deepseek_v3": ("DeepseekV3Config", {
        "intermediate_size": 48, "moe_intermediate_size": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 12,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 8, "mscale": 1.0,
                            "mscale_all_dim": 0.8}}),
}  # fmt: skip
TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))


def _config(family: str) -> ModelConfig:
    return ModelConfig(**{**TINY, **HP[family]})


def _moe(family: str, **fields) -> ModelConfig:
    """The family's config with MoE `fields` changed."""
    moe = HP[family]["moe"]
    return ModelConfig(**{**TINY, **HP[family], "moe": dataclasses.replace(moe, **fields)})


def _randomise(named, seed: int) -> None:
    """Weights that make every part count: norms away from 1, a sharp router, a balancing
    bias of the size of the sigmoid scores' spread."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in named:
        std = 0.2 if tensor.ndim == 1 else 0.08
        if "gate.weight" in name or "router.gate" in name:
            std = 0.5
        if name.endswith(("expert_bias", "e_score_correction_bias")):
            std = 0.05
        with torch.no_grad():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)


def _hp_model(family: str, seed: int = 3):
    from hp_runtime.model import Transformer

    config = _config(family)
    model = Transformer(config)
    balanced = config.moe is not None and config.moe.load_balance == "bias"
    state = model.state_dict(keep_vars=True).items()  # under aux_loss the bias stays zero
    _randomise([(n, t) for n, t in state if balanced or not n.endswith("expert_bias")], seed)
    return model.eval(), config


def _hp_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(TOKENS).numpy()


def _hf_model(family: str, seed: int = 7):
    cls, fields = HF[family]
    config = getattr(transformers, cls)(**{**_COMMON, **copy.deepcopy(fields)})
    model = getattr(transformers, ARCHITECTURE[family])(config)
    moe = HP[family].get("moe")
    balanced = moe is not None and moe.load_balance == "bias"
    named = [*model.named_parameters(), *model.named_buffers()]
    named = [(n, t) for n, t in named if balanced or not n.endswith("e_score_correction_bias")]
    _randomise([(n, t) for n, t in named if "rotary" not in n], seed)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray]]:
    """Each family's random model as transformers saves it, and its logits. Read only."""
    out = {}
    for family in HF:
        directory = tmp_path_factory.mktemp(family)
        model = _hf_model(family)
        model.save_pretrained(directory)
        with torch.no_grad():
            out[family] = (directory, model(TOKENS).logits.numpy())
    return out


@pytest.mark.parametrize("family", list(HP))
def test_an_export_is_the_same_model_in_transformers(tmp_path, family):
    """hp's model written by export's writer, loaded by transformers as its family: the same
    logits; read back by init_from: the same tensors."""
    from hp_runtime.model import Transformer
    from hp_runtime.train.hf import check_hf_config, init_from_hf, write_hf

    model, config = _hp_model(family)
    state = {name: t.detach() for name, t in model.state_dict().items()}
    out = tmp_path / "hf"
    write_hf(state, config, str(out), "float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == ARCHITECTURE[family]
    with torch.no_grad():
        logits = hf(TOKENS).logits.numpy()
    np.testing.assert_allclose(logits, _hp_logits(model), atol=1e-4, rtol=0)
    check_hf_config(config, str(out))  # the config.json it wrote is this model's
    again = Transformer(config)
    init_from_hf([again], config, str(out))
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_the_balancing_bias_chooses_experts_in_the_export(tmp_path):
    """Dots1's e_score_correction_bias is hp's expert_bias: without it the choices, and the
    logits, differ (so the test above would fail if the bias were dropped); under aux_loss
    hp ignores the bias, and so does the export (zeros)."""
    from hp_runtime.train.hf import write_hf
    from safetensors.torch import load_file

    model, _ = _hp_model("dots1")
    with_bias = _hp_logits(model)
    for layer in model.layers.values():
        if hasattr(layer.feed_forward, "router"):
            layer.feed_forward.router.expert_bias.zero_()
    assert np.abs(_hp_logits(model) - with_bias).max() > 1e-2
    model, _ = _hp_model("dots1")
    aux = _moe("dots1", load_balance="aux_loss")
    write_hf(model.state_dict(), aux, str(tmp_path / "aux"), "bfloat16")
    written = load_file(tmp_path / "aux" / "model.safetensors")
    bias = written["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert not bias.any() and bias.dtype == torch.float32  # Dots1 keeps it, and the gate, fp32
    assert written["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert written["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16


def _fused(directory: Path, model, out: Path) -> Path:
    """`model`'s own tensors (transformers 5 holds experts fused: gate_up_proj, down_proj),
    saved as they are beside its config.json: a layout transformers 5 also loads."""
    from safetensors.torch import save_file

    out.mkdir()
    shutil.copy(directory / "config.json", out)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _init_logits(rank: int, world: int, directory: str, family: str) -> np.ndarray:
    from hp_runtime.parallel import ParallelDims, assemble
    from hp_runtime.train.hf import init_from_hf

    config = _config(family)
    dims = ParallelDims(dp_shard=world, ep=world)
    assembly = assemble(config, dims, torch.device("cpu"), seed=0)
    init_from_hf(assembly.modules, config, directory)
    assembly.model.eval()
    with torch.no_grad():
        return assembly.model(TOKENS).numpy()


@pytest.mark.parametrize("family", list(HF))
def test_init_from_a_transformers_model_gives_its_logits(hf_dirs, tmp_path, family):
    directory, reference = hf_dirs[family]
    saved = json.loads((directory / "config.json").read_text())
    assert saved["architectures"] == [ARCHITECTURE[family]]
    np.testing.assert_allclose(_init_logits(0, 1, str(directory), family), reference, atol=1e-4)
    if family in ("mixtral", "dots1"):  # the fused layout (Mixtral's block renamed as well)
        fused = _fused(directory, transformers.AutoModelForCausalLM.from_pretrained(directory),
                       tmp_path / "fused")  # fmt: skip
        assert "model.layers.1.mlp.experts.gate_up_proj" in _names(fused)
        np.testing.assert_allclose(_init_logits(0, 1, str(fused), family), reference, atol=1e-4)


def _names(directory: Path) -> set[str]:
    from safetensors.torch import load_file

    return set(load_file(directory / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_init_from_at_ep2_gives_the_transformers_logits(hf_dirs, family):
    """dp_shard 2 x ep 2: the experts split over the two ranks (parallel/ep.py), each rank's
    shard cut from the full tensors."""
    directory, reference = hf_dirs[family]
    for logits in run_ranks(_init_logits, 2, str(directory), family):
        np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


def _checkpoint_logits(directory: Path) -> np.ndarray:
    import tomllib

    import torch.distributed.checkpoint as dcp
    from hp_runtime.model import Transformer
    from hp_runtime.train.checkpoint_format import read_meta
    from hp_runtime.train.config import build_config

    config = build_config(tomllib.loads(read_meta(str(directory))["config"])).model
    model = Transformer(config)
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(directory), no_dist=True)
    model.load_state_dict(state)
    return _hp_logits(model.eval())


MOE_RUN = [
    *FAST, "data.type=dummy", "data.seq_length=16", "model.max_seq_len=32",
    "model.moe={experts = 4, top_k = 2, expert_ffn_hidden = 32}", "train.steps=2",
    "checkpoint.interval=2",
]  # fmt: skip


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory) -> Path:
    """2 steps of a tiny Mixtral-shaped model at dp_shard 2 x ep 2, a checkpoint at step 2.
    Read only."""
    run = tmp_path_factory.mktemp("ep2") / "run"
    train_ranks(2, [*MOE_RUN, "parallel.dp_shard=2", "parallel.ep=2", f"train.run_dir={run}"])
    return run


@pytest.mark.slow
def test_an_export_of_a_checkpoint_trained_at_ep2_loads_in_transformers(ep2_run, tmp_path):
    checkpoint = ep2_run / "checkpoints" / "step-0000002"
    out = tmp_path / "hf"
    done = hp_train_here("export", checkpoint, "--out", out, "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    hf = transformers.MixtralForCausalLM.from_pretrained(out)
    assert "model.layers.1.mlp.experts.gate_up_proj" in dict(hf.named_parameters())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in _names(out)
    with torch.no_grad():
        logits = hf(TOKENS).logits.numpy()
    np.testing.assert_allclose(logits, _checkpoint_logits(checkpoint), atol=1e-4, rtol=0)


# --- what transformers assumes, and a published config -------------------------------------

# mistralai/Mixtral-8x7B-v0.1's config.json, as on the Hub.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip


def _read(tmp_path: Path, config: dict) -> dict:
    from hp_runtime.train.hf import model_config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(config))
    return model_config_from_hf(str(tmp_path))


def test_init_from_reads_a_published_mixtral_config(tmp_path):
    fields = _read(tmp_path, MIXTRAL_8X7B)
    assert ModelConfig(**fields) == ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, max_seq_len=32768,
        rope_theta=1e6, norm_eps=1e-5, moe=MoEConfig(8, 2, 14336),
    )  # fmt: skip
    assert "ffn_hidden" not in fields  # every layer routed: no dense width to match


# The fields a config class defaults that shape hp's model: left out of a config.json.
DEFAULTED = {
    "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_parameters", "tie_word_embeddings", "head_dim", "norm_topk_prob",
    "routed_scaling_factor", "first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step",
    "n_group", "topk_group", "layer_types", "sliding_window", "max_window_layers",
    "use_sliding_window", "use_qk_norm",
}  # fmt: skip


@pytest.mark.parametrize("family", list(HF))
def test_a_config_json_without_defaults_reads_as_transformers_reads_it(hf_dirs, tmp_path, family):
    """The fields a config.json may leave out, as the family's own config class assumes."""
    written = json.loads((hf_dirs[family][0] / "config.json").read_text())
    bare = {k: v for k, v in written.items() if k not in DEFAULTED}
    if family == "glm4_moe":  # its default, 0.5, is refused (below)
        bare["partial_rotary_factor"] = 1.0
    cls = getattr(transformers, HF[family][0])
    reference = cls(**{k: v for k, v in bare.items() if k != "model_type"})
    fields = _read(tmp_path, bare)
    # Qwen3's head_dim defaults to 128, not hidden / heads: hp reads it as its own field.
    head_dim = getattr(reference, "head_dim", None)
    heads, dim = fields["n_heads"], fields["dim"]
    if family == "deepseek_v3":  # transformers' head_dim is MLA's rotated part
        assert fields.get("head_dim") is None and fields["mla"].qk_rope_head_dim == head_dim
    else:
        assert fields.get("head_dim") == (None if head_dim in (None, dim // heads) else head_dim)
    assert fields["max_seq_len"] == reference.max_position_embeddings
    assert fields["norm_eps"] == reference.rms_norm_eps
    assert fields["rope_theta"] == reference.rope_parameters["rope_theta"]
    wide = {k: v for k, v in bare.items() if k != "num_key_value_heads"}
    wide.update(num_attention_heads=64, hidden_size=512, head_dim=8)  # any default divides
    kv = cls(**{k: v for k, v in wide.items() if k != "model_type"}).num_key_value_heads
    if family == "deepseek_v3":  # MLA's k and v: a head for each query head, whatever it says
        kv = wide["num_attention_heads"]
    assert _read(tmp_path, wide)["n_kv_heads"] == kv
    assert fields["tie_embeddings"] == reference.tie_word_embeddings
    moe = fields["moe"]
    if moe is not None:  # the routing fields it defaults
        assert moe.renormalize == getattr(reference, "norm_topk_prob", True)
        assert moe.route_scale == getattr(reference, "routed_scaling_factor", 1.0)
        assert moe.first_dense_layers == getattr(
            reference, "first_k_dense_replace", len(getattr(reference, "mlp_only_layers", []))
        )


# --- refused, one line each ------------------------------------------------------------------

NOT = "is not supported; "


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than "
         "num_local_experts=4"),
        ("mixtral", {"num_local_experts": "4"}, 'num_local_experts="4" must be a positive '
         "integer"),
        ("mixtral", {"num_experts": 8}, "num_local_experts=4, num_experts=8 disagree; give one"),
        ("mixtral", {"sliding_window": 4096}, f"sliding_window=4096 {NOT}hp's Mixtral has "
         "sliding_window=null only"),
        ("mixtral", {"router_jitter_noise": 0.1}, f"router_jitter_noise=0.1 {NOT}hp's Mixtral "
         "has router_jitter_noise=0.0 only"),
        ("mixtral", {"num_local_experts": None}, "num_local_experts is missing; an HF Mixtral "
         "config.json gives it"),
        ("mixtral", {"architectures": ["Qwen3MoeForCausalLM"]}, 'architectures=['
         '"Qwen3MoeForCausalLM"]; hp loads MixtralForCausalLM'),
        ("qwen3_moe", {"decoder_sparse_step": 2}, f"decoder_sparse_step=2 {NOT}hp routes every "
         "layer after its first dense ones (model.moe.first_dense_layers), which is "
         "decoder_sparse_step 1"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, f"mlp_only_layers=[1] {NOT}hp's dense layers "
         "are the first k (mlp_only_layers = [0, 1, ..., k - 1], model.moe.first_dense_layers "
         "= k)"),
        ("qwen3_moe", {"norm_topk_prob": "yes"}, 'norm_topk_prob="yes" must be true or false'),
        ("qwen3_moe", {"use_sliding_window": True}, f"use_sliding_window=true {NOT}hp's "
         "Qwen3-MoE has use_sliding_window=false only"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 32}, "shared_expert_intermediate_size "
         "is not a field hp's Qwen3-MoE implements; hp loads plain Qwen3-MoE models only"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size is missing; an HF "
         "Qwen3-MoE config.json gives it"),
        ("dots1", {"n_group": 3}, "n_group=3 must divide experts=8"),
        ("dots1", {"topk_group": 5}, "topk_group=5 is more than groups=4"),
        ("dots1", {"routed_scaling_factor": -1}, "routed_scaling_factor=-1 must be a positive "
         "number"),
        ("dots1", {"n_shared_experts": 0}, "n_shared_experts=0 must be a positive integer"),
        ("dots1", {"first_k_dense_replace": 1.5}, "first_k_dense_replace=1.5 must be an integer "
         ">= 0"),
        ("dots1", {"layer_types": ["full_attention", "sliding_attention"]}, 'layer_types=['
         f'"full_attention", "sliding_attention"] {NOT}hp\'s attention is "full_attention" in '
         "each of the 2 layers (no sliding window)"),
        ("dots1", {"layer_types": None, "sliding_window": 8, "max_window_layers": 1},
         f"sliding_window=8 from max_window_layers=1 {NOT}hp's attention has no sliding window "
         "(set sliding_window to null)"),
        ("glm4_moe", {"partial_rotary_factor": 0.5}, f"partial_rotary_factor=0.5 {NOT}hp "
         "rotates the whole of each head (partial_rotary_factor 1.0)"),
        ("glm4_moe", {"attention_bias": True}, f"attention_bias=true {NOT}hp's GLM-4-MoE has "
         "attention_bias=false only"),
        ("qwen3", {"layer_types": ["sliding_attention"] * 2}, 'layer_types=["sliding_attention",'
         f' "sliding_attention"] {NOT}hp\'s attention is "full_attention" in each of the 2 '
         "layers (no sliding window)"),
    ],
)  # fmt: skip
def test_init_from_refuses_a_moe_config_hp_cannot_represent(
    hf_dirs, tmp_path, family, change, message
):
    from hp_runtime.train.launch import TrainError

    config = json.loads((hf_dirs[family][0] / "config.json").read_text())
    config = {k: v for k, v in {**config, **change}.items() if v is not None}
    with pytest.raises(TrainError) as error:
        _read(tmp_path, config)
    assert str(error.value) == f"{tmp_path / 'config.json'}: {message}"


@pytest.mark.parametrize(
    ("family", "config", "message"),
    [
        ("mixtral", _moe("mixtral", experts=8), "has moe.experts=4, the config "
         "model.moe.experts=8; set model.moe.experts = 4"),
        ("mixtral", _moe("mixtral", top_k=1), "has moe.top_k=2, the config model.moe.top_k=1; "
         "set model.moe.top_k = 2"),
        ("mixtral", _moe("mixtral", expert_ffn_hidden=32), "has moe.expert_ffn_hidden=16, the "
         "config model.moe.expert_ffn_hidden=32; set model.moe.expert_ffn_hidden = 16"),
        ("mixtral", _moe("mixtral", renormalize=False), "has moe.renormalize=true, the config "
         "model.moe.renormalize=false; set model.moe.renormalize = true"),
        ("mixtral", ModelConfig(**TINY), "is a Mixtral with experts, the config "
         'model.moe="none"; set model.moe = {experts = 4, top_k = 2, expert_ffn_hidden = 16, '
         'shared_experts = 0, router = "softmax", renormalize = true, route_scale = 1.0, '
         "first_dense_layers = 0}"),
        ("mixtral", ModelConfig(**TINY, qk_norm=True, moe=MoEConfig(4, 2, 16)),
         "has qk_norm=false, the config model.qk_norm=true; set model.qk_norm = false"),
        ("qwen3_moe", _moe("qwen3_moe", first_dense_layers=0), "has moe.first_dense_layers=1, "
         "the config model.moe.first_dense_layers=0; set model.moe.first_dense_layers = 1"),
        ("qwen3_moe", ModelConfig(**{**TINY, "ffn_hidden": 64}, **HP["qwen3_moe"]),
         "has ffn_hidden=48, the config model.ffn_hidden=64; set model.ffn_hidden = 48"),
        ("dots1", _moe("dots1", route_scale=1.0), "has moe.route_scale=2.5, the config "
         "model.moe.route_scale=1.0; set model.moe.route_scale = 2.5"),
        ("dots1", _moe("dots1", shared_experts=1), "has moe.shared_experts=2, the config "
         "model.moe.shared_experts=1; set model.moe.shared_experts = 2"),
        ("glm4_moe", _moe("glm4_moe", router="softmax"), 'has moe.router="sigmoid", the config '
         'model.moe.router="softmax"; set model.moe.router = "sigmoid"'),
        ("qwen3", ModelConfig(**TINY, qk_norm=True, moe=MoEConfig(4, 2, 16)), "is a dense "
         "Qwen3, the config model.moe={experts = 4, "
         "top_k = 2, expert_ffn_hidden = 16, shared_experts = 0, router = \"softmax\", "
         "renormalize = true, route_scale = 1.0, first_dense_layers = 0, load_balance = "
         '"aux_loss", aux_loss_coef = 0.01, bias_update_rate = 0.001, groups = 1, '
         'topk_groups = 1}; set model.moe = "none"'),
    ],
)  # fmt: skip
def test_init_from_names_the_key_that_differs(hf_dirs, family, config, message):
    """hp's shape keys given as overrides must be config.json's, as for dense models (the
    training keys, load_balance and its rates, are not in config.json: any is taken)."""
    from hp_runtime.train.hf import check_hf_config
    from hp_runtime.train.launch import TrainError

    directory = hf_dirs[family][0]
    with pytest.raises(TrainError) as error:
        check_hf_config(config, str(directory))
    assert str(error.value) == f"model.init_from: {directory} {message}"
    check_hf_config(_moe(family, load_balance="bias") if family != "qwen3" else _config(family),
                    str(directory))  # fmt: skip


def test_init_from_takes_every_expert_tensor_or_refuses_by_name(hf_dirs, tmp_path):
    from hp_runtime.model import Transformer
    from hp_runtime.train.hf import init_from_hf
    from hp_runtime.train.launch import TrainError
    from safetensors.torch import load_file, save_file

    source = hf_dirs["dots1"][0]
    directory = tmp_path / "hf"
    shutil.copytree(source, directory)
    weights = load_file(source / "model.safetensors")
    config = _config("dots1")

    def init(tensors: dict[str, torch.Tensor], config: ModelConfig = config) -> str | None:
        save_file(tensors, directory / "model.safetensors")
        model = Transformer(config)
        _randomise(model.state_dict(keep_vars=True).items(), 1)
        before = {n: t.clone() for n, t in model.state_dict().items()}
        try:
            init_from_hf([model], config, str(directory))
        except TrainError as exc:
            assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
            return str(exc)
        return None

    assert init(weights) is None
    expert = "model.layers.1.mlp.experts.7.up_proj.weight"
    prefix = f"model.init_from: {directory}"
    assert init({k: v for k, v in weights.items() if k != expert}) == (
        f"{prefix} has no tensor {expert}"
    )
    ninth = {"model.layers.1.mlp.experts.8.up_proj.weight": weights[expert].clone()}
    assert init({**weights, **ninth}) == (
        f"{prefix} has tensors hp's Dots1 has no place for: "
        "model.layers.1.mlp.experts.8.up_proj.weight"
    )
    narrow = {**weights, expert: weights[expert][:8]}
    assert init(narrow) == (
        f"model.init_from: {expert} has shape [8, 32], the model's "
        "layers.1.feed_forward.experts.w3 one expert's [16, 32]"
    )
    fused = {"model.layers.1.mlp.experts.down_proj": torch.zeros(8, 32, 16)}  # both layouts
    message = init({**weights, **fused})
    assert message.startswith(f"{prefix} has tensors hp's Dots1 has no place for: ")
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in message
    aux = _moe("dots1", load_balance="aux_loss")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert init(weights, aux) == (
        f"{prefix} has a {bias} that is not zero, and the config's model.moe.load_balance = "
        '"aux_loss" chooses experts without it; set model.moe.load_balance = "bias"'
    )
    assert init({**weights, bias: torch.zeros(8)}, aux) is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_moe("mixtral", shared_experts=1), 'model.moe.shared_experts = 1 with router = '
         '"softmax" is in no transformers family (Qwen2-MoE gates its shared expert with a '
         'sigmoid, hp does not); router = "sigmoid" exports with shared experts'),
        (_moe("mixtral", route_scale=2.0), 'model.moe.route_scale = 2.0 with router = "softmax" '
         "is in no transformers family (Mixtral and Qwen3-MoE do not scale the weights)"),
        (_moe("mixtral", renormalize=False), "model.moe.renormalize = false is not Mixtral's "
         "routing (Mixtral renormalises the top-k weights); Qwen3-MoE (norm_topk_prob false) "
         "has it, with model.qk_norm = true"),
        (_moe("mixtral", first_dense_layers=1), "model.moe.first_dense_layers = 1: Mixtral has "
         "no dense layers; Qwen3-MoE (mlp_only_layers) has them, with model.qk_norm = true"),
        (_moe("qwen3_moe", load_balance="bias"), 'model.moe.load_balance = "bias" with router = '
         '"softmax" is in no transformers family: the bias chose the experts, and Qwen3-MoE has '
         "none"),
        (_moe("mixtral", experts=8, groups=4, topk_groups=2), "model.moe.topk_groups = 2 of "
         'groups = 4 with router = "softmax" is in no transformers family hp writes '
         "(DeepSeek-V2's routing); router = \"sigmoid\" exports it (Dots1, GLM-4-MoE)"),
        (_moe("dots1", shared_experts=0), 'model.moe.shared_experts = 0 with router = "sigmoid" '
         "is in no transformers family (Dots1 and GLM-4-MoE, DeepSeek-V3's routing with hp's "
         "attention, always have shared experts)"),
    ],
)  # fmt: skip
def test_export_refuses_what_no_transformers_family_computes(tmp_path, config, message):
    from hp_runtime.train.hf import write_hf
    from hp_runtime.train.launch import TrainError

    with pytest.raises(TrainError) as error:
        write_hf({}, config, str(tmp_path / "hf"))
    assert str(error.value) == message
    assert list(tmp_path.iterdir()) == []


def _stored(checkpoint: Path, out: Path, old: str, new: str) -> Path:
    """A copy of `checkpoint` whose stored [model] config has `old` replaced by `new`."""
    shutil.copytree(checkpoint, out)
    meta = json.loads((out / "meta.json").read_text())
    meta.pop("xxh3")  # its self-checksum: gone, rather than stale
    assert old in meta["config"]
    meta["config"] = meta["config"].replace(old, new)
    (out / "meta.json").write_text(json.dumps(meta))
    return out


@pytest.mark.slow
def test_an_export_of_a_moe_checkpoint_is_refused_in_one_line(ep2_run, tmp_path):
    """What no family computes, and a checkpoint without the expert tensors its config has:
    one line each, nothing written; over a directory of the user's files, export_output's rules."""
    checkpoint = ep2_run / "checkpoints" / "step-0000002"
    routing = 'shared_experts = 0, router = "softmax", renormalize = true'
    unnormalised = _stored(checkpoint, tmp_path / "plain", routing,
                           routing.replace("true", "false"))  # fmt: skip
    shared = _stored(checkpoint, tmp_path / "shared", routing,
                     'shared_experts = 1, router = "sigmoid", renormalize = true')  # fmt: skip
    cases = {
        unnormalised: f"{unnormalised}: cannot be exported: model.moe.renormalize = false is "
        "not Mixtral's routing (Mixtral renormalises the top-k weights); Qwen3-MoE "
        "(norm_topk_prob false) has it, with model.qk_norm = true",
        shared: f"{shared}: has no layers.0.feed_forward.shared.w1.weight, "
        "layers.0.feed_forward.shared.w2.weight, layers.0.feed_forward.shared.w3.weight, "
        "layers.1.feed_forward.shared.w1.weight, layers.1.feed_forward.shared.w2.weight, "
        "layers.1.feed_forward.shared.w3.weight: the model changed",
    }
    for source, message in cases.items():
        done = hp_train_here("export", source, "--out", tmp_path / "hf")
        assert done.returncode == 1
        assert done.stderr.splitlines() == [f"hp-train: error: {message}"]
        assert not (tmp_path / "hf").exists()
    out = tmp_path / "hf"  # a sharded export, then the user's file beside it
    done = hp_train_here("export", checkpoint, "--out", out, "--max-shard-size", "20KB")
    assert done.returncode == 0, done.stderr
    shards = sorted(p.name for p in out.iterdir())
    assert len(shards) > 4 and "model.safetensors.index.json" in shards
    (out / "notes.txt").write_text("mine")
    done = hp_train_here("export", checkpoint, "--out", out)
    assert done.stderr.splitlines() == [
        f"hp-train: error: --out {out}: holds notes.txt, which hp-train export did not write; "
        "move it out or give another directory"
    ]
    (out / "notes.txt").unlink()
    done = hp_train_here("export", checkpoint, "--out", out)  # over the previous export
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "hp-export.json", "model.safetensors",
    ]  # fmt: skip


@pytest.mark.slow
def test_a_run_starts_from_a_transformers_mixtral(hf_dirs, tmp_path):
    """Through hp-train: model.moe as an override, checked against config.json before any
    model is built; a run that agrees starts from the HF weights."""
    directory = hf_dirs["mixtral"][0]
    shape = [f"model.{k}={v}" for k, v in TINY.items()]
    moe = "model.moe={experts = 4, top_k = 2, expert_ffn_hidden = 16}"
    common = [*FAST, *shape, "data.type=dummy", "data.seq_length=16", "train.steps=1",
              f"model.init_from={directory}"]  # fmt: skip
    done = hp_train_here(*common, moe, f"train.run_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    assert f"initialised from {directory}" in done.stdout
    wrong = hp_train_here(*common, moe.replace("= 4", "= 8"), f"train.run_dir={tmp_path / 'w'}")
    assert wrong.returncode == 1
    assert wrong.stderr.splitlines() == [
        f"hp-train: error: model.init_from: {directory} has moe.experts=4, the config "
        "model.moe.experts=8; set model.moe.experts = 4"
    ]
