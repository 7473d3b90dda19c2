"""Hugging Face checkpoints in and out: `hp-train export` writes `model.safetensors`
(sharded above a size) and a `config.json` that transformers loads as the one family that
computes exactly hp's model (`hf_families.py`: Llama, Qwen3, Mixtral, Qwen3-MoE, Dots1,
GLM-4-MoE); `model.init_from` starts a run from such a directory, on any layout.

hp's rotary embedding rotates the two halves of each head (x[:half], x[half:]), as HF's
`rotate_half` does, so q and k projections map over unpermuted (Meta's original checkpoints
pair neighbouring dimensions instead and need a permutation; HF checkpoints do not). The tests
check this against transformers' own logits rather than assume it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from typing import Any

import torch
from hp_data.fs import directory_problem, first_line
from torch import nn

from hp_runtime.model import ModelConfig
from hp_runtime.model.config import MoEConfig
from hp_runtime.parallel.init import copy_full_
from hp_runtime.parallel.parallelize import canonical_name
from hp_runtime.train.config import toml_value
from hp_runtime.train.errors import TrainError
from hp_runtime.train.export_output import ExportTarget
from hp_runtime.train.hf_config import MOE_SHAPE, config_json, mtp_depth, read_config
from hp_runtime.train.hf_families import DEEPSEEK_V3, Family, export_family, family_of
from hp_runtime.train.hf_names import MTP_COPIES, STACKED, hf_names, is_fused, rope_rows

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _config_json(directory: str) -> tuple[str, Any]:
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as stream:
            return path, json.load(stream)
    except (OSError, ValueError) as exc:
        raise TrainError(f"{path}: cannot read an HF config ({exc})") from None


def read_hf_config(directory: str) -> tuple[Family, dict[str, Any]]:
    """The family and the `ModelConfig` fields of the HF `config.json` in `directory`."""
    return read_config(*_config_json(directory))


def model_config_from_hf(directory: str) -> dict[str, Any]:
    """The `ModelConfig` fields an HF `config.json` describes (see `read_hf_config`)."""
    return read_hf_config(directory)[1]


def _check_moe(config: ModelConfig, label: str, moe: MoEConfig | None, directory: str) -> None:
    shape = {key: getattr(moe, key) for key in MOE_SHAPE} if moe is not None else None
    if config.moe is None or shape is None:
        if config.moe is None and shape is None:
            return
        have, setting = toml_value(config.moe), toml_value(shape)
        what = f"a {label} with experts" if shape is not None else f"a dense {label}"
        raise TrainError(
            f"model.init_from: {directory} is {what}, the config model.moe={have}; set "
            f"model.moe = {setting}"
        )
    for key, value in shape.items():
        have = getattr(config.moe, key)
        if have != value:
            raise TrainError(
                f"model.init_from: {directory} has moe.{key}={toml_value(value)}, the config "
                f"model.moe.{key}={toml_value(have)}; set model.moe.{key} = {toml_value(value)}"
            )


def _check_mtp(config: ModelConfig, family: Family, directory: str) -> None:
    """A model with multi-token prediction modules starts from a checkpoint with as many
    (DeepSeek-V3's layers after the model's); one without them leaves a checkpoint's out."""
    if config.mtp is None:
        return
    depth = mtp_depth(*_config_json(directory)) if family is DEEPSEEK_V3 else 0
    if not depth:
        raise TrainError(
            f"model.init_from: {directory} has no multi-token prediction layers, the config "
            f'model.mtp.depth={config.mtp.depth}; drop model.mtp (model.mtp = "none")'
        )
    if depth != config.mtp.depth:
        raise TrainError(
            f"model.init_from: {directory} has num_nextn_predict_layers={depth}, the config "
            f"model.mtp.depth={config.mtp.depth}; set model.mtp.depth = {depth} (or drop "
            "model.mtp)"
        )


def check_hf_config(config: ModelConfig, directory: str) -> Family:
    """Refuse an HF directory whose `config.json` is not the model `config` describes (run
    before any model is built, and again when the weights are read); its family."""
    family, expected = read_hf_config(directory)
    _check_mtp(config, family, directory)
    for key, value in expected.items():
        if key == "moe":
            _check_moe(config, family.label, value, directory)
            continue
        have = config.head_size if key == "head_dim" else getattr(config, key)
        if have != value:
            raise TrainError(
                f"model.init_from: {directory} has {key}={toml_value(value)}, the config "
                f"model.{key}={toml_value(have)}; set model.{key} = {toml_value(value)}"
            )
    return family


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise TrainError("HF checkpoints need safetensors: pip install 'hp-runtime[hf]'") from None
    return safetensors.torch


