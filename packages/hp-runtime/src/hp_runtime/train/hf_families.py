"""The transformers families whose models are exactly hp's, as config.json and checkpoint
names spell them: pure functions of dicts and names (`train/hf.py` reads and writes the files).

| hp                                       | qk_norm false          | qk_norm true          |
|------------------------------------------|------------------------|-----------------------|
| dense                                    | `LlamaForCausalLM`     | `Qwen3ForCausalLM`    |
| `moe.router = "softmax"`                 | `MixtralForCausalLM`   | `Qwen3MoeForCausalLM` |
| `moe.router = "sigmoid"`, shared experts | `Glm4MoeForCausalLM`   | `Dots1ForCausalLM`    |

Mixtral's softmax over the top-k logits is hp's softmax over all experts, top-k,
renormalised; Qwen3-MoE renormalises when `norm_topk_prob` and keeps its `mlp_only_layers`
dense; Dots1 (Qwen3's attention) and GLM-4-MoE (Llama's, `use_qk_norm` optional, with
`partial_rotary_factor` 1.0) route as DeepSeek-V3 does: sigmoid scores, the top-k chosen by
score + `e_score_correction_bias` (hp's `expert_bias`), normalised (`norm_topk_prob`), scaled
(`routed_scaling_factor`), within the best `topk_group` of `n_group` groups of experts (hp's
`groups`, `topk_groups`), plus `n_shared_experts` always-active experts. What none of them
computes is refused by key (`family_of`): group-limited routing with softmax (DeepSeek-V2's),
a softmax router with shared experts (Qwen2-MoE gates its shared expert with a sigmoid, hp
does not), a routing scale or a balancing bias with softmax, Mixtral without renormalised
weights or with dense layers, the sigmoid router without shared experts.

The tensors' names in each family's checkpoints are `hf_names.py`'s; config.json as a whole,
written and read, is `hf_config.py`'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hp_runtime.model import ModelConfig
from hp_runtime.model.config import FieldError, MLAConfig, MoEConfig
from hp_runtime.train.errors import TrainError
from hp_runtime.train.hf_rope import hf_rope

_REQUIRED = object()


@dataclass(frozen=True)
class Family:
    """A transformers architecture that computes exactly hp's model for the configs
    `family_of` gives it: how its config.json and its checkpoints spell that model."""

    architecture: str
    model_type: str
    label: str  # in messages: "hp's Mixtral"
    # transformers' values of the fields a config.json may leave out
    defaults: dict[str, Any]
    # fields whose other values compute something else: hp implements this value only
    fixed: dict[str, Any]
    # the family's own fields of config.json: from hp's config, and hp's fields from them
    write: Callable[[ModelConfig], dict[str, Any]]
    read: Callable[[str, dict[str, Any], Family], dict[str, Any]]
    fields: frozenset[str]  # the fields `read` takes
    moe_block: str = "mlp"  # a MoE layer's block in its checkpoints
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # w1, w3, w2
    bias: bool = False  # the router's `e_score_correction_bias` (DeepSeek-V3's balancing)
    fp32: tuple[str, ...] = ()  # tensors its models keep in float32 whatever the dtype
    rope_fields: tuple[str, ...] = ()  # rope_parameters fields `read` takes


def _json(value: Any) -> str:
    return json.dumps(value)


def _same(value: Any, default: Any) -> bool:
    """`value` is `default` as JSON means it (true is not 1, 0 is 0.0)."""
    if isinstance(default, bool) or default is None:
        return value is default
    if isinstance(default, int | float):
        return isinstance(value, int | float) and not isinstance(value, bool) and value == default
    return type(value) is type(default) and value == default


def _positive(path: str, key: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, int if kind is int else int | float) and not isinstance(value, bool)
    if not ok or not value > 0 or not math.isfinite(value):
        noun = "a positive integer" if kind is int else "a positive number"
        raise TrainError(f"{path}: {key}={_json(value)} must be {noun}")
    return value


def _get(path: str, hf: dict[str, Any], family: Family, *keys: str) -> Any:
    """A field that transformers reads under any of `keys` (its attribute_map; where several
    are given they must agree), else the family's default; required when it has none."""
    given = {key: hf[key] for key in keys if hf.get(key) is not None}
    if len({_json(value) for value in given.values()}) > 1:
        both = ", ".join(f"{key}={_json(value)}" for key, value in given.items())
        raise TrainError(f"{path}: {both} disagree; give one")
    if given:
        return next(iter(given.values()))
    default = family.defaults.get(keys[0], _REQUIRED)
    if default is _REQUIRED:
        raise TrainError(f"{path}: {keys[0]} is missing; an HF {family.label} config.json gives it")
    return default


