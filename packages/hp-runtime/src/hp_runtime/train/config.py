"""The trainer's configuration: one TOML file plus dotted overrides, mapped onto typed, frozen
dataclasses and checked before any rank does work.

Sections: `model` (a preset plus any `ModelConfig` field), `data`, `parallel`, `train`, `optim`,
`checkpoint`, `metrics`. An unknown section or key, a value of the wrong type or a missing
required key is a `ConfigError` whose one-line message names the key and, for a misspelling,
the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import math
import os
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from hp_data.errors import HpDataError
from hp_data.gpt import MAX_SEQ_LENGTH
from hp_data.phases import Phase, PhaseError
from hp_data.redact import redact
from hp_data.registry import DATASET_REGISTRY, DatasetConfig, dataset_type

from hp_runtime.model.config import CHUNK_TOKENS, PRESETS, FieldError, ModelConfig
from hp_runtime.parallel.mesh import ParallelDims
from hp_runtime.parallel.options import ParallelOptions
from hp_runtime.train.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class DataConfig(DatasetConfig):
    """The `[data]` section is hp-data's own dataset config (its fields are the keys, under
    their own names) plus what the trainer adds around it. The library fields in `fixed` are
    not keys: hp-train keeps Megatron's defaults, and draws `dummy` ids below
    `model.vocab_size`."""

    key_prefix: ClassVar[str] = "data."
    fixed: ClassVar[tuple[str, ...]] = (
        "add_extra_token",
        "drop_last_partial_validation_sequence",
        "pad_token",
        "return_cu_seqlens",
        "vocab_size",
        "input_format",
        "workers",
    )
    # The keys in the order docs/training.md lists them and config.toml writes them (the
    # library's fields come first in the dataclass; the corpus reads better first).
    order: ClassVar[tuple[str, ...]] = (
        "type",
        "path",
        "tokenizer",
        "seq_length",
        "split",
        "valid_path",
        "phases",
        "seed",
        "cache_dir",
        "remote_chunk_mb",
        "remote_cache_gb",
        "remote_timeout_s",
        "eod_mask_loss",
        "reset_position_ids",
        "document_masking",
        "eod_token",
        "text_key",
        "num_workers",
        "prefetch_factor",
    )

    type: Literal[tuple(DATASET_REGISTRY)]  # hp-data's dataset types
    valid_path: str | None = None  # a separate validation corpus, used whole
    phases: tuple[Phase, ...] = ()  # [[data.phases]]: the mixture by step, instead of path
    document_masking: bool = False  # attention stays inside documents (from position ids)
    num_workers: int | None = None  # DataLoader workers; default 1 on a multi-core machine
    prefetch_factor: int = 4  # micro-batches each worker keeps ready


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(ParallelOptions, ParallelDims):
    """The `[parallel]` section is the library's own layout and options, one object that
    `assemble` takes as both: its keys are their fields (the layout's first)."""


@dataclass(frozen=True)
class BatchRamp:
    """`train.batch_ramp`, Megatron's `--rampup-batch-size START INCR SAMPLES`: the global
    batch starts at `start` and grows by `increment` every `samples / n` samples consumed
    (`n` increments up to train.global_batch_size), full once `samples` are consumed. Also
    written as the list `[start, increment, samples]`, as Megatron's flag takes it."""

    as_list: ClassVar[bool] = True  # the key also takes its fields as a list, in order
    start: int
    increment: int
    samples: int

    def __post_init__(self) -> None:
        if self.samples == 0:  # Megatron's calculator divides by it
            raise FieldError(
                "samples", 0, "ramps over no samples; leave train.batch_ramp unset for no ramp"
            )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    run_dir: str = "out/run"
    steps: int
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # default: micro_batch_size x data-parallel size
    batch_ramp: BatchRamp | None = None  # none: the full global batch from the first step
    seed: int = 0  # model initialisation
    max_norm: float = 1.0  # gradient clipping; 0 turns it off
    eval_interval: int = 0  # 0: no validation
    eval_iters: int = 10
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: Literal["auto", "cuda", "cpu"] = "auto"
    cpu_threads: int = 0  # torch threads per rank on CPU; 0: cores / ranks on the machine
    cpu_keep_freed_memory: bool = True  # on CPU, malloc keeps freed memory (launch.py)
    spike_action: Literal["off", "skip", "stop"] = "off"
    spike_window: int = 100
    spike_sigma: float = 6.0
    time_limit: float = 0.0  # wall-clock seconds; 0: none
    hang_timeout_s: float = 0.0  # a step this slow stops the job (train/watchdog.py); 0: auto
    collective_timeout_s: float = 600.0  # a collective waiting this long fails the job
    loss_chunk_tokens: int = CHUNK_TOKENS  # the head's logits this many at a time; 0: all


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_style: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    decay_steps: int | None = None  # default: steps - warmup_steps
    wsd_decay_fraction: float = 0.1  # wsd: share of the decay span spent decaying
    wsd_decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.0  # sgd


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    interval: int = 0  # steps between saves (and one at the end); 0: none
    resume: str = "auto"  # "auto": the newest in RUN_DIR; "none": fresh; or a checkpoint path
    keep: int = 0  # the newest K committed checkpoints stay; 0: all
    async_save: bool = field(default=False, metadata={"key": "async"})
    allow_data_change: bool = False


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """`metrics.wandb = {project, name, mode}`: the train and validation records also to
    Weights & Biases (`hp-runtime[wandb]`)."""

    project: str
    name: str | None = None  # default: the run directory's name
    mode: Literal["online", "offline", "disabled"] = "online"  # offline: `wandb sync` later


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    log_interval: int = 10
    tensorboard: bool = True  # when the tensorboard package is installed
    plot: bool = True  # RUN_DIR/metrics.png at the end, when matplotlib is installed
    peak_tflops: float | None = None  # per device, dense bf16; default from the GPU table
    profile_steps: tuple[int, int] | None = None  # [first step, steps]: torch.profiler traces
    profile_every: int = 0  # the window again every this many steps; 0: once
    memory_snapshot: bool = False  # CUDA: allocation history, dumped with each trace and at OOM
    wandb: WandbConfig | None = None


@dataclass(frozen=True)
class Config:
    model_preset: str
    model: ModelConfig
    model_init_from: str | None
    data: DataConfig
    parallel: ParallelConfig
    train: TrainConfig
    optim: OptimConfig
    checkpoint: CheckpointConfig
    metrics: MetricsConfig


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
}