def _to_hf(
    family: Family, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: str
) -> dict[str, torch.Tensor]:
    """hp's full tensors by HF name: stacked experts split, one tensor each."""
    named = {}
    for name, tensor in tensors.items():
        if config.tie_embeddings and name == "output.weight":
            continue
        names = hf_names(family, config, name)
        if not names:  # hp's balancing bias, which chose nothing (`export_family`)
            continue
        balance = config.moe.load_balance if config.moe is not None else None
        if name.endswith("expert_bias") and balance != "bias":
            tensor = torch.zeros_like(tensor)  # hp chooses without it: so must the family
        rows = rope_rows(config, name, to_hf=True)
        tensor = tensor if rows is None else tensor[rows]
        stacked = STACKED.fullmatch(name) is not None
        for hf, part in zip(names, tensor.unbind(0) if stacked else [tensor], strict=True):
            kind = torch.float32 if hf.endswith(family.fp32) else DTYPES[dtype]
            named[hf] = part.to(kind, copy=stacked).contiguous()  # a view of the stack: copied
    for layer in range(config.n_layers, config.total_layers):  # DeepSeek's copies, per module
        for copy, name in MTP_COPIES.items():
            own = _sources(family, config, name, named)[0]
            named[f"model.layers.{layer}.{copy}"] = named[own].clone()
    return named


def write_hf(
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    out: str,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """`tensors` (hp names, full) as an HF directory of the model's family, written whole or
    not at all and never over anything but a previous export (`export_output`)."""
    with ExportTarget(out) as target:
        return _write_hf(tensors, config, target, dtype, max_shard_bytes)


def _write_hf(
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    target: ExportTarget,
    dtype: str,
    max_shard_bytes: int,
) -> list[str]:
    st = _safetensors()
    family = export_family(config)
    named = _to_hf(family, config, tensors, dtype)
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
            json.dump(config_json(config, dtype), stream, indent=2)
        return [*files, "config.json"]

    return [f for f in target.commit(write) if f.endswith(".safetensors")]


def _safetensors_files(directory: str) -> list[str]:
    """The weight files of an HF directory: those its index names, else every *.safetensors.
    Pickles (pytorch_model.bin, *.pt) are never read: loading one runs arbitrary code."""
    problem = directory_problem(directory)
    if problem is not None:
        raise TrainError(f"{problem}; give an HF model directory")
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
        raise TrainError(f"{directory}: no *.safetensors files (an HF model directory?)")
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


def _state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and persistent buffers (the MoE balancing bias), by canonical
    name: what a checkpoint holds of it."""
    persistent = {canonical_name(name) for name in module.state_dict()}
    buffers = [(n, b) for n, b in module.named_buffers() if canonical_name(n) in persistent]
    return [(canonical_name(n), t) for n, t in [*module.named_parameters(), *buffers]]


def _sources(
    family: Family, config: ModelConfig, name: str, weights: dict[str, torch.Tensor]
) -> list[str]:
    """The HF tensors hp's `name` is read from (a tied head: the embedding)."""
    if name == "output.weight" and config.tie_embeddings:
        return ["model.embed_tokens.weight"]
    return hf_names(family, config, name, is_fused(weights, name))


def _check_extra(weights: dict[str, torch.Tensor], config: ModelConfig, directory: str) -> None:
    """Tensors no parameter of hp's model takes are refused by name (a bias hp has no place
    for would silently be dropped), except two that carry nothing new: a copy of the
    embedding as lm_head.weight in a tied model, and the rotary `inv_freq` buffers older
    transformers saved, when they equal hp's own frequencies."""
    from hp_runtime.model import Transformer
    from hp_runtime.model.rotary import inverse_frequencies

    family = family_of(config)
    saved = mtp_depth(*_config_json(directory)) if family is DEEPSEEK_V3 else 0
    with torch.device("meta"):
        model = Transformer(config)
    taken = {hf for name, _ in _state(model) for hf in _sources(family, config, name, weights)}
    freqs = inverse_frequencies(config, dtype=torch.float64)
    unused = []
    for name in sorted(set(weights) - taken):
        tensor = weights[name]
        if _is_mtp(config, saved, name):  # left out, as transformers' model leaves them
            continue
        copy = _mtp_copy(family, config, name)
        if copy is not None:  # DeepSeek's copy of the embedding or the head in a module
            main = weights.get(copy)
            if main is not None and torch.equal(tensor, main):
                continue
            raise TrainError(
                f"model.init_from: {directory} has a {name} that differs from {copy}; hp's "
                "multi-token prediction modules share the model's embedding and head"
            )
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
            f"model.init_from: {directory} has tensors hp's {family.label} has no place for: "
            f"{', '.join(unused[:3])}{more}"
        )


