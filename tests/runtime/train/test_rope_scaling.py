"""Llama 3.x: the `llama3` rotary scaling (model, `model.rope_scaling`, resume) and the presets
with Meta's published shapes. The HF side (init_from, export, logits) is in test_hf.py."""

from __future__ import annotations

import json
import tomllib

import numpy as np
import pytest
import torch
from hp_runtime.model import PRESETS, ModelConfig
from hp_runtime.model.config import RopeScaling
from hp_runtime.model.presets import LLAMA_31_SCALING, LLAMA_32_SCALING
from hp_runtime.model.rotary import inverse_frequencies, rotary_tables
from hp_runtime.train.config import ConfigError, build_config, load_config, to_toml
from hypothesis import given, settings
from hypothesis import strategies as st

BASE = ["data.type=dummy", "data.seq_length=32", "train.steps=3"]
# head_dim 16 at theta 500: wavelengths 6 to 1,330 against 32 / 4 and 32 / 1, so each of the
# three bands (kept, interpolated, slowed) holds some of the 8 frequencies.
SMALL = RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
TABLE = {
    "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_seq_len": 32,
}  # fmt: skip


def _inline(table: dict) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


# --- the frequencies, against transformers' own rope init --------------------------------------


@pytest.mark.parametrize(
    ("dim", "heads", "theta", "scaling"),
    [
        (64, 4, 500.0, SMALL),
        (64, 4, 500.0, None),
        (1024, 8, 500000.0, LLAMA_31_SCALING),  # head_dim 128, as 8B-405B
        (512, 8, 500000.0, LLAMA_32_SCALING),  # head_dim 64, as 1B
    ],
)
def test_rotary_tables_equal_transformers(dim, heads, theta, scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_scaling = None
    if scaling is not None:
        hf_scaling = {
            "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        }  # fmt: skip
    positions = 4 * (scaling.original_max_seq_len if scaling else 64)
    hf_config = transformers.LlamaConfig(
        hidden_size=dim, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=positions, rope_theta=theta, rope_scaling=hf_scaling,
    )  # fmt: skip
    rotary = LlamaRotaryEmbedding(hf_config)
    assert rotary.attention_scaling == 1.0  # llama3 leaves the magnitudes alone
    config = ModelConfig(
        dim=dim, n_heads=heads, n_kv_heads=heads, max_seq_len=positions, rope_theta=theta,
        rope_scaling=scaling,
    )  # fmt: skip
    np.testing.assert_allclose(inverse_frequencies(config), rotary.inv_freq, rtol=1e-6, atol=0)
    half = config.head_size // 2
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1), torch.arange(positions)[None])
    tables = rotary_tables(config)
    np.testing.assert_allclose(tables[0], cos[0, :, :half], atol=2e-6, rtol=0)
    np.testing.assert_allclose(tables[1], sin[0, :, :half], atol=2e-6, rtol=0)
    if scaling is SMALL:  # every band is exercised: kept, interpolated, slowed
        plain = inverse_frequencies(ModelConfig(dim=dim, n_heads=heads, rope_theta=theta))
        ratio = (rotary.inv_freq / plain).numpy()
        assert (ratio == 1).any() and np.isclose(ratio, 1 / 8).any()
        assert ((ratio > 1 / 8 + 1e-3) & (ratio < 1 - 1e-3)).any()


YARN_CASES = [  # (beta_fast, beta_slow, mscale, mscale_all_dim): defaults, DeepSeek-V3's, others
    (None, None, None, None),
    (32.0, 1.0, 1.0, 1.0),
    (None, None, 0.707, 1.0),
    (16.0, 2.0, 1.0, 0.8),
]


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize(("beta_fast", "beta_slow", "mscale", "mscale_all_dim"), YARN_CASES)
def test_yarn_tables_equal_transformers(mla, beta_fast, beta_slow, mscale, mscale_all_dim):
    """YaRN's cos and sin (times its attention factor) equal transformers' own rotary
    embedding: Llama's (a whole head rotated) and DeepSeek-V3's (MLA's rotated part)."""
    transformers = pytest.importorskip("transformers")
    from hp_runtime.model.config import MLAConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    given = {"beta_fast": beta_fast, "beta_slow": beta_slow, "mscale": mscale,
             "mscale_all_dim": mscale_all_dim}  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    scaling = RopeScaling("yarn", 40.0, original_max_seq_len=64, **given)
    shape = {"dim": 64, "n_heads": 4, "n_kv_heads": 4, "max_seq_len": 512, "rope_theta": 1e4}
    rope = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
            "rope_theta": 1e4, **given}  # fmt: skip
    common = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 512}
    if mla:
        config = ModelConfig(**shape, rope_scaling=scaling, attention_kind="mla",
                             mla=MLAConfig(32, 16, 8, 16, q_lora_rank=24))  # fmt: skip
        hf = DeepseekV3RotaryEmbedding(transformers.DeepseekV3Config(
            **common, qk_rope_head_dim=8, qk_nope_head_dim=16, rope_parameters=rope))  # fmt: skip
    else:
        config = ModelConfig(**shape, rope_scaling=scaling)
        hf = LlamaRotaryEmbedding(transformers.LlamaConfig(**common, rope_parameters=rope))
    cos, sin = hf(torch.zeros(1), torch.arange(512)[None])
    half = config.rope_dim // 2
    tables = rotary_tables(config)
    np.testing.assert_allclose(tables[0], cos[0, :, :half], atol=1e-6, rtol=0)
    np.testing.assert_allclose(tables[1], sin[0, :, :half], atol=1e-6, rtol=0)
    assert hf.attention_scaling == pytest.approx(scaling.attention_factor(), rel=1e-12)


