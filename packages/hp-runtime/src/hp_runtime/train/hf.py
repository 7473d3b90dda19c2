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
import shutil
from typing import Any

import torch
from torch import nn

from hp_runtime.model import ModelConfig, canonical_name
from hp_runtime.train.launch import TrainError

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
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,  # transformers 4; 5 reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": config.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def model_config_from_hf(directory: str) -> dict[str, Any]:
    """The `ModelConfig` fields an HF Llama `config.json` describes."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as stream:
            hf = json.load(stream)
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainError(f"{path}: cannot read an HF config ({exc})") from None
    if hf.get("model_type") not in (None, "llama"):
        raise TrainError(f"{path}: model_type {hf.get('model_type')!r}; hp loads Llama models")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise TrainError(f"{path}: rope scaling {rope!r} is not supported (plain rotary only)")
    return {
        "vocab_size": hf["vocab_size"],
        "dim": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
        "ffn_hidden": hf["intermediate_size"],
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "rope_theta": float(
            (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
        ),
        "norm_eps": hf.get("rms_norm_eps", 1e-5),
        "tie_embeddings": hf.get("tie_word_embeddings", False),
    }


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
    """`tensors` (hp names, full) as an HF Llama directory, written whole or not at all."""
    st = _safetensors()
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
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files = []
    for i, shard in enumerate(shards, 1):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        )
        st.save_file(shard, os.path.join(tmp, file), metadata={"format": "pt"})
        files.append(file)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in named.values())},
            "weight_map": {
                name: f for f, shard in zip(files, shards, strict=True) for name in shard
            },
        }
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as stream:
            json.dump(index, stream, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as stream:
        json.dump(hf_config(config, dtype), stream, indent=2)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    return files


def read_hf(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors directory by HF name (memory-mapped)."""
    st = _safetensors()
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise TrainError(f"{directory}: no *.safetensors files (an HF Llama directory?)")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(st.load_file(os.path.join(directory, file)))
    return out


@torch.no_grad()
def init_from_hf(modules: list[nn.Module], config: ModelConfig, directory: str) -> None:
    """Copy an HF Llama's weights into this rank's model parts (any layout): each parameter's
    full tensor is read and the local shard kept, as `init_weights` does."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    expected = model_config_from_hf(directory)
    for key, value in expected.items():
        if getattr(config, key) != value:
            raise TrainError(
                f"model.init_from: {directory} has {key}={value}, the config model.{key}="
                f"{getattr(config, key)}; set model.{key} = {value!r}"
            )
    weights = read_hf(directory)
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
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)


def export_checkpoint(
    checkpoint: str, out: str, dtype: str = "bfloat16", max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """A hp-train checkpoint (any layout it was saved from) as an HF Llama directory; the
    model's tensors are read in one process, the optimizer's are not read at all."""
    import tomllib

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hp_runtime.model import Transformer
    from hp_runtime.train.checkpoint import first_line, read_meta
    from hp_runtime.train.config import build_config

    config = build_config(tomllib.loads(read_meta(checkpoint)["config"])).model
    with torch.device("meta"):
        model = Transformer(config)
    wanted = {
        name: torch.empty(param.shape, dtype=torch.float32)
        for name, param in model.named_parameters()
    }
    try:
        dcp.load({"model": wanted}, checkpoint_id=checkpoint, no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's own are long: keep a line
        raise TrainError(f"{checkpoint}: cannot be read: {first_line(exc)}") from None
    return write_hf(wanted, config, out, dtype, max_shard_bytes)