def key_of(f: dataclasses.Field) -> str:
    """A field's name in TOML (`checkpoint.async` is `async_save` in Python)."""
    return f.metadata.get("key", f.name)


def key_fields(section: Any) -> list[dataclasses.Field]:
    """The fields of a section (class or instance) that are keys: all but those a library
    type carries and the section keeps `fixed`; in the section's `order` where it has one
    (the first missing key named, the keys written), any key it does not list last."""
    fixed, order = getattr(section, "fixed", ()), getattr(section, "order", ())
    keys = [f for f in fields(section) if f.name not in fixed]
    return sorted(keys, key=lambda f: order.index(f.name) if f.name in order else len(order))


def _key_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {key_of(f): hints[f.name] for f in key_fields(cls)}


def _all_key_types() -> dict[str, dict[str, Any]]:
    keys = {name: _key_types(cls) for name, cls in SECTIONS.items()}
    keys["model"] = {
        "preset": Literal[tuple(PRESETS)],
        "init_from": str | None,
        **_key_types(ModelConfig),
    }
    return keys


KEYS = _all_key_types()

INT_MAX = 2**31 - 1  # counts and sizes: a C int (torch threads, kernels' indices); more is a typo
SEED_MAX = 2**32 - 1  # as hp-data's (and numpy's) seeds
MAX_PARAMS = 2**40  # ~1.1e12 parameters: past any dense model, far before an int64 overflows