def _count(path: str, hf: dict[str, Any], family: Family, *keys: str) -> int:
    key = next((k for k in keys if hf.get(k) is not None), keys[0])
    return _positive(path, key, _get(path, hf, family, *keys), int)


def _flag(path: str, hf: dict[str, Any], family: Family, key: str) -> bool:
    value = _get(path, hf, family, key)
    if not isinstance(value, bool):
        raise TrainError(f"{path}: {key}={_json(value)} must be true or false")
    return value


def _full_attention(path: str, hf: dict[str, Any], family: Family) -> None:
    """Every layer attends to the whole causal prefix: hp has no sliding window. Layers are
    sliding where `layer_types` says so, else (transformers' rule) from `max_window_layers`
    on when a `sliding_window` is set (and `use_sliding_window`, where the family has it)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is not None:
        if types != ["full_attention"] * layers:
            raise TrainError(
                f"{path}: layer_types={_json(types)} is not supported; hp's attention is "
                f'"full_attention" in each of the {layers} layers (no sliding window)'
            )
        return
    if "use_sliding_window" in family.fixed:
        return  # fixed false: transformers sets the window to none
    window = _get(path, hf, family, "sliding_window")
    first = _get(path, hf, family, "max_window_layers")
    if window is not None and not (isinstance(first, int) and first >= layers):
        raise TrainError(
            f"{path}: sliding_window={_json(window)} from max_window_layers={_json(first)} "
            f"is not supported; hp's attention has no sliding window (set sliding_window "
            "to null)"
        )


def _moe(path: str, keys: dict[str, str], **fields: Any) -> MoEConfig:
    """The MoEConfig of `fields` (hp's names), a problem named by its config.json key."""
    if fields["top_k"] > fields["experts"]:
        raise TrainError(
            f"{path}: {keys['top_k']}={fields['top_k']} is more than "
            f"{keys['experts']}={fields['experts']}"
        )
    try:
        return MoEConfig(**fields)
    except FieldError as exc:
        raise TrainError(
            f"{path}: {keys.get(exc.field, exc.field)}={_json(exc.value)} {exc.problem}"
        ) from None


def _dense_layers(fields: dict[str, Any], hf: dict[str, Any], path: str, first: int) -> None:
    """The dense layers' width, where the model has dense layers (else config.json's
    `intermediate_size` shapes nothing)."""
    if first:
        fields["ffn_hidden"] = _positive(
            path, "intermediate_size", hf.get("intermediate_size"), int
        )


# --- each family's own fields -----------------------------------------------------------


def _write_llama(config: ModelConfig) -> dict[str, Any]:
    return {"intermediate_size": config.ffn_hidden, "attention_bias": False, "mlp_bias": False}


def _read_dense(path: str, hf: dict[str, Any], family: Family) -> dict[str, Any]:
    if family is QWEN3:
        _full_attention(path, hf, family)
    hidden = _get(path, hf, family, "intermediate_size")
    return {
        "qk_norm": family is QWEN3,
        "ffn_hidden": _positive(path, "intermediate_size", hidden, int),
    }


def _no_window(config: ModelConfig) -> dict[str, Any]:
    """config.json's fields for attention without a sliding window, in every layer."""
    return {
        "sliding_window": None,
        "max_window_layers": config.n_layers,
        "layer_types": ["full_attention"] * config.n_layers,
    }


def _write_qwen3(config: ModelConfig) -> dict[str, Any]:
    return {
        "intermediate_size": config.ffn_hidden,
        "attention_bias": False,
        "use_sliding_window": False,
        **_no_window(config),
    }


def _write_mixtral(config: ModelConfig) -> dict[str, Any]:
    moe = config.moe
    assert moe is not None
    return {
        "intermediate_size": moe.expert_ffn_hidden,  # Mixtral's experts' width
        "num_local_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
    }


def _read_mixtral(path: str, hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """Softmax over the experts, the top-k weights renormalised (Mixtral's softmax over the
    top-k logits is the same), every layer routed."""
    keys = {"experts": "num_local_experts", "top_k": "num_experts_per_tok"}
    moe = _moe(
        path,
        keys,
        experts=_count(path, hf, family, "num_local_experts", "num_experts"),
        top_k=_count(path, hf, family, "num_experts_per_tok"),
        expert_ffn_hidden=_count(path, hf, family, "intermediate_size"),
        router="softmax",
        renormalize=True,
    )
    return {"moe": moe}


def _write_qwen3_moe(config: ModelConfig) -> dict[str, Any]:
    moe = config.moe
    assert moe is not None
    return {
        "intermediate_size": config.ffn_hidden,  # the dense layers' (mlp_only_layers)
        "moe_intermediate_size": moe.expert_ffn_hidden,
        "num_experts": moe.experts,  # transformers 4's name, and 5's attribute_map
        "num_local_experts": moe.experts,  # what transformers 5 writes
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(moe.first_dense_layers)),
        "attention_bias": False,
        "use_sliding_window": False,
        **_no_window(config),
    }


def _read_qwen3_moe(path: str, hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """Softmax top-k, renormalised when `norm_topk_prob`; a layer is dense when it is in
    `mlp_only_layers` or `(layer + 1) % decoder_sparse_step` is not 0: hp's dense layers
    are the first `moe.first_dense_layers`, so only step 1 and mlp_only_layers = [0, k)."""
    _full_attention(path, hf, family)
    step = _get(path, hf, family, "decoder_sparse_step")
    if not _same(step, 1):
        raise TrainError(
            f"{path}: decoder_sparse_step={_json(step)} is not supported; hp routes every "
            "layer after its first dense ones (model.moe.first_dense_layers), which is "
            "decoder_sparse_step 1"
        )
    dense = _get(path, hf, family, "mlp_only_layers")
    if not (isinstance(dense, list) and sorted(dense) == list(range(len(dense)))):
        raise TrainError(
            f"{path}: mlp_only_layers={_json(dense)} is not supported; hp's dense layers are "
            "the first k (mlp_only_layers = [0, 1, ..., k - 1], model.moe.first_dense_layers "
            "= k)"
        )
    keys = {"experts": "num_experts", "top_k": "num_experts_per_tok"}
    fields: dict[str, Any] = {"qk_norm": True}
    fields["moe"] = _moe(
        path,
        keys,
        experts=_count(path, hf, family, "num_experts", "num_local_experts"),
        top_k=_count(path, hf, family, "num_experts_per_tok"),
        expert_ffn_hidden=_count(path, hf, family, "moe_intermediate_size"),
        router="softmax",
        renormalize=_flag(path, hf, family, "norm_topk_prob"),
        first_dense_layers=len(dense),
    )
    _dense_layers(fields, hf, path, len(dense))
    return fields


def _write_shared(config: ModelConfig) -> dict[str, Any]:
    """DeepSeek-V3's routing, as Dots1 and GLM-4-MoE spell it: sigmoid scores, top-k chosen
    by score + bias, the k scores normalised (`norm_topk_prob`) and scaled, plus shared
    experts; group-limited (`n_group`, `topk_group`)."""
    moe = config.moe
    assert moe is not None
    return {
        "intermediate_size": config.ffn_hidden,  # the first_k_dense_replace layers'
        "moe_intermediate_size": moe.expert_ffn_hidden,
        "n_routed_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_experts,
        "first_k_dense_replace": moe.first_dense_layers,
        "norm_topk_prob": moe.renormalize,
        "routed_scaling_factor": moe.route_scale,
        "n_group": moe.groups,
        "topk_group": moe.topk_groups,
        "attention_bias": False,
    }


def _write_dots1(config: ModelConfig) -> dict[str, Any]:
    return {**_write_shared(config), **_no_window(config)}


def _write_glm4_moe(config: ModelConfig) -> dict[str, Any]:
    """GLM-4-MoE rotates a fraction of each head (partial_rotary_factor, 0.5 by default):
    hp rotates all of it. transformers 4 reads the factor at the top, 5 in rope_parameters."""
    rope = {**hf_rope(config)["rope_parameters"], "partial_rotary_factor": 1.0}
    return {
        **_write_shared(config),
        "use_qk_norm": config.qk_norm,
        "partial_rotary_factor": 1.0,
        "rope_parameters": rope,
        "num_nextn_predict_layers": 0,  # no multi-token prediction layers (5: num_mtp_layers)
        "num_mtp_layers": 0,
    }


def _read_shared(path: str, hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """DeepSeek-V3's routing (see `_write_shared`), group-limited: the experts of the best
    `topk_group` of `n_group` groups (`MoEConfig.groups`, `topk_groups`)."""
    groups, topk_groups = (_count(path, hf, family, key) for key in ("n_group", "topk_group"))
    first = _get(path, hf, family, "first_k_dense_replace")
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise TrainError(f"{path}: first_k_dense_replace={_json(first)} must be an integer >= 0")
    scale = _get(path, hf, family, "routed_scaling_factor")
    keys = {
        "experts": "n_routed_experts",
        "top_k": "num_experts_per_tok",
        "route_scale": "routed_scaling_factor",
        "groups": "n_group",
        "topk_groups": "topk_group",
    }
    fields: dict[str, Any] = {}
    fields["moe"] = _moe(
        path,
        keys,
        experts=_count(path, hf, family, "n_routed_experts", "num_local_experts"),
        top_k=_count(path, hf, family, "num_experts_per_tok"),
        expert_ffn_hidden=_count(path, hf, family, "moe_intermediate_size"),
        shared_experts=_count(path, hf, family, "n_shared_experts"),
        router="sigmoid",
        renormalize=_flag(path, hf, family, "norm_topk_prob"),
        route_scale=float(_positive(path, "routed_scaling_factor", scale, float)),
        first_dense_layers=first,
        groups=groups,
        topk_groups=topk_groups,
    )
    _dense_layers(fields, hf, path, first)
    return fields


def _read_dots1(path: str, hf: dict[str, Any], family: Family) -> dict[str, Any]:
    _full_attention(path, hf, family)
    return {"qk_norm": True, **_read_shared(path, hf, family)}


def _read_glm4_moe(path: str, hf: dict[str, Any], family: Family) -> dict[str, Any]:
    given = {"partial_rotary_factor": hf.get("partial_rotary_factor")}
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(hf.get(key), dict):
            given[f"{key}.partial_rotary_factor"] = hf[key].get("partial_rotary_factor")
    given = {key: value for key, value in given.items() if value is not None}
    if not given:
        raise TrainError(
            f"{path}: partial_rotary_factor is missing, which transformers' GLM-4-MoE reads "
            "as 0.5; hp rotates the whole of each head (partial_rotary_factor 1.0)"
        )
    for key, value in given.items():
        if not _same(value, 1.0):
            raise TrainError(
                f"{path}: {key}={_json(value)} is not supported; hp rotates the whole of each "
                "head (partial_rotary_factor 1.0)"
            )
    return {"qk_norm": _flag(path, hf, family, "use_qk_norm"), **_read_shared(path, hf, family)}


_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _write_deepseek_v3(config: ModelConfig) -> dict[str, Any]:
    """Latent attention (hp's rotary halves are DeepSeek's interleaved pairs, reordered by
    the checkpoint's rows: `hf_names.rope_rows`) and DeepSeek-V3's routing; a dense model's
    every layer in `first_k_dense_replace`; the multi-token prediction modules, where the
    model has them, as the layers after its own (`num_nextn_predict_layers`)."""
    mla = config.mla
    assert mla is not None
    shape = {name: getattr(mla, name) for name in _MLA_FIELDS}
    fields = {**shape, "rope_interleave": True, "head_dim": mla.qk_rope_head_dim}
    depth = config.mtp.depth if config.mtp is not None else 0  # the layers after the model's
    fields |= {"num_nextn_predict_layers": depth, "num_mtp_layers": depth}
    fields["attention_bias"] = False
    if config.moe is None:
        # every layer dense, the prediction modules' too (transformers counts its MTP layers)
        dense = {
            "intermediate_size": config.ffn_hidden,
            "first_k_dense_replace": config.total_layers,
        }
        return {**fields, **dense}
    return {**fields, **_write_shared(config)}


def _read_deepseek_v3(path: str, hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """MLA's five fields and DeepSeek-V3's routing (`_read_shared`); every layer dense
    where `first_k_dense_replace` covers them."""
    values = {name: _get(path, hf, family, name) for name in _MLA_FIELDS}
    if "q_lora_rank" in hf:  # null is a full-rank query projection, not the default rank
        values["q_lora_rank"] = hf["q_lora_rank"]
    try:
        mla = MLAConfig(**values)
    except FieldError as exc:
        raise TrainError(f"{path}: {exc.field}={_json(exc.value)} {exc.problem}") from None
    derived = hf.get("qk_head_dim")  # what transformers 5 writes: nope + rope, derived
    if derived is not None and not _same(derived, mla.qk_head_dim):
        raise TrainError(
            f"{path}: qk_head_dim={_json(derived)} is not qk_nope_head_dim + qk_rope_head_dim"
            f" = {mla.qk_head_dim}"
        )
    fields: dict[str, Any] = {"attention_kind": "mla", "mla": mla}
    first = _get(path, hf, family, "first_k_dense_replace")
    if (
        isinstance(first, int)
        and not isinstance(first, bool)
        and first >= hf.get("num_hidden_layers", 0) > 0
    ):
        _dense_layers(fields, hf, path, first)
        return fields
    return {**fields, **_read_shared(path, hf, family)}


_WINDOW_FIELDS = frozenset({"sliding_window", "max_window_layers", "layer_types"})
_SHARED_FIELDS = frozenset(
    """intermediate_size moe_intermediate_size n_routed_experts num_local_experts
    num_experts_per_tok n_shared_experts first_k_dense_replace norm_topk_prob
    routed_scaling_factor n_group topk_group""".split()
)
_FP32 = ("gate.weight", "gate.e_score_correction_bias")  # `_keep_in_fp32_modules_strict`


def _defaults(kv: int, positions: int, eps: float, theta: float, **more: Any) -> dict[str, Any]:
    """A config class's defaults: num_key_value_heads, max_position_embeddings, rms_norm_eps,
    the rotary theta, and its own."""
    return {
        "num_key_value_heads": kv, "max_position_embeddings": positions, "rms_norm_eps": eps,
        "rope_theta": theta, **more,
    }  # fmt: skip


# Each as transformers defines it (its config class's defaults, its modeling's names).
LLAMA = Family(
    "LlamaForCausalLM", "llama", "Llama",
    defaults=_defaults(None, 2048, 1e-6, 10000.0),
    fixed={"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    write=_write_llama, read=_read_dense, fields=frozenset({"intermediate_size"}),
)  # fmt: skip
QWEN3 = Family(
    "Qwen3ForCausalLM", "qwen3", "Qwen3",
    defaults=_defaults(32, 32768, 1e-6, 10000.0, head_dim=128, sliding_window=4096,
                       max_window_layers=28),
    fixed={"attention_bias": False, "use_sliding_window": False},
    write=_write_qwen3, read=_read_dense, fields=_WINDOW_FIELDS | {"intermediate_size"},
)  # fmt: skip
MIXTRAL = Family(
    "MixtralForCausalLM", "mixtral", "Mixtral",
    defaults=_defaults(8, 4096 * 32, 1e-5, 1e6),
    fixed={"sliding_window": None, "router_jitter_noise": 0.0},
    write=_write_mixtral, read=_read_mixtral,
    fields=frozenset({"intermediate_size", "num_local_experts", "num_experts",
                      "num_experts_per_tok"}),
    moe_block="block_sparse_moe", expert_parts=("w1", "w3", "w2"),
)  # fmt: skip
QWEN3_MOE = Family(
    "Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-MoE",
    defaults=_defaults(4, 32768, 1e-6, 10000.0, decoder_sparse_step=1, mlp_only_layers=[],
                       norm_topk_prob=False, sliding_window=4096, max_window_layers=28),
    fixed={"attention_bias": False, "use_sliding_window": False},
    write=_write_qwen3_moe, read=_read_qwen3_moe,
    fields=_WINDOW_FIELDS | {"intermediate_size", "moe_intermediate_size", "num_experts",
                             "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
                             "decoder_sparse_step", "mlp_only_layers"},
)  # fmt: skip
DOTS1 = Family(
    "Dots1ForCausalLM", "dots1", "Dots1",
    defaults=_defaults(32, 2048, 1e-6, 10000.0, first_k_dense_replace=0, norm_topk_prob=False,
                       n_group=1, topk_group=1, routed_scaling_factor=1.0,
                       sliding_window=4096, max_window_layers=62),
    fixed={"attention_bias": False},
    write=_write_dots1, read=_read_dots1, fields=_SHARED_FIELDS | _WINDOW_FIELDS,
    bias=True, fp32=_FP32,
)  # fmt: skip
GLM4_MOE = Family(
    "Glm4MoeForCausalLM", "glm4_moe", "GLM-4-MoE",
    defaults=_defaults(8, 131072, 1e-5, 10000.0, first_k_dense_replace=1, norm_topk_prob=True,
                       n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                       use_qk_norm=False),
    fixed={"attention_bias": False},
    write=_write_glm4_moe, read=_read_glm4_moe,
    # the multi-token prediction layers are not part of the causal LM (their tensors, where
    # a checkpoint has them, are refused by name)
    fields=_SHARED_FIELDS | {"use_qk_norm", "partial_rotary_factor",
                             "num_nextn_predict_layers", "num_mtp_layers"},
    bias=True, fp32=_FP32, rope_fields=("partial_rotary_factor",),
)  # fmt: skip
DEEPSEEK_V3 = Family(
    "DeepseekV3ForCausalLM", "deepseek_v3", "DeepSeek-V3",
    defaults=_defaults(128, 4096, 1e-6, 10000.0, first_k_dense_replace=3, norm_topk_prob=True,
                       n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                       n_group=8, topk_group=4, routed_scaling_factor=2.5,
                       moe_intermediate_size=2048, intermediate_size=18432, q_lora_rank=1536,
                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                       v_head_dim=128),
    fixed={"attention_bias": False, "rope_interleave": True, "pretraining_tp": 1},
    write=_write_deepseek_v3, read=_read_deepseek_v3,
    # MTP layers: transformers' model leaves them out, and so does hp's (`_check_extra`)
    fields=_SHARED_FIELDS | {*_MLA_FIELDS, "qk_head_dim", "num_nextn_predict_layers",
                             "num_mtp_layers"},
    bias=True, fp32=_FP32,
)  # fmt: skip
FAMILIES = (LLAMA, QWEN3, MIXTRAL, QWEN3_MOE, DOTS1, GLM4_MOE, DEEPSEEK_V3)


def family_of(config: ModelConfig) -> Family:
    """The family whose model is exactly `config`'s, else a one-line TrainError naming the
    key no family takes."""
    moe = config.moe
    if config.mla is not None:
        if moe is not None and moe.router == "softmax":
            raise TrainError(
                'model.moe.router = "softmax" with model.attention_kind = "mla" is in no '
                'transformers family (DeepSeek-V3 routes by sigmoid); set router = "sigmoid"'
            )
        if moe is None:
            return DEEPSEEK_V3
    if moe is None:
        return QWEN3 if config.qk_norm else LLAMA
    if moe.router == "softmax":
        if moe.topk_groups < moe.groups:
            raise TrainError(
                f"model.moe.topk_groups = {moe.topk_groups} of groups = {moe.groups} with "
                'router = "softmax" is in no transformers family hp writes (DeepSeek-V2\'s '
                'routing); router = "sigmoid" exports it (Dots1, GLM-4-MoE)'
            )
        if moe.shared_experts:
            raise TrainError(
                f'model.moe.shared_experts = {moe.shared_experts} with router = "softmax" '
                "is in no transformers family (Qwen2-MoE gates its shared expert with a "
                'sigmoid, hp does not); router = "sigmoid" exports with shared experts'
            )
        if moe.route_scale != 1:
            raise TrainError(
                f'model.moe.route_scale = {moe.route_scale!r} with router = "softmax" is in '
                "no transformers family (Mixtral and Qwen3-MoE do not scale the weights)"
            )
        if config.qk_norm:
            return QWEN3_MOE
        if not moe.renormalize:
            raise TrainError(
                "model.moe.renormalize = false is not Mixtral's routing (Mixtral renormalises "
                "the top-k weights); Qwen3-MoE (norm_topk_prob false) has it, with "
                "model.qk_norm = true"
            )
        if moe.first_dense_layers:
            raise TrainError(
                f"model.moe.first_dense_layers = {moe.first_dense_layers}: Mixtral has no "
                "dense layers; Qwen3-MoE (mlp_only_layers) has them, with model.qk_norm = true"
            )
        return MIXTRAL
    if moe.experts < 2:  # Dots1's and GLM-4-MoE's router ranks a group by its top 2
        raise TrainError(
            'model.moe.experts = 1 with router = "sigmoid" is in no transformers family (Dots1 '
            "and GLM-4-MoE score each group of experts by its best two)"
        )
    if not moe.shared_experts:
        raise TrainError(
            'model.moe.shared_experts = 0 with router = "sigmoid" is in no transformers '
            "family (Dots1 and GLM-4-MoE, DeepSeek-V3's routing with hp's attention, always "
            "have shared experts)"
        )
    if config.mla is not None:
        return DEEPSEEK_V3
    return DOTS1 if config.qk_norm else GLM4_MOE


def export_family(config: ModelConfig) -> Family:
    """`family_of`, and what an export of a trained model needs beyond its shape: under
    softmax, a balancing bias (load_balance "bias") chose the experts, and neither Mixtral
    nor Qwen3-MoE has one (init_from may take it: the bias starts at zero)."""
    family = family_of(config)
    if config.mtp is not None and family is not DEEPSEEK_V3:
        raise TrainError(
            f"model.mtp: hp's {family.label} has no multi-token prediction layers (DeepSeek-V3's "
            "checkpoints hold them); export with --mtp drop"
        )
    moe = config.moe
    if moe is not None and moe.router == "softmax" and moe.load_balance == "bias":
        raise TrainError(
            'model.moe.load_balance = "bias" with router = "softmax" is in no transformers '
            f"family: the bias chose the experts, and {family.label} has none"
        )
    return family