def _is_mtp(config: ModelConfig, saved: int, name: str) -> bool:
    """A tensor of one of the `saved` multi-token prediction layers a DeepSeek-V3 checkpoint
    holds after the model's (`num_nextn_predict_layers`) that hp's model has no module for
    (all of them without `model.mtp`)."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    layer = int(match.group(1)) if match is not None else -1
    return config.total_layers <= layer < config.n_layers + saved


def _mtp_copy(family: Family, config: ModelConfig, name: str) -> str | None:
    """The model's own tensor (HF name) that `name` copies, if it is a prediction module's
    copy of the embedding or the head."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None or not config.n_layers <= int(match.group(1)) < config.total_layers:
        return None
    own = MTP_COPIES.get(match.group(2))
    return None if own is None else _sources(family, config, own, {})[0]


def _full(
    family: Family,
    config: ModelConfig,
    name: str,
    shape: tuple[int, ...],
    weights: dict[str, torch.Tensor],
    directory: str,
    build: bool = True,
) -> torch.Tensor | None:
    """hp's full tensor `name` (of `shape`) from the HF `weights`, in float32: the experts
    stacked from one tensor each, or cut from transformers 5's fused ones. Without `build`,
    only checked (every source there, of its shape), so that a refusal changes nothing."""
    sources = _sources(family, config, name, weights)
    if not sources:  # hp's balancing bias, which the family does not have: it starts even
        return torch.zeros(shape) if build else None
    for source in sources:
        if source not in weights:
            raise TrainError(f"model.init_from: {directory} has no tensor {source}")
    stacked = STACKED.fullmatch(name) is not None
    fused = stacked and is_fused(weights, name)
    split = fused and not name.endswith("w2")  # gate_up_proj: (experts, 2 hidden, dim)
    if stacked and not fused:  # one tensor per expert
        for source in sources:
            if tuple(weights[source].shape) != shape[1:]:
                raise TrainError(
                    f"model.init_from: {source} has shape {list(weights[source].shape)}, the "
                    f"model's {name} one expert's {list(shape[1:])}"
                )
    else:
        want = (shape[0], 2 * shape[1], *shape[2:]) if split else shape
        if tuple(weights[sources[0]].shape) != want:
            raise TrainError(
                f"model.init_from: {sources[0]} has shape {list(weights[sources[0]].shape)}, "
                f"the model's {name} {list(want)}"
            )
    balance = config.moe.load_balance if config.moe is not None else None
    if name.endswith("expert_bias") and balance != "bias" and weights[sources[0]].any():
        raise TrainError(
            f"model.init_from: {directory} has a {sources[0]} that is not zero, and the "
            f'config\'s model.moe.load_balance = "{balance}" chooses experts without it; set '
            'model.moe.load_balance = "bias"'
        )
    if not build:
        return None
    if stacked and not fused:
        return torch.stack([weights[source] for source in sources]).to(torch.float32)
    full = weights[sources[0]]
    if split:  # the gate's rows (w1), then the up projection's (w3)
        full = full.chunk(2, dim=1)[0 if name.endswith("w1") else 1]
    rows = rope_rows(config, name, to_hf=False)
    return (full if rows is None else full[rows]).to(torch.float32)


