"""An HF config.json, written and read: the fields every family shares (its shape, the rotary
embedding, the values hp fixes and the bookkeeping it accepts), each family's own through its
`Family` (`hf_families.py`). Reading refuses by name any field hp does not implement.
"""

from __future__ import annotations

from typing import Any

from hp_runtime.model import ModelConfig
from hp_runtime.model.config import FieldError, RopeScaling
from hp_runtime.train.errors import TrainError
from hp_runtime.train.hf_families import (
    _REQUIRED,
    FAMILIES,
    LLAMA,
    Family,
    _json,
    _positive,
    _same,
    export_family,
)
from hp_runtime.train.hf_rope import HF_SCALINGS, hf_rope


def config_json(config: ModelConfig, dtype: str) -> dict[str, Any]:
    """The config.json of `config`'s model in its family (`export_family`)."""
    family = export_family(config)
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_size,
        "max_position_embeddings": config.max_seq_len,
        **hf_rope(config),
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        **family.write(config),
        "initializer_range": config.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


# config.json's shape fields in every family: the ModelConfig field each sets, and the
# default when absent: the family's where it has one (transformers' for its config class),
# else this (num_key_value_heads: num_attention_heads, as LlamaConfig has it).
_SHAPE: dict[str, tuple[str, Any]] = {
    "vocab_size": ("vocab_size", _REQUIRED),
    "hidden_size": ("dim", _REQUIRED),
    "num_hidden_layers": ("n_layers", _REQUIRED),
    "num_attention_heads": ("n_heads", _REQUIRED),
    "num_key_value_heads": ("n_kv_heads", None),
    "max_position_embeddings": ("max_seq_len", _REQUIRED),
    "rms_norm_eps": ("norm_eps", _REQUIRED),
    "tie_word_embeddings": ("tie_embeddings", False),
}
# Fields that change the model in every family: hp implements transformers' default only.
_FIXED: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "is_encoder_decoder": False,
    "is_decoder": False,
    "add_cross_attention": False,
    "tie_encoder_decoder": False,
    "cross_attention_hidden_size": None,
    "chunk_size_feed_forward": 0,
    "pruned_heads": {},
}
# Bookkeeping transformers writes (names, token ids, generation and output defaults, the MoE
# families' training loss over the router's logits): the weights and the forward pass do not
# depend on them, so any value is accepted.
_BOOKKEEPING = frozenset(
    """transformers_version _name_or_path torch_dtype dtype bos_token_id eos_token_id
    pad_token_id sep_token_id decoder_start_token_id initializer_range use_cache
    output_hidden_states output_attentions return_dict id2label label2id problem_type
    tokenizer_class prefix task_specific_params finetuning_task torchscript use_bfloat16
    tf_legacy_loss max_length min_length do_sample early_stopping num_beams num_beam_groups
    diversity_penalty temperature top_k top_p typical_p repetition_penalty length_penalty
    no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids num_return_sequences
    output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id
    remove_invalid_values exponential_decay_length_penalty suppress_tokens
    begin_suppress_tokens output_router_logits router_aux_loss_coef""".split()
)
_KNOWN = {
    *_SHAPE, *_FIXED, *_BOOKKEEPING,
    "rope_theta", "rope_parameters", "rope_scaling", "head_dim", "architectures", "model_type",
}  # fmt: skip
# hp's MoE fields a config.json describes (the others are how it trains: load_balance, ...).
MOE_SHAPE = (
    "experts", "top_k", "expert_ffn_hidden", "shared_experts", "router", "renormalize",
    "route_scale", "first_dense_layers",
)  # fmt: skip


