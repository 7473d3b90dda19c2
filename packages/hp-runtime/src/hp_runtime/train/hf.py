"""Hugging Face Llama checkpoints in and out: `hp-train export` writes `model.safetensors`
(sharded above a size) and a `config.json` that `transformers.LlamaForCausalLM` loads;
`model.init_from` starts a run from such a directory, on any layout.

hp's rotary embedding rotates the two halves of each head (x[:half], x[half:]), as HF's
`rotate_half` does, so q and k projections map over unpermuted (Meta's original checkpoints
pair neighbouring dimensions instead and need a permutation; HF checkpoints do not). The tests
check this against transformers' own logits rather than assume it.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

import torch
from hp_data.errors import first_line
from torch import nn

from hp_runtime.model import ModelConfig
from hp_runtime.model.config import FieldError, RopeScaling
from hp_runtime.parallel.init import copy_full_
from hp_runtime.parallel.parallelize import canonical_name
from hp_runtime.train.config import toml_value
from hp_runtime.train.errors import TrainError
from hp_runtime.train.exportdir import ExportTarget

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_name(name: str) -> str:
    """hp's parameter name → HF Llama's."""
    if name in _TOP:
        return _TOP[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None or match.group(2) not in _LAYER:
        raise KeyError(f"no HF name for {name}")
    return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"


# An HF rope dict's llama3 fields, and the RopeScaling field each sets.
_HF_SCALING = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_seq_len",
}


def _hf_rope(config: ModelConfig) -> dict[str, Any]:
    """The rotary fields of config.json: rope_theta and rope_scaling, which transformers 4
    reads, and rope_parameters, which 5 reads (both as Meta's Llama 3.1 configs spell them)."""
    scaling = config.rope_scaling
    if scaling is None:
        return {
            "rope_theta": config.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        }
    rope = {"rope_type": "llama3", **{hf: getattr(scaling, hp) for hf, hp in _HF_SCALING.items()}}
    return {
        "rope_theta": config.rope_theta,
        "rope_scaling": rope,
        "rope_parameters": {**rope, "rope_theta": config.rope_theta},
    }


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_size,
        "max_position_embeddings": config.max_seq_len,
        **_hf_rope(config),
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": config.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


_REQUIRED = object()
# config.json's shape fields: the ModelConfig field each sets, and transformers' LlamaConfig
# default when absent (num_key_value_heads: num_attention_heads).
_SHAPE: dict[str, tuple[str, Any]] = {
    "vocab_size": ("vocab_size", _REQUIRED),
    "hidden_size": ("dim", _REQUIRED),
    "intermediate_size": ("ffn_hidden", _REQUIRED),
    "num_hidden_layers": ("n_layers", _REQUIRED),
    "num_attention_heads": ("n_heads", _REQUIRED),
    "num_key_value_heads": ("n_kv_heads", None),
    "max_position_embeddings": ("max_seq_len", 2048),
    "rms_norm_eps": ("norm_eps", 1e-6),
    "tie_word_embeddings": ("tie_embeddings", False),
}
# Fields of a Llama config that change the model: hp implements transformers' default only.
_FIXED: dict[str, Any] = {
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "pretraining_tp": 1,
    "is_encoder_decoder": False,
    "is_decoder": False,
    "add_cross_attention": False,
    "tie_encoder_decoder": False,
    "cross_attention_hidden_size": None,
    "chunk_size_feed_forward": 0,
    "pruned_heads": {},
}
# Bookkeeping transformers writes (names, token ids, generation and output defaults): the
# weights and the forward pass do not depend on them, so any value is accepted.
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
    begin_suppress_tokens""".split()
)
_KNOWN = {
    *_SHAPE, *_FIXED, *_BOOKKEEPING,
    "rope_theta", "rope_parameters", "rope_scaling", "head_dim", "architectures",
}  # fmt: skip


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
    if not ok or value <= 0:
        noun = "a positive integer" if kind is int else "a positive number"
        raise TrainError(f"{path}: {key}={_json(value)} must be {noun}")
    return value


def _scaling(path: str, key: str, rope: dict[str, Any]) -> RopeScaling:
    """A `rope_type: "llama3"` dict as RopeScaling, every field given and checked."""
    values = {}
    for name, field in _HF_SCALING.items():
        if name not in rope:
            raise TrainError(
                f'{path}: {key}.{name} is missing; rope_type "llama3" gives '
                f"{', '.join(_HF_SCALING)}"
            )
        value = rope[name]  # JSON's 8 is the float 8.0 transformers reads
        numeric = type(value) is int and field != "original_max_seq_len"
        values[field] = float(value) if numeric else value
    try:
        return RopeScaling(type="llama3", **values)
    except FieldError as exc:
        name = {hp: hf for hf, hp in _HF_SCALING.items()}[exc.field]
        raise TrainError(f"{path}: {key}.{name}={_json(exc.value)} {exc.problem}") from None


def _rope(path: str, hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
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
        if kind not in ("default", "llama3"):
            raise TrainError(
                f'{path}: {key}.rope_type={_json(kind)} is not supported; hp implements "default" '
                'and "llama3"'
            )
        takes = ["rope_type", "rope_theta", *(_HF_SCALING if kind == "llama3" else ())]
        for field in rope:
            if field not in (*takes, "type"):
                raise TrainError(
                    f"{path}: {key}.{field}={_json(rope[field])} is not supported (rope_type "
                    f"{_json(kind)} takes {', '.join(takes)})"
                )
        if "rope_theta" in rope:
            thetas[f"{key}.rope_theta"] = rope["rope_theta"]
        scalings[key] = _scaling(path, key, rope) if kind == "llama3" else None
    for key, value in thetas.items():
        _positive(path, key, value, float)
    if len(set(thetas.values())) > 1:
        given = ", ".join(f"{k}={_json(v)}" for k, v in thetas.items())
        raise TrainError(f"{path}: {given} disagree; give one rotary theta")
    if len(set(scalings.values())) > 1:
        raise TrainError(f"{path}: rope_parameters and rope_scaling disagree; give one scaling")
    return float(next(iter(thetas.values()), 10000.0)), next(iter(scalings.values()), None)


def model_config_from_hf(directory: str) -> dict[str, Any]:
    """The `ModelConfig` fields an HF Llama `config.json` describes. Every field must be one
    hp implements (or bookkeeping): anything else would load a model hp computes differently,
    so it is refused by name."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as stream:
            hf = json.load(stream)
    except (OSError, ValueError) as exc:
        raise TrainError(f"{path}: cannot read an HF config ({exc})") from None
    if not isinstance(hf, dict):
        raise TrainError(f"{path}: not a JSON object (an HF config.json?)")
    for key in hf:
        if key not in _KNOWN:
            raise TrainError(
                f"{path}: {key} is not a field hp's Llama implements; hp loads plain Llama "
                "models only"
            )
    for key, default in _FIXED.items():
        if key in hf and not _same(hf[key], default):
            raise TrainError(
                f"{path}: {key}={_json(hf[key])} is not supported; hp's Llama has "
                f"{key}={_json(default)} only"
            )
    if hf.get("architectures") not in (None, ["LlamaForCausalLM"]):
        raise TrainError(
            f"{path}: architectures={_json(hf['architectures'])}; hp loads LlamaForCausalLM"
        )
    fields: dict[str, Any] = {}
    for key, (field, default) in _SHAPE.items():
        value = hf.get(key)
        if value is None:
            if default is _REQUIRED:
                raise TrainError(f"{path}: {key} is missing; an HF Llama config.json gives it")
            value = fields["n_heads"] if field == "n_kv_heads" else default
        if field == "tie_embeddings":
            if not isinstance(value, bool):
                raise TrainError(f"{path}: {key}={_json(value)} must be true or false")
        else:
            _positive(path, key, value, float if field == "norm_eps" else int)
        fields[field] = value
    fields["rope_theta"], fields["rope_scaling"] = _rope(path, hf)
    for whole, part in (
        ("hidden_size", "num_attention_heads"),
        ("num_attention_heads", "num_key_value_heads"),
    ):
        dividend, divisor = fields[_SHAPE[whole][0]], fields[_SHAPE[part][0]]
        if dividend % divisor:
            raise TrainError(f"{path}: {whole}={dividend} is not a multiple of {part}={divisor}")
    try:
        shape = ModelConfig(**fields)
    except ValueError as exc:
        raise TrainError(f"{path}: {exc}") from None
    head_dim = hf.get("head_dim")
    if head_dim is not None and not _same(head_dim, shape.head_size):
        raise TrainError(
            f"{path}: head_dim={_json(head_dim)}, but hp's Llama has hidden_size / "
            f"num_attention_heads = {shape.head_size}"
        )
    return fields


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise TrainError("HF checkpoints need safetensors: pip install 'hp-runtime[hf]'") from None
    return safetensors.torch


def write_hf(
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    out: str,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """`tensors` (hp names, full) as an HF Llama directory, written whole or not at all and
    never over anything but a previous export (`exportdir`)."""
    st = _safetensors()
    target = ExportTarget(out)
    named = {
        hf_name(name): t.to(DTYPES[dtype]).contiguous()
        for name, t in tensors.items()
        if not (config.tie_embeddings and name == "output.weight")
    }
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(named):
        nbytes = named[name].numel() * named[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = named[name]
        size += nbytes

    def write(directory: str) -> list[str]:
        files = []
        for i, shard in enumerate(shards, 1):
            file = (
                "model.safetensors"
                if len(shards) == 1
                else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            )
            st.save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
            files.append(file)
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in named.values())
            index = {
                "metadata": {"total_size": total},
                "weight_map": {
                    name: f for f, shard in zip(files, shards, strict=True) for name in shard
                },
            }
            files.append("model.safetensors.index.json")
            with open(os.path.join(directory, files[-1]), "w") as stream:
                json.dump(index, stream, indent=2)
        with open(os.path.join(directory, "config.json"), "w") as stream:
            json.dump(hf_config(config, dtype), stream, indent=2)
        return [*files, "config.json"]

    return [f for f in target.commit(write) if f.endswith(".safetensors")]


def _safetensors_files(directory: str) -> list[str]:
    """The weight files of an HF directory: those its index names, else every *.safetensors.
    Pickles (pytorch_model.bin, *.pt) are never read: loading one runs arbitrary code."""
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise TrainError(f"{directory} {what}; give an HF Llama directory")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as stream:
                files = sorted(set(json.load(stream)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TrainError(
                f"{index}: not a safetensors index ({first_line(exc, named=True)})"
            ) from None
        for file in files:
            if not isinstance(file, str) or not os.path.isfile(os.path.join(directory, file)):
                raise TrainError(f"{index}: names {file}, which {directory} does not hold")
        return files
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        pickles = sorted(f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth")))
        if pickles:
            raise TrainError(
                f"{directory}: holds {pickles[0]} (a pickle, which hp never loads) and no "
                "*.safetensors; convert it to safetensors first, e.g. with transformers' "
                "from_pretrained(...).save_pretrained(...) on a machine you trust it on"
            )
        raise TrainError(f"{directory}: no *.safetensors files (an HF Llama directory?)")
    return files


def read_hf(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors directory by HF name; a name in two files is an
    error (which one a model got would depend on the order they were read)."""
    st = _safetensors()
    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for file in _safetensors_files(directory):
        path = os.path.join(directory, file)
        try:
            tensors = st.load_file(path)
        except Exception as exc:  # safetensors' own error types; any is one line here
            raise TrainError(
                f"{path}: not a readable safetensors file ({first_line(exc, named=True)})"
            ) from None
        for name in tensors:
            if name in where:
                raise TrainError(f"{directory}: {name} is in both {where[name]} and {file}")
            where[name] = file
        out.update(tensors)
    return out


_INV_FREQ = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _check_extra(weights: dict[str, torch.Tensor], config: ModelConfig, directory: str) -> None:
    """Tensors no parameter of hp's model takes are refused by name (a bias hp has no place
    for would silently be dropped), except two that carry nothing new: a copy of the
    embedding as lm_head.weight in a tied model, and the rotary `inv_freq` buffers older
    transformers saved, when they equal hp's own frequencies."""
    from hp_runtime.model import Transformer
    from hp_runtime.model.llama import inverse_frequencies

    with torch.device("meta"):
        model = Transformer(config)
    taken = {hf_name(canonical_name(name)) for name, _ in model.named_parameters()}
    if config.tie_embeddings:
        taken.discard("lm_head.weight")
    freqs = inverse_frequencies(config, dtype=torch.float64)
    unused = []
    for name in sorted(set(weights) - taken):
        tensor = weights[name]
        if name == "lm_head.weight" and config.tie_embeddings:
            if torch.equal(tensor, weights.get("model.embed_tokens.weight", tensor[:0])):
                continue
            raise TrainError(
                f"model.init_from: {directory} has an lm_head.weight that differs from "
                "model.embed_tokens.weight, but its config ties them (tie_word_embeddings)"
            )
        if _INV_FREQ.fullmatch(name) and tensor.shape == freqs.shape:
            tolerance = max(torch.finfo(tensor.dtype).eps * 4, 1e-6)
            if torch.allclose(tensor.double(), freqs, rtol=tolerance, atol=0):
                continue
        unused.append(name)
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise TrainError(
            f"model.init_from: {directory} has tensors hp's Llama has no place for: "
            f"{', '.join(unused[:3])}{more}"
        )


def check_hf_config(config: ModelConfig, directory: str) -> None:
    """Refuse an HF directory whose `config.json` is not the model `config` describes (run
    before any model is built, and again when the weights are read)."""
    expected = model_config_from_hf(directory)
    for key, value in expected.items():
        have = getattr(config, key)
        if have != value:
            setting = repr(value)
            if key == "rope_scaling":  # a table: as config.toml writes it
                have, value, setting = toml_value(have), toml_value(value), toml_value(value)
            raise TrainError(
                f"model.init_from: {directory} has {key}={value}, the config model.{key}="
                f"{have}; set model.{key} = {setting}"
            )


@torch.no_grad()
def init_from_hf(modules: list[nn.Module], config: ModelConfig, directory: str) -> None:
    """Copy an HF Llama's weights into this rank's model parts (any layout): each parameter's
    full tensor is read and the local shard kept, as `init_weights` does."""
    check_hf_config(config, directory)
    weights = read_hf(directory)
    _check_extra(weights, config, directory)
    for module in modules:
        for wrapped, param in module.named_parameters():
            name = canonical_name(wrapped)
            source = hf_name(name)
            if source == "lm_head.weight" and config.tie_embeddings:
                source = "model.embed_tokens.weight"
            if source not in weights:
                raise TrainError(f"model.init_from: {directory} has no tensor {source}")
            full = weights[source].to(torch.float32)
            if tuple(full.shape) != tuple(param.shape):
                raise TrainError(
                    f"model.init_from: {source} has shape {list(full.shape)}, the model's "
                    f"{name} {list(param.shape)}"
                )
            copy_full_(param, full)


def export_checkpoint(
    checkpoint: str, out: str, dtype: str = "bfloat16", max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """A hp-train checkpoint (any layout it was saved from) as an HF Llama directory; the
    model's tensors are read in one process, the optimizer's are not read at all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hp_runtime.model import Transformer
    from hp_runtime.train.checkpoint import checked_metadata, read_meta, saved_model
    from hp_runtime.train.config import build_model
    from hp_runtime.train.errors import ConfigError
    from hp_runtime.train.storage import CheckedReader, SafeLoadPlanner

    ExportTarget(out)  # a bad --out is refused before the checkpoint is read
    meta = read_meta(checkpoint)
    checked_metadata(checkpoint, meta)  # checksums, and nothing unpickled beyond DCP's types
    try:  # only [model]: the run's other keys may be of an older hp-train
        _, config, _ = build_model(saved_model(meta))
    except ConfigError as exc:
        raise TrainError(f"{checkpoint}: its stored [model] config: {exc}") from None
    with torch.device("meta"):
        model = Transformer(config)
    wanted = {
        name: torch.empty(param.shape, dtype=torch.float32)
        for name, param in model.named_parameters()
    }
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": just so
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                {"model": wanted},
                storage_reader=CheckedReader(checkpoint),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    except (Exception, CheckpointException) as exc:  # DCP's own are long: keep a line
        raise TrainError(f"{checkpoint}: cannot be read: {first_line(exc, named=True)}") from None
    return write_hf(wanted, config, out, dtype, max_shard_bytes)