@torch.no_grad()
def init_from_hf(modules: list[nn.Module], config: ModelConfig, directory: str) -> None:
    """Copy an HF model's weights into this rank's model parts (any layout): each parameter's
    full tensor is read and the local shard kept, as `init_weights` does; the MoE balancing
    bias too (DeepSeek-V3's `e_score_correction_bias`; zero where the family has none).
    Everything is checked before anything is copied."""
    family = check_hf_config(config, directory)
    if family is not family_of(config):  # the fields agree: so do the families
        raise TrainError(f"model.init_from: {directory} is a {family.label}, not this model")
    weights = read_hf(directory)
    _check_extra(weights, config, directory)
    targets = [target for module in modules for target in _state(module)]
    for name, tensor in targets:
        _full(family, config, name, tuple(tensor.shape), weights, directory, build=False)
    for name, tensor in targets:
        full = _full(family, config, name, tuple(tensor.shape), weights, directory)
        assert full is not None
        copy_full_(tensor, full)


def _stored_model(checkpoint: str, meta: dict[str, Any]) -> ModelConfig:
    """The model config a checkpoint's meta.json stores (only [model]: the run's other keys
    may be of an older hp-train)."""
    from hp_runtime.train.compat import saved_model
    from hp_runtime.train.config import build_model
    from hp_runtime.train.errors import ConfigError

    try:
        return build_model(saved_model(meta))[1]
    except ConfigError as exc:
        raise TrainError(f"{checkpoint}: its stored [model] config: {exc}") from None


def read_model(checkpoint: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and full fp32 tensors (by canonical name) of a hp-train checkpoint of
    any layout, read in one process, its checksums and tensor names checked first; the
    optimizer's tensors are not read at all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hp_runtime.model import Transformer
    from hp_runtime.train.checkpoint_format import read_meta
    from hp_runtime.train.checkpoint_load import checked_metadata
    from hp_runtime.train.checkpoint_remote import fetcher, opened
    from hp_runtime.train.compat import check_tensors
    from hp_runtime.train.storage import CheckedReader, SafeLoadPlanner

    local, listing = opened(checkpoint)  # a remote one's mirror in the shared cache
    meta = read_meta(local)
    metadata = checked_metadata(local, meta, listing)  # checksums, nothing unpickled
    config = _stored_model(checkpoint, meta)
    check_tensors(checkpoint, metadata, config)  # every tensor of the model, by name and shape
    with torch.device("meta"):
        model = Transformer(config)
    wanted = {name: torch.empty(t.shape, dtype=torch.float32) for name, t in _state(model)}
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": just so
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                {"model": wanted},
                storage_reader=CheckedReader(local, listing and fetcher(listing, local)),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    except (Exception, CheckpointException) as exc:  # DCP's own are long: keep a line
        raise TrainError(f"{checkpoint}: cannot be read: {first_line(exc, named=True)}") from None
    return config, wanted


def without_mtp(
    config: ModelConfig, tensors: dict[str, torch.Tensor]
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model without its multi-token prediction modules (`--mtp drop`): what evaluation
    and inference run."""
    kept = {
        name: tensor
        for name, tensor in tensors.items()
        if not (name.startswith("layers.") and int(name.split(".")[1]) >= config.n_layers)
    }
    return dataclasses.replace(config, mtp=None), kept


def export_checkpoint(
    checkpoint: str,
    out: str,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    mtp: str = "keep",
) -> list[str]:
    """A hp-train checkpoint (any layout it was saved from) as an HF directory of its model's
    family; its multi-token prediction modules written (`mtp` "keep", DeepSeek-V3's layers
    after the model's) or left out ("drop")."""
    from hp_runtime.train.checkpoint_format import read_meta
    from hp_runtime.train.checkpoint_remote import opened

    # A bad --out, or one another export is writing, is refused before the checkpoint is read.
    with ExportTarget(out) as target:
        # The family first: a model that no family is exactly is refused before a tensor is read.
        config = _stored_model(checkpoint, read_meta(opened(checkpoint)[0]))
        if mtp == "drop":
            config = dataclasses.replace(config, mtp=None)
        try:
            export_family(config)
        except TrainError as exc:
            raise TrainError(f"{checkpoint}: cannot be exported: {exc}") from None
        config, weights = read_model(checkpoint)
        if mtp == "drop":
            config, weights = without_mtp(config, weights)
        return _write_hf(weights, config, target, dtype, max_shard_bytes)