def _scaling(path: str, key: str, rope: dict[str, Any], kind: str) -> RopeScaling:
    """A `rope_type` "llama3" or "yarn" dict as RopeScaling, its fields checked; llama3 gives
    every field, YaRN `factor` and `original_max_position_embeddings` (the rest default)."""
    names = HF_SCALINGS[kind]
    values = {}
    for name, field in names.items():
        required = kind == "llama3" or field in ("factor", "original_max_seq_len")
        if name not in rope:
            if not required:
                continue
            need = ", ".join(n for n in names if kind == "llama3" or n in list(names)[:2])
            raise TrainError(
                f"{path}: {key}.{name} is missing; rope_type {_json(kind)} gives {need}"
            )
        value = rope[name]  # JSON's 8 is the float 8.0 transformers reads
        numeric = type(value) is int and field != "original_max_seq_len"
        values[field] = float(value) if numeric else value
    try:
        return RopeScaling(type=kind, **values)  # type: ignore[arg-type]
    except FieldError as exc:
        name = {hp: hf for hf, hp in names.items()}[exc.field]
        raise TrainError(f"{path}: {key}.{name}={_json(exc.value)} {exc.problem}") from None


def _rope(path: str, hf: dict[str, Any], family: Family) -> tuple[float, RopeScaling | None]:
    """The rotary theta and scaling: rope_parameters (transformers 5) and rope_scaling (4) may
    each say "default" (plain rotary) or "llama3" (Llama 3.1's scaling), with a theta; where
    several give the theta or the scaling, they must agree."""
    thetas = {}
    if "rope_theta" in hf:
        thetas["rope_theta"] = hf["rope_theta"]
    scalings: dict[str, RopeScaling | None] = {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise TrainError(f"{path}: {key}={_json(rope)} must be an object with a rope_type")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if "type" in rope and rope["type"] != kind:  # transformers' older name of rope_type
            raise TrainError(f"{path}: {key}.type and {key}.rope_type disagree")
        if kind not in ("default", *HF_SCALINGS):
            raise TrainError(
                f'{path}: {key}.rope_type={_json(kind)} is not supported; hp implements "default", '
                '"llama3" and "yarn"'
            )
        if kind == "yarn" and rope.get("truncate", True) is not True:
            raise TrainError(
                f"{path}: {key}.truncate={_json(rope['truncate'])} is not supported; hp's YaRN "
                "rounds its ramp's bounds outwards (truncate true)"
            )
        takes = ["rope_type", "rope_theta", *HF_SCALINGS.get(kind, ())]
        takes += ["truncate"] if kind == "yarn" else []
        for field in rope:
            if field not in (*takes, *family.rope_fields, "type"):
                raise TrainError(
                    f"{path}: {key}.{field}={_json(rope[field])} is not supported (rope_type "
                    f"{_json(kind)} takes {', '.join(takes)})"
                )
        if "rope_theta" in rope:
            thetas[f"{key}.rope_theta"] = rope["rope_theta"]
        scalings[key] = _scaling(path, key, rope, kind) if kind in HF_SCALINGS else None
    for key, value in thetas.items():
        _positive(path, key, value, float)
    if len(set(thetas.values())) > 1:
        given = ", ".join(f"{k}={_json(v)}" for k, v in thetas.items())
        raise TrainError(f"{path}: {given} disagree; give one rotary theta")
    if len(set(scalings.values())) > 1:
        raise TrainError(f"{path}: rope_parameters and rope_scaling disagree; give one scaling")
    theta = next(iter(thetas.values()), family.defaults["rope_theta"])
    return float(theta), next(iter(scalings.values()), None)


def _family_in(path: str, hf: dict[str, Any]) -> Family:
    """The family config.json names by model_type (else by architectures; neither: Llama)."""
    kind, architectures = hf.get("model_type"), hf.get("architectures")
    if kind is None:
        named = [f for f in FAMILIES if architectures == [f.architecture]]
        family = named[0] if named else LLAMA
    else:
        by_type = {f.model_type: f for f in FAMILIES}
        if kind not in by_type:
            raise TrainError(
                f"{path}: model_type={_json(kind)} is not supported; hp reads "
                f"{', '.join(_json(f.model_type) for f in FAMILIES)}"
            )
        family = by_type[kind]
    if architectures is not None and architectures != [family.architecture]:
        raise TrainError(
            f"{path}: architectures={_json(architectures)}; hp loads {family.architecture}"
        )
    return family


def read_config(path: str, hf: Any) -> tuple[Family, dict[str, Any]]:
    """The family and the `ModelConfig` fields of `hf`, an HF `config.json` (read from
    `path`). Every field must be one hp implements (or bookkeeping): anything else would
    load a model hp computes differently, so it is refused by name."""
    if not isinstance(hf, dict):
        raise TrainError(f"{path}: not a JSON object (an HF config.json?)")
    family = _family_in(path, hf)
    label = family.label
    for key in hf:
        if key not in _KNOWN and key not in family.fixed and key not in family.fields:
            raise TrainError(
                f"{path}: {key} is not a field hp's {label} implements; hp loads plain "
                f"{label} models only"
            )
    for key, default in {**_FIXED, **family.fixed}.items():
        if key in hf and not _same(hf[key], default):
            raise TrainError(
                f"{path}: {key}={_json(hf[key])} is not supported; hp's {label} has "
                f"{key}={_json(default)} only"
            )
    fields: dict[str, Any] = {}
    for key, (field, default) in _SHAPE.items():
        value = hf.get(key)
        if value is None:
            default = family.defaults.get(key, default)
            if default is _REQUIRED:
                raise TrainError(f"{path}: {key} is missing; an HF {label} config.json gives it")
            value = fields["n_heads"] if default is None else default
        if field == "tie_embeddings":
            if not isinstance(value, bool):
                raise TrainError(f"{path}: {key}={_json(value)} must be true or false")
        else:
            _positive(path, key, value, float if field == "norm_eps" else int)
        fields[field] = value
    fields["rope_theta"], fields["rope_scaling"] = _rope(path, hf, family)
    fields.update({"qk_norm": False, "moe": None, **family.read(path, hf, family)})
    if fields.get("mla") is not None:  # MLA's shapes are its own: transformers' DeepSeek-V3
        fields["n_kv_heads"] = fields["n_heads"]  # ignores num_key_value_heads, and head_dim
        return family, _checked(path, fields)
    heads, kv = fields["n_heads"], fields["n_kv_heads"]
    if heads % kv:
        raise TrainError(
            f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
        )
    # A head's width is its own field (Qwen3's is not hidden_size / num_attention_heads);
    # absent, the family's transformers default, else hidden_size / num_attention_heads.
    head_dim = hf.get("head_dim", family.defaults.get("head_dim"))
    if head_dim is not None:
        head_dim = _positive(path, "head_dim", head_dim, int)
        dim, heads = fields["dim"], fields["n_heads"]
        if dim % heads or head_dim != dim // heads:  # else derived, as hp's own configs
            fields["head_dim"] = head_dim
    return family, _checked(path, fields)


def _checked(path: str, fields: dict[str, Any]) -> dict[str, Any]:
    try:
        ModelConfig(**fields)
    except ValueError as exc:
        raise TrainError(f"{path}: {exc}") from None
    return fields


def mtp_depth(path: str, hf: dict[str, Any]) -> int:
    """The multi-token prediction layers a DeepSeek-V3 config.json says its checkpoint holds
    after the model's (`num_nextn_predict_layers`; transformers 5's `num_mtp_layers`)."""
    given = {k: hf[k] for k in ("num_nextn_predict_layers", "num_mtp_layers") if k in hf}
    if len({_json(v) for v in given.values()}) > 1:
        both = ", ".join(f"{k}={_json(v)}" for k, v in given.items())
        raise TrainError(f"{path}: {both} disagree; give one")
    depth = next(iter(given.values()), 0)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise TrainError(f"{path}: num_nextn_predict_layers={_json(depth)} must be an integer >= 0")
    return depth