@dataclass(frozen=True)
class Range:
    """The values a numeric key allows: from `low` to `high`, each bound included unless
    marked open."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        low, high = _bound(self.low), _bound(self.high)
        if self.high == math.inf:
            return f"more than {low}" if self.low_open else f"at least {low}"
        if isinstance(self.low, int) and isinstance(self.high, int):
            return f"from {low} to {high}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{low}, {high}{right}"


def _bound(value: float) -> str:
    names = {
        INT_MAX: "2**31 - 1",
        MAX_SEQ_LENGTH: "2**31 - 2",
        SEED_MAX: "2**32 - 1",
        2**24: "2**24",
        2**62: "2**62",
    }
    return names.get(value, repr(value)) if isinstance(value, int) else f"{value:g}"


def _ints(low: int, high: int = INT_MAX) -> Range:
    return Range(low, high)


POSITIVE, NON_NEGATIVE = Range(0.0, low_open=True), Range(0.0)
BELOW_ONE = Range(0.0, 1.0, high_open=True)  # betas, momentum
UP_TO_ONE = Range(0.0, 1.0, low_open=True)

# Every numeric key's range, one row a key (none, where a key allows it, is always allowed).
RANGES: dict[str, Range] = {
    "model.vocab_size": _ints(1),
    "model.dim": _ints(1),
    "model.n_layers": _ints(1, 4096),  # the model is built layer by layer: bounded time
    "model.n_heads": _ints(1),
    "model.n_kv_heads": _ints(1),
    "model.head_dim": _ints(1),  # none: dim / n_heads
    "model.ffn_hidden": _ints(1),
    "model.max_seq_len": _ints(1, 2**24),  # rotary positions are exact in float32 below 2**24
    "model.rope_theta": POSITIVE,
    "model.norm_eps": UP_TO_ONE,
    "model.init_std": UP_TO_ONE,
    # model.moe's fields (a table: `MoEConfig` then checks how they relate)
    "model.moe.experts": _ints(1),
    "model.moe.top_k": _ints(1),
    "model.moe.expert_ffn_hidden": _ints(1),
    "model.moe.shared_experts": _ints(0),
    "model.moe.route_scale": POSITIVE,
    "model.moe.first_dense_layers": _ints(0),
    "model.moe.aux_loss_coef": NON_NEGATIVE,
    "model.moe.bias_update_rate": NON_NEGATIVE,
    # hp-data's GPTDataset: a sample predicts at least one token; its L + 1 tokens count in int32
    "data.seq_length": _ints(2, MAX_SEQ_LENGTH),
    "data.seed": _ints(0, SEED_MAX),
    "data.eod_token": _ints(0),
    "data.num_workers": _ints(0, 1024),  # processes per rank
    "data.prefetch_factor": _ints(1, 1024),
    "data.remote_chunk_mb": Range(1 / 256, 4096.0),  # a 4 KiB page (tests) to 4 GiB
    "data.remote_cache_gb": POSITIVE,
    "data.remote_timeout_s": POSITIVE,
    "parallel.dp_replicate": _ints(1),
    "parallel.dp_shard": _ints(1),
    "parallel.cp": _ints(1),
    "parallel.tp": _ints(1),
    "parallel.pp": _ints(1),
    "parallel.ep": _ints(1),
    "parallel.pp_microbatches": _ints(1),
    "parallel.pp_virtual_stages": _ints(1),
    "parallel.ac_every": _ints(1),
    "train.steps": _ints(1),
    "train.micro_batch_size": _ints(1),
    "train.global_batch_size": _ints(1),
    "train.batch_ramp.start": _ints(1),
    "train.batch_ramp.increment": _ints(1),
    "train.batch_ramp.samples": _ints(0, 2**62),  # 0: refused by BatchRamp, with its reason
    "train.seed": _ints(0, SEED_MAX),
    "train.max_norm": NON_NEGATIVE,
    "train.eval_interval": _ints(0),
    "train.eval_iters": _ints(1),
    "train.cpu_threads": _ints(0, 1024),  # threads per rank
    "train.spike_window": _ints(1),
    "train.spike_sigma": POSITIVE,
    "train.time_limit": NON_NEGATIVE,
    "train.hang_timeout_s": NON_NEGATIVE,
    "train.collective_timeout_s": POSITIVE,
    "train.loss_chunk_tokens": _ints(0),
    "optim.lr": POSITIVE,
    "optim.min_lr": NON_NEGATIVE,
    "optim.warmup_steps": _ints(0),
    "optim.decay_steps": _ints(1),
    "optim.wsd_decay_fraction": UP_TO_ONE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.beta1": BELOW_ONE,
    "optim.beta2": BELOW_ONE,
    "optim.eps": POSITIVE,
    "optim.momentum": BELOW_ONE,
    "checkpoint.interval": _ints(0),
    "checkpoint.keep": _ints(0),
    "metrics.log_interval": _ints(1),
    "metrics.peak_tflops": POSITIVE,
    "metrics.profile_every": _ints(0),
}


def _similarity(wrong: str, right: str) -> float:
    """Closeness of two key names: whole-string likeness or the words they share
    (`lr_warmup` is nearer `warmup_steps` than `lr` is)."""
    ratio = difflib.SequenceMatcher(None, wrong, right).ratio()
    shared = set(wrong.split("_")) & set(right.split("_"))
    words = 2 * sum(len(word) for word in shared) / (len(wrong) + len(right))
    return max(ratio, words)


def suggest(section: str, key: str | None) -> str | None:
    """The closest valid dotted key (or section, when `key` is None), if any is close; a key
    of the same section wins a near tie."""
    if key is None:
        scored = [(_similarity(section, name), name) for name in KEYS]
    else:
        scored = [
            (_similarity(key, name) + (0.05 if other == section else 0.0), f"{other}.{name}")
            for other, names in KEYS.items()
            for name in names
        ]
    score, best = max(scored)
    return best if score >= 0.5 else None


def _unknown(section: str, key: str | None) -> ConfigError:
    where = _name(section if key is None else f"{section}.{key}")
    kind = "section" if key is None else "key"
    hint = suggest(section, key)
    return ConfigError(f"{where}: unknown {kind}" + (f"; did you mean {hint}?" if hint else ""))


def _table_class(kind: Any) -> type | None:
    """The dataclass a table key (`model.rope_scaling`) takes, if `kind` is one, alone or
    with none."""
    options = (
        typing.get_args(kind)
        if typing.get_origin(kind) in (typing.Union, types.UnionType)
        else (kind,)
    )
    return next((o for o in options if dataclasses.is_dataclass(o)), None)


def _type_name(kind: Any) -> str:
    if dataclasses.is_dataclass(kind):
        names = ", ".join(_key_types(kind))
        listed = f" or a list [{names}]" if getattr(kind, "as_list", False) else ""
        return "a table {" + names + "}" + listed
    origin = typing.get_origin(kind)
    if origin is tuple and dataclasses.is_dataclass(typing.get_args(kind)[0]):
        return "an array of tables {" + ", ".join(_key_types(typing.get_args(kind)[0])) + "}"
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(kind))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(kind))
    if origin is tuple:
        parts = typing.get_args(kind)
        return f"a list of {len(parts)} (" + ", ".join(map(_type_name, parts)) + ")"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(kind, "nothing") if kind is not type(None) else "none"


def _coerce(value: Any, kind: Any) -> Any:
    """`value` (from TOML) as `kind`, or raise TypeError."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(kind):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, option)
            except TypeError:
                pass
        raise TypeError
    if origin is Literal:
        if value in typing.get_args(kind):
            return value
        raise TypeError
    if origin is tuple:  # a fixed-length list: `metrics.profile_steps = [10, 3]`
        parts = typing.get_args(kind)
        if isinstance(value, list | tuple) and len(value) == len(parts):
            return tuple(_coerce(v, part) for v, part in zip(value, parts, strict=True))
        raise TypeError
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise TypeError
    if kind is str:
        if isinstance(value, str):
            return value
        raise TypeError
    raise TypeError