def test_the_inv_freq_older_transformers_saved_is_taken_only_at_the_scaled_frequencies():
    """Older transformers saved each layer's rotary `inv_freq`: hp takes it as nothing new
    when it is the scaled frequencies (transformers' own), and names it when it is not."""
    transformers = pytest.importorskip("transformers")
    from hp_runtime.train.hf import _check_extra
    from hp_runtime.train.launch import TrainError
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rope_theta=500.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )  # fmt: skip
    scaled = LlamaRotaryEmbedding(hf_config).inv_freq
    config = ModelConfig(n_layers=1, rope_theta=500.0, rope_scaling=SMALL)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _check_extra({name: scaled}, config, "DIR")
    plain = inverse_frequencies(ModelConfig(n_layers=1, rope_theta=500.0))
    with pytest.raises(TrainError, match=f"has tensors hp's Llama has no place for: {name}$"):
        _check_extra({name: plain}, config, "DIR")


# --- the presets ------------------------------------------------------------------------------

# The safetensors totals of Meta's checkpoints on the Hugging Face Hub (Llama 3 8B has the
# shape of the "8b" preset, Llama 3.1 8B's without the scaling).
PUBLISHED = {
    "llama3-1b": 1_235_814_400,
    "llama3-3b": 3_212_749_824,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "8b": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama3_presets_have_the_published_parameter_counts(name):
    assert abs(PRESETS[name].num_params() - PUBLISHED[name]) <= PUBLISHED[name] * 1e-3


# Meta's config.json of Llama 3.1 8B and Llama 3.2 1B, as on the Hub (transformers 4 spells
# the scaling rope_scaling).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
LLAMA_32_1B = {
    **LLAMA_31_8B, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "tie_word_embeddings": True,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "transformers_version": "4.45.0.dev0",
}  # fmt: skip


@pytest.mark.parametrize(("name", "hf"), [("llama3-8b", LLAMA_31_8B), ("llama3-1b", LLAMA_32_1B)])
def test_meta_checkpoints_init_into_their_preset_without_overrides(tmp_path, name, hf):
    from hp_runtime.train.hf import check_hf_config, model_config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(hf))
    check_hf_config(PRESETS[name], str(tmp_path))  # every field the checkpoint gives agrees
    assert model_config_from_hf(str(tmp_path))["rope_scaling"] == PRESETS[name].rope_scaling


def test_the_8b_example_is_the_llama3_8b_shape_at_8k_with_document_masking(repo):
    """Parsed and validated for its 64 GPUs, the model never built."""
    from hp_runtime.train.launch import Runtime
    from hp_runtime.train.setup import checked_plan

    config = load_config(str(repo / "examples" / "train_8b.toml"))
    assert config.model == PRESETS["llama3-8b"]
    assert config.model.num_params() == PUBLISHED["llama3-8b"]
    assert config.data.seq_length == 8192
    assert config.data.document_masking and config.data.reset_position_ids
    plan = checked_plan(config, Runtime(0, 64, 0, 8, torch.device("cuda")))
    assert plan.global_batch_size == 512 and plan.dp_size == 64
    assert build_config(tomllib.loads(to_toml(config))) == config


# --- model.rope_scaling in config.toml --------------------------------------------------------


def test_rope_scaling_reads_as_an_inline_table_a_sub_table_or_an_override(tmp_path):
    inline = tmp_path / "inline.toml"
    inline.write_text(f"[model]\nrope_scaling = {_inline(TABLE)}\n")
    sub = tmp_path / "sub.toml"
    sub.write_text(
        "[model.rope_scaling]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in TABLE.items())
    )
    override = f"model.rope_scaling={_inline({**TABLE, 'factor': 8})}"  # an integer factor too
    for config in (
        load_config(str(inline), BASE),
        load_config(str(sub), BASE),
        load_config(None, [*BASE, override]),
    ):
        assert config.model.rope_scaling == SMALL
        assert type(config.model.rope_scaling.factor) is float
    assert load_config(None, BASE).model.rope_scaling is None  # none by default
    unset = load_config(str(inline), [*BASE, "model.rope_scaling=none"])
    assert unset.model.rope_scaling is None


@pytest.mark.parametrize(
    "overrides",
    [
        [f"model.rope_scaling={_inline(TABLE)}"],
        ["model.preset=llama3-8b"],
        ["model.preset=llama3-1b", "model.rope_scaling=none"],  # written "none": absent is 1b's
        ["model.preset=llama3-3b", f"model.rope_scaling={_inline({**TABLE, 'factor': 2.5})}"],
    ],
)
def test_the_resolved_config_reads_back_with_its_rope_scaling(overrides):
    config = load_config(None, [*BASE, *overrides])
    text = to_toml(config)
    assert build_config(tomllib.loads(text)) == config
    assert "rope_scaling" in text


def _bad(table: object) -> str:
    value = _inline(table) if isinstance(table, dict) else table
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, f"model.rope_scaling={value}"])
    message = str(info.value)
    assert "\n" not in message
    return message


def _without(field: str) -> dict:
    return {k: v for k, v in TABLE.items() if k != field}


YARN = {"type": "yarn", "factor": 4.0, "original_max_seq_len": 32}
FIELDS = ", ".join([*TABLE, "beta_fast", "beta_slow", "mscale", "mscale_all_dim"])
# Generated bad values of every field: a wrong type, out of range, a relation broken.
WRONG_TYPES = {
    "type": [3, True, 8.0, ["llama3"]],
    "factor": ["8", True, [8.0]],
    "low_freq_factor": ["1", False, [1.0]],
    "high_freq_factor": ["4", True, [4]],
    "original_max_seq_len": [8192.0, "8192", True, [1]],
}
OUT_OF_RANGE = {
    "factor": ([0, -1, 0.5, -1e300, 1 - 1e-9], "must be at least 1"),
    "low_freq_factor": ([0, -1, -1e-300], "must be more than 0"),
    "high_freq_factor": ([1.0, 0.5, 0, -4], "must be more than low_freq_factor=1.0"),
    "original_max_seq_len": ([0, -1, -(2**63)], "must be at least 1"),
}