def _takes_str(kind: Any) -> bool:
    if kind is str:
        return True
    args = typing.get_args(kind)
    return any(isinstance(a, str) for a in args) or any(_takes_str(a) for a in args)


def _parse_override(text: str, kind: Any) -> Any:
    """A command-line value as TOML reads it (`50`, `3e-4`, `true`), except that a key taking
    text keeps the text as given (`data.split=969,30,1`, `train.run_dir=out/a`)."""
    args = typing.get_args(kind)
    if text.lower() in ("none", "null") and type(None) in args:
        return None
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if _takes_str(kind) and not isinstance(value, str):
        return text
    return value


def _shown(value: Any, limit: int = 80) -> str:
    """A value for a message: its repr (one line, however long or odd the value), shortened."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text if isinstance(value, str) else f"{text} ({type(value).__name__})"


def _reason(exc: Exception, limit: int = 300) -> str:
    """Another library's error as part of one line: its first line, shortened."""
    text = (str(exc).splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name(key: str) -> str:
    """A key as the user wrote it, quoted when it would not read as one line of plain text."""
    return key if key.isprintable() and 0 < len(key) <= 80 else _shown(key)


@dataclass(frozen=True)
class Fields:
    """Fields of a table key set by dotted overrides (`model.moe.top_k=1`) where the config
    gives the key no value: they update the preset's table, which is known only once every
    key is read (`model.preset` may come later, or from the file)."""

    values: dict[str, Any]


def _fields_of(cls: type, value: Any) -> dict[str, Any] | None:
    """A table key's value as its fields by name: a table, the list a key that takes one
    (`train.batch_ramp = [start, increment, samples]`) gives, or a preset's dataclass; None
    for any other value."""
    if isinstance(value, cls):
        return as_table(value)
    if getattr(cls, "as_list", False) and isinstance(value, list | tuple):
        names = list(_key_types(cls))
        return dict(zip(names, value, strict=True)) if len(value) == len(names) else None
    return dict(value) if isinstance(value, dict) else None


def _updated(current: Any, cls: type, fields: dict[str, Any]) -> Any:
    """A table key's value with `fields` set, as TOML's dotted keys set them: into the table
    it holds; into the preset's (`Fields`) where the config gives none; into a new table over
    any other value (none): then checked whole, so a required field may be missing."""
    if isinstance(current, Fields):
        return Fields({**current.values, **fields})
    return {**(_fields_of(cls, current) or {}), **fields}


def _field_override(section: str, name: str, text: str) -> tuple[str, type, Any] | None:
    """(table key, its class, the field's value) when `name` is `TABLE.FIELD` of a table key
    of `section` (`moe.top_k`); None for any other key."""
    table, _, field = name.partition(".")
    cls = _table_class(KEYS[section].get(table)) if field else None
    if cls is None:
        return None
    kinds = _key_types(cls)
    if field not in kinds:
        raise _unknown_field(f"{section}.{table}", field, kinds)
    return table, cls, {field: _parse_override(text, kinds[field])}


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """`["train.steps=50", "optim.lr=3e-4"]` → {"train": {"steps": 50}, "optim": {...}}, in
    order: `model.moe.top_k=1` updates the `model.moe` an earlier override set."""
    tree: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(
                f"{_name(item)}: an override is SECTION.KEY=VALUE, e.g. train.steps=50"
            )
        if section not in KEYS:
            raise _unknown(section, None)
        values = tree.setdefault(section, {})
        dotted = _field_override(section, name, text.strip())
        if dotted is not None:
            table, cls, field = dotted
            values[table] = _updated(values.get(table, Fields({})), cls, field)
        elif name in KEYS[section]:
            values[name] = _parse_override(text.strip(), KEYS[section][name])
        else:
            raise _unknown(section, name)
    return tree


def _merge(base: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`overrides` on top of the file's tree, a table's fields into the file's table; a section
    that is not a table stays as it is, for `build_config` to name."""
    merged = {
        section: dict(values) if isinstance(values, dict) else values
        for section, values in base.items()
    }
    for section, values in overrides.items():
        target = merged.setdefault(section, {})
        if not isinstance(target, dict):
            continue
        for key, value in values.items():
            if isinstance(value, Fields):
                cls = _table_class(KEYS[section][key])
                value = _updated(target.get(key, value), cls, value.values)
            target[key] = value
    return merged


def _value(key: str, kind: Any, value: Any) -> Any:
    """One key's value (from TOML) as `kind`, in its range and form."""
    table = _table_class(kind)
    fields_given = None if table is None else _fields_of(table, value)
    if fields_given is not None:
        return _table(key, table, fields_given)
    if typing.get_origin(kind) is tuple and dataclasses.is_dataclass(typing.get_args(kind)[0]):
        # an array of tables ([[data.phases]])
        if not isinstance(value, list | tuple) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{key}: expected {_type_name(kind)}, got {_shown(value)}")
        item = typing.get_args(kind)[0]
        return tuple(_table(f"{key}[{i}]", item, v) for i, v in enumerate(value))
    if table is not None and value == "none":  # TOML has no null: a preset's table unset
        value = None
    try:
        typed = _coerce(value, kind)
    except TypeError:
        raise ConfigError(f"{key}: expected {_type_name(kind)}, got {_shown(value)}") from None
    allowed = RANGES.get(key)
    if allowed is not None and typed is not None and typed not in allowed:
        raise ConfigError(f"{key}: must be {allowed}, got {typed}")
    form = FORMS.get(key)
    if form is not None and typed is not None:
        form(typed)
    return typed


def _unknown_field(key: str, name: str, kinds: dict[str, Any]) -> ConfigError:
    """`name` is no field of the table key `key`: the closest, if any is close, and all."""
    close = difflib.get_close_matches(name, kinds, n=1)
    hint = f"did you mean {key}.{close[0]}? " if close else ""
    return ConfigError(
        f"{_name(f'{key}.{name}')}: unknown field; {hint}its fields: {', '.join(kinds)}"
    )


def _table(key: str, cls: type, values: dict[str, Any]) -> Any:
    """A table key (`model.rope_scaling = {type = "llama3", ...}`) as the frozen dataclass
    `cls`: only its fields, every one without a default given, each typed as `_value` types
    a key; then the class's own check, whose `FieldError` names the field."""
    kinds = _key_types(cls)
    for name in values:
        if name not in kinds:
            raise _unknown_field(key, name, kinds)
    required = [key_of(f) for f in key_fields(cls) if f.default is dataclasses.MISSING]
    for name in required:
        if name not in values:
            needs = f"gives all of {', '.join(kinds)}"
            if len(required) < len(kinds):
                needs = f"needs {', '.join(required)} (the other fields have defaults)"
            raise ConfigError(f"{key}.{name}: required; {key} {needs}")
    typed = {name: _value(f"{key}.{name}", kinds[name], value) for name, value in values.items()}
    try:
        return cls(**{f.name: typed[key_of(f)] for f in key_fields(cls) if key_of(f) in typed})
    except (FieldError, PhaseError) as exc:
        raise ConfigError(f"{key}.{exc.field}: {exc.problem}, got {exc.value!r}") from None


def _typed(section: str, values: dict[str, Any], preset: Any = None) -> dict[str, Any]:
    """Each key of `section` typed; a table's `Fields` over the `preset`'s table, if any."""
    out = {}
    for key, value in values.items():
        if key not in KEYS[section]:
            raise _unknown(section, key)
        if isinstance(value, Fields):
            cls = _table_class(KEYS[section][key])
            value = _updated(getattr(preset, key, None), cls, value.values)
        out[key] = _value(f"{section}.{key}", KEYS[section][key], value)
    return out


def _build(section: str, cls: type, values: dict[str, Any]) -> Any:
    typed = _typed(section, values)
    missing = [
        key_of(f)
        for f in key_fields(cls)
        if key_of(f) not in typed
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(
            f"{section}.{missing[0]}: required; set it in the config file or as "
            f"{section}.{missing[0]}=VALUE"
        )
    try:
        return cls(**{f.name: typed[key_of(f)] for f in key_fields(cls) if key_of(f) in typed})
    except HpDataError as exc:  # a library type's own check (e.g. a length past its bound)
        raise ConfigError(f"{section}: {_reason(exc)}") from None


def build_model(values: dict[str, Any]) -> tuple[str, ModelConfig, str | None]:
    """(preset name, `ModelConfig`, init_from) from a `[model]` table, checked alone: what
    export needs of a stored config, whose other sections may be of an older hp-train."""
    preset_name = _typed("model", {"preset": values.get("preset", "tiny")})["preset"]
    typed = _typed("model", values, PRESETS[preset_name])
    typed.pop("preset", None)
    init_from = typed.pop("init_from", None)
    try:
        model = dataclasses.replace(PRESETS[preset_name], **typed)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    return preset_name, model, init_from


def build_config(tree: dict[str, Any]) -> Config:
    """A checked `Config` from a parsed TOML tree (overrides already merged)."""
    for section, values in tree.items():
        if section not in KEYS and not isinstance(values, dict):
            hint = suggest("", section)
            raise ConfigError(
                f"{_name(section)}: a key outside any [section]; keys go under their section"
                + (f" (did you mean {hint}?)" if hint else "")
            )
        if section not in KEYS:
            raise _unknown(section, None)
        if isinstance(values, list) and values and all(isinstance(v, dict) for v in values):
            raise ConfigError(f"{section}: [[{section}]] makes a list of tables; write [{section}]")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a [{section}] table, got {_shown(values)}")
    preset_name, model, init_from = build_model(tree.get("model", {}))
    sections = {name: _build(name, cls, tree.get(name, {})) for name, cls in SECTIONS.items()}
    config = Config(model_preset=preset_name, model=model, model_init_from=init_from, **sections)
    check(config)
    return config


def load_config(path: str | None, overrides: list[str] = ()) -> Config:  # type: ignore[assignment]
    """Read `path` (TOML), apply `overrides` (SECTION.KEY=VALUE), check everything."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as stream:
                tree = tomllib.load(stream)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return build_config(_merge(tree, parse_overrides(list(overrides))))


def _kind(path: str) -> str | None:
    """ "dir", "file" (anything else that exists) or None when `path` names nothing."""
    try:
        return "dir" if os.path.isdir(path) else "file" if os.path.lexists(path) else None
    except (ValueError, OSError):  # an embedded NUL, a name too long
        return None


def _plain(key: str, path: str) -> None:
    """`path` can name a file at all: no NUL, encodable for the file system."""
    try:
        if "\0" not in path:
            os.fsencode(path)
            return
    except UnicodeError:
        pass
    raise ConfigError(f"{key}: {_shown(path)} cannot be a path on this system")


def _need(key: str, path: str, kind: str | None = None) -> None:
    """`path` (the value of `key`) exists, as a directory or a file when `kind` says so."""
    _plain(key, path)
    found = _kind(path)
    if found is None:
        raise ConfigError(f"{key}: {_shown(path)}: no such file or directory")
    if kind is not None and found != kind:
        wanted = "a directory" if kind == "dir" else "a file"
        raise ConfigError(f"{key}: {_shown(path)} is not {wanted}")


def _writable_dir(key: str, path: str) -> None:
    """`path` is a directory this process can write in, or one it can create there."""
    if not path:
        raise ConfigError(f"{key}: empty; give a directory")
    _plain(key, path)
    target = here = os.path.abspath(path)
    while _kind(here) is None and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    shown = "it" if here == target else _shown(here)
    if _kind(here) != "dir":
        raise ConfigError(f"{key}: {_shown(path)}: {shown} is not a directory")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {_shown(path)}: {shown} is not writable")
    longest = max(len(os.fsencode(part)) for part in os.path.relpath(target, here).split(os.sep))
    if longest > 255 or len(os.fsencode(target)) > 4000:  # NAME_MAX, PATH_MAX on Linux
        raise ConfigError(f"{key}: {_shown(path)}: the name is too long")


def _need_corpus(key: str, config: Config, spec: str) -> None:
    """A megatron prefix or blend, or a json_file / hf_datasets input, that exists."""
    from hp_data.format.commit import journal_path
    from hp_data.format.header import prefix_of
    from hp_data.remote import is_url

    kind = config.data.type
    _plain(key, spec)
    if kind == "json_file":
        if not is_url(spec) and not (glob.has_magic(spec) and glob.glob(spec)):
            _need(key, spec)
        return
    if kind == "hf_datasets":
        if not is_url(spec):
            _need(key, spec, "dir")
        return
    from hp_data.blend import parse_blend

    try:
        prefixes, _ = parse_blend(spec)
    except HpDataError as exc:
        raise ConfigError(f"{key}: {_reason(exc)}") from None
    for prefix in map(prefix_of, prefixes):
        if is_url(prefix):
            continue  # asked of the store when the data is read (train/data.py `_prefixes`)
        if _kind(journal_path(prefix)) is not None:
            continue  # an interrupted write, which opening the dataset finishes
        for suffix in (".idx", ".bin"):
            if _kind(prefix + suffix) != "file":
                raise ConfigError(
                    f"{key}: {_shown(prefix + suffix)}: no such file (a prefix names "
                    "PREFIX.bin and PREFIX.idx)"
                )


def check_paths(config: Config) -> None:
    """What the run reads exists and what it writes can be written: the file system's part of
    the config check, apart from `build_config` (a stored config names paths of its day)."""
    _writable_dir("train.run_dir", config.train.run_dir)
    data = config.data
    if data.cache_dir is not None:
        _writable_dir("data.cache_dir", data.cache_dir)
    if dataset_type(data.type).needs_path:
        for key in ("data.path", "data.valid_path"):
            spec = getattr(data, key.split(".")[1])
            if spec is not None:
                _need_corpus(key, config, spec)
        for i, phase in enumerate(data.phases):
            _need_corpus(f"data.phases[{i}].path", config, phase.path)
    if dataset_type(data.type).needs_tokenizer and data.tokenizer is not None:
        from hp_data.tokenize import TokenizerFiles

        try:
            TokenizerFiles.locate(data.tokenizer)
        except HpDataError as exc:
            raise ConfigError(f"data.tokenizer: {_reason(exc)}") from None
    if config.model_init_from is not None:
        _need("model.init_from", config.model_init_from, "dir")
    if config.checkpoint.resume not in ("auto", "none"):
        # Only its form: a path seeds an empty run directory and is ignored once the run has
        # checkpoints of its own (a deleted scratch seed must not stop a preempted run); the
        # checkpointer refuses a missing one when it would be used.
        _plain("checkpoint.resume", config.checkpoint.resume)


def check(config: Config) -> None:
    """Relations between keys that no single range expresses (each key's own range is checked
    as it is read, from `RANGES`)."""
    data = config.data
    kind = dataset_type(data.type)
    if kind.needs_path and not data.path and not data.phases:
        raise ConfigError(f"data.path: required for data.type = {data.type!r}")
    if kind.needs_tokenizer and not data.tokenizer:
        raise ConfigError(f"data.tokenizer: required for data.type = {data.type!r}")
    check_length("data.seq_length", data.seq_length, config)
    vocab = config.model.vocab_size
    if data.eod_token is not None and not 0 <= data.eod_token < vocab:
        raise ConfigError(
            f"data.eod_token = {data.eod_token} is not a token id of model.vocab_size = {vocab}: "
            f"give an id from 0 to {vocab - 1}"
        )
    optim = config.optim
    if optim.min_lr > optim.lr:
        raise ConfigError(f"optim.min_lr={optim.min_lr} must be between 0 and optim.lr={optim.lr}")
    model = config.model
    if model.num_params() > MAX_PARAMS:
        moe = model.moe
        experts = (
            ""
            if moe is None
            else f", moe.experts={moe.experts}, moe.expert_ffn_hidden={moe.expert_ffn_hidden}, "
            f"moe.shared_experts={moe.shared_experts}"
        )
        raise ConfigError(
            f"model: {model.num_params():.3g} parameters (model.dim={model.dim}, n_layers="
            f"{model.n_layers}, ffn_hidden={model.ffn_hidden}, vocab_size={model.vocab_size}"
            f"{experts}) is more than hp-train's {MAX_PARAMS:.3g}"
        )
    if model.attention == "segments" and data.document_masking and config.parallel.compile:
        raise ConfigError(
            "model.attention = 'segments' reads document boundaries on the host, which a "
            "compiled block cannot: use model.attention = 'auto', or parallel.compile = false"
        )
    check_profile(config.metrics)
    check_moe(config)
    check_phases(config)


def check_length(key: str, length: int, config: Config) -> None:
    """A sequence length (`data.seq_length`, a phase's) against the model and the layout."""
    if length > config.model.max_seq_len:
        raise ConfigError(
            f"{key}={length} is longer than model.max_seq_len="
            f"{config.model.max_seq_len}; raise model.max_seq_len or shorten the sequences"
        )
    cp = config.parallel.cp
    if cp > 1 and length % (2 * cp):
        raise ConfigError(
            f"{key}={length} does not divide into 2 x parallel.cp = {2 * cp} "
            f"equal chunks (context parallelism gives each rank two); make it a multiple of "
            f"{2 * cp}"
        )
    tp = config.parallel.tp
    if cp == 1 and length % tp:
        raise ConfigError(
            f"{key}={length} is not divisible by parallel.tp="
            f"{tp} (sequence parallel splits the sequence)"
        )
    if cp > 1 and (length // cp) % tp:
        raise ConfigError(
            f"{key}={length} / parallel.cp={cp} = {length // cp} "
            f"rows a context-parallel rank, not divisible by parallel.tp={tp} (sequence "
            f"parallel splits them); make {key} a multiple of {math.lcm(2 * cp, cp * tp)}"
        )


def check_phases(config: Config) -> None:
    """`[[data.phases]]` against the other keys (where each starts needs the batch plan:
    `hp_runtime.train.data.phase_starts`)."""
    data = config.data
    if not data.phases:
        return
    if data.type != "megatron":
        raise ConfigError(
            f"data.phases: only with data.type = 'megatron' (each phase names a prefix or a "
            f"blend), not {data.type!r}"
        )
    if data.path is not None:
        raise ConfigError(
            "data.path: not with data.phases, which say what trains: move it into a phase, "
            "or unset it with data.path=none on the command line (validation reads "
            "data.valid_path, else the first phase's valid share)"
        )
    for i, phase in enumerate(data.phases):
        if phase.seq_length is not None:
            check_length(f"data.phases[{i}].seq_length", phase.seq_length, config)
    lengths = {phase.seq_length or data.seq_length for phase in data.phases}
    if config.parallel.pp > 1 and len(lengths) > 1:
        raise ConfigError(
            f"data.phases: sequence lengths {sorted(lengths)} with parallel.pp="
            f"{config.parallel.pp}: a pipeline's stages keep the shapes of its first step; "
            "give every phase one seq_length, or parallel.pp = 1"
        )


def check_profile(metrics: MetricsConfig) -> None:
    """A repeated profile window needs a window, and room for it before the next."""
    every, window = metrics.profile_every, metrics.profile_steps
    if every and window is None:
        raise ConfigError(
            f"metrics.profile_every={every} repeats metrics.profile_steps, which is not set: "
            "give metrics.profile_steps = [first step, steps]"
        )
    if every and window is not None and every < window[1]:
        raise ConfigError(
            f"metrics.profile_every={every} is shorter than the window of "
            f"metrics.profile_steps = [{window[0]}, {window[1]}]: windows would overlap"
        )


def check_moe(config: Config) -> None:
    """A MoE model's keys against the model and the layout (what the world size does not
    decide; `ParallelDims.validate` checks the rest at the start)."""
    moe, p = config.model.moe, config.parallel
    if moe is None:
        if p.ep > 1:
            raise ConfigError(
                f"parallel.ep={p.ep} needs a MoE model: set model.moe (expert parallelism "
                "shards the experts), or parallel.ep = 1"
            )
        return
    if moe.experts % p.ep:
        raise ConfigError(
            f"model.moe.experts={moe.experts} is not divisible by parallel.ep={p.ep}: each "
            "expert-parallel rank holds the same number of experts"
        )
    if p.dp_shard % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} does not divide parallel.dp_shard={p.dp_shard}: expert "
            "parallelism splits the sharded data-parallel ranks and adds none; make "
            f"parallel.dp_shard a multiple of {p.ep}"
        )
    if p.cp > 1:
        raise ConfigError(
            f"model.moe with parallel.cp={p.cp} is not supported yet: train a MoE model with "
            "parallel.cp = 1"
        )
    if p.ep > 1 and p.compile:
        # The experts' own FSDP unit (`parallel/fsdp.py`) inside a compiled block: dynamo
        # refuses FSDP's hooks there (torch 2.15), a traceback at the first step.
        raise ConfigError(
            f"parallel.compile = true with parallel.ep={p.ep} is not supported yet: set "
            "parallel.compile = false, or parallel.ep = 1 (a MoE model compiles without ep)"
        )


def _check_split(split: str) -> None:
    from hp_data.index import parse_split

    try:
        parse_split(split)
    except HpDataError:
        raise ConfigError(
            f"data.split: expected up to three non-negative shares, not all zero, such as "
            f'"969,30,1"; got {_shown(split)}'
        ) from None


# Text keys with a form of their own, checked as they are read (as numbers are, by `RANGES`).
def _check_profile(window: tuple[int, int]) -> None:
    first, count = window
    if first < 1 or count < 1:
        raise ConfigError(
            f"metrics.profile_steps: give [first step, steps], both at least 1, got "
            f"[{first}, {count}]"
        )


FORMS: dict[str, Callable[[Any], None]] = {
    "data.split": _check_split,
    "metrics.profile_steps": _check_profile,
}


def as_table(value: Any) -> dict[str, Any]:
    """A table key's value (a dataclass) as config.toml holds it: its fields by key."""
    return {key_of(f): getattr(value, f.name) for f in key_fields(value)}


def toml_value(value: Any) -> str:
    """`value` as config.toml writes it; a table key's as an inline table, none as "none"."""
    if value is None:
        return '"none"'
    if dataclasses.is_dataclass(value):
        value = as_table(value)
    if isinstance(value, dict):  # TOML has no null: a none field of a table is left out
        items = [f"{k} = {toml_value(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def to_toml(config: Config) -> str:
    """The resolved config as TOML that `load_config` reads back to the same `Config` (keys
    whose value is none are written as comments, or as "none" where the preset has a value).
    It is stored (`config.toml`, checkpoints' `meta.json`) and printed, so a value holding a
    credential is written redacted, and says so."""
    lines = ["[model]", f'preset = "{config.model_preset}"']
    if config.model_init_from is not None:
        lines.append(f"init_from = {toml_value(config.model_init_from)}")
    preset = PRESETS[config.model_preset]
    sections: list[tuple[str, Any]] = [("model", config.model)]
    sections += [(name, getattr(config, name)) for name in SECTIONS]
    for name, section in sections:
        if name != "model":
            lines += ["", f"[{name}]"]
        for item in key_fields(section):
            value = getattr(section, item.name)
            preset_has = section is config.model and getattr(preset, item.name) is not None
            if value is None and not preset_has:
                lines.append(f"# {key_of(item)} = (none)")
            else:
                text = toml_value(value)
                if redact(text) != text:
                    lines.append(f"# {key_of(item)}: redacted, it held a credential")
                lines.append(f"{key_of(item)} = {redact(text)}")
    return "\n".join(lines) + "\n"