def test_every_bad_rope_scaling_is_one_line_naming_its_field():
    for field, values in WRONG_TYPES.items():
        for value in values:
            message = _bad({**TABLE, field: value})
            assert message.startswith(f"model.rope_scaling.{field}: expected "), message
    for field, (values, problem) in OUT_OF_RANGE.items():
        for value in values:
            read = value if field == "original_max_seq_len" else float(value)  # as TOML, typed
            message = _bad({**TABLE, field: value})
            assert message == f"model.rope_scaling.{field}: {problem}, got {read!r}"
    low_above = _bad({**TABLE, "low_freq_factor": 5.0})  # the relation, from the other side
    assert low_above == (
        "model.rope_scaling.high_freq_factor: must be more than low_freq_factor=5.0, got 4.0"
    )
    for field in ("type", "factor"):  # required whatever the type
        assert _bad(_without(field)) == (
            f"model.rope_scaling.{field}: required; model.rope_scaling needs type, factor (the "
            "other fields have defaults)"
        )
    for field in ("low_freq_factor", "high_freq_factor", "original_max_seq_len"):
        assert _bad(_without(field)) == (f"model.rope_scaling.{field}: required with type 'llama3'")
    assert _bad({"type": "yarn", "factor": 4.0}) == (
        "model.rope_scaling.original_max_seq_len: required with type 'yarn'"
    )
    assert _bad({**TABLE, "type": "ntk"}) == (
        "model.rope_scaling.type: expected one of 'llama3', 'yarn', got 'ntk'"
    )
    assert _bad({**TABLE, "type": "yarn"}) == (
        "model.rope_scaling.low_freq_factor: is not a field of type 'yarn', got 1.0"
    )
    assert _bad({**TABLE, "beta_fast": 32.0}) == (
        "model.rope_scaling.beta_fast: is not a field of type 'llama3', got 32.0"
    )
    for field, value, problem in (
        ("beta_fast", 0.5, "must be at least beta_slow=1.0, got 0.5"),
        ("beta_slow", 0.0, "must be more than 0, got 0.0"),
        ("beta_slow", 40.0, "must be at least beta_slow=40.0, got 32.0"),
        ("mscale", -0.1, "must be at least 0, got -0.1"),
        ("mscale_all_dim", -1.0, "must be at least 0, got -1.0"),
        ("factor", 0.5, "must be at least 1, got 0.5"),
    ):
        named = "beta_fast" if "beta_slow=" in problem else field
        assert _bad({**YARN, field: value}) == f"model.rope_scaling.{named}: {problem}"
    for field in ("beta_fast", "mscale"):
        assert _bad({**YARN, field: "1"}).startswith(f"model.rope_scaling.{field}: expected ")
    with pytest.raises(ConfigError) as error:  # YaRN's ramp divides by ln(theta)
        load_config(None, [*BASE, "model.rope_theta=1", f"model.rope_scaling={_inline(YARN)}"])
    assert str(error.value) == (
        "model: rope_theta=1.0 with rope_scaling type 'yarn': YaRN's ramp needs a rope_theta "
        "above 1"
    )
    assert _bad({**TABLE, "factr": 8.0}) == (
        "model.rope_scaling.factr: unknown field; did you mean model.rope_scaling.factor? "
        f"its fields: {FIELDS}"
    )
    assert _bad({**TABLE, "rope_theta": 1e4}) == (
        f"model.rope_scaling.rope_theta: unknown field; its fields: {FIELDS}"
    )
    assert _bad("[1, 2]") == (
        f"model.rope_scaling: expected a table {{{FIELDS}}} or none, got [1, 2] (list)"
    )
    assert _bad('"llama3"').startswith("model.rope_scaling: expected a table {")


ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["llama3", "none", "default", "yarn"]),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(
    fields=st.dictionaries(st.sampled_from([*TABLE, "rope_type", "theta", ""]), ODD, max_size=7),
    base=st.booleans(),
)
def test_drawn_rope_scaling_tables_load_or_fail_in_one_line_naming_a_field(fields, base):
    """Tables drawn at random, on top of a good one or alone: a RopeScaling, or one line that
    names model.rope_scaling and the field at fault."""
    table = {**(TABLE if base else {}), **{k: v for k, v in fields.items() if v is not None}}
    path = f"model.rope_scaling={_inline(table)}"
    try:
        config = load_config(None, [*BASE, path])
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message
        named = message.split(":")[0]
        assert named.startswith("model.rope_scaling"), message
        assert named == "model.rope_scaling" or named.split(".")[2] in {*table, *TABLE}, message
        return
    assert isinstance(config.model.rope_scaling, RopeScaling)
    if table["type"] == "llama3":
        assert set(table) == set(TABLE)
    else:  # yarn's own fields all have defaults; llama3's are refused
        assert set(table) <= {"type", "factor", "original_max_seq_len"}


def test_the_model_config_refuses_what_is_not_a_scaling():
    with pytest.raises(ValueError, match="rope_scaling=.* is not a RopeScaling or None"):
        ModelConfig(rope_scaling=TABLE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="factor=0.5 must be at least 1"):
        RopeScaling("llama3", 0.5, 1.0, 4.0, 8192)


# --- a checkpoint resumes only the scaling it was trained with -------------------------------


@pytest.mark.parametrize(
    ("saved", "now", "message"),
    [
        ([], [f"model.rope_scaling={_inline(TABLE)}"],
         f'model.rope_scaling = {_inline(TABLE)}, but CKPT was trained with "none"'),
        ([f"model.rope_scaling={_inline(TABLE)}"], [],
         f'model.rope_scaling = "none", but CKPT was trained with {_inline(TABLE)}'),
        ([f"model.rope_scaling={_inline(TABLE)}"],
         [f"model.rope_scaling={_inline({**TABLE, 'factor': 4.0})}"], "factor = 4.0"),
        (["model.preset=llama3-1b"], ["model.preset=llama3-1b", "model.rope_scaling=none"],
         'model.rope_scaling = "none", but CKPT'),
        (["model.preset=llama3-1b", "model.rope_scaling=none"], ["model.preset=llama3-1b"],
         'but CKPT was trained with "none"'),
        ([f"model.rope_scaling={_inline(TABLE)}"], [f"model.rope_scaling={_inline(TABLE)}"], None),
        (["model.preset=llama3-8b"], ["model.preset=llama3-8b"], None),
        ([], [], None),
    ],
)  # fmt: skip
def test_a_checkpoint_resumes_only_with_its_rope_scaling(saved, now, message):
    from hp_runtime.train.checkpoint_format import CheckpointError
    from hp_runtime.train.compat import check_model

    meta = {"config": to_toml(load_config(None, [*BASE, *saved]))}
    config = load_config(None, [*BASE, *now]).model
    if message is None:
        check_model("CKPT", meta, config)
        return
    with pytest.raises(CheckpointError) as info:
        check_model("CKPT", meta, config)
    assert message in str(info.value)
    assert "set model.rope_scaling = " in str(info.value)
