"""The config's schema: one frozen dataclass a section, `Config` holding them, and the keys
each section has (`KEYS`). Everything else in the package reads it; it reads nothing of theirs,
so a new key is one field here (plus its range, if it is a number)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from hp_data.phases import Phase
from hp_data.registry import DATASET_REGISTRY, DatasetConfig

from hp_runtime.model.config import CHUNK_TOKENS, FieldError, ModelConfig
from hp_runtime.model.presets import PRESETS
from hp_runtime.parallel.mesh import ParallelDims
from hp_runtime.parallel.options import Float8, ParallelOptions


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
    float8: Float8 | None = None  # float8 linears (hp-runtime[float8]); none: the compute dtype


@dataclass(frozen=True, kw_only=True)
class Muon:
    """`optim.muon = {lr, momentum, nesterov, ns_steps, weight_decay, adjust_lr}`: the
    arguments of `torch.optim.Muon`, with its defaults (`adjust_lr` is its `adjust_lr_fn`:
    "original" is Keller Jordan's sqrt(max(1, rows/cols)), "match_rms_adamw" Moonlight's
    0.2 sqrt(max(rows, cols)), "spectral_unclamped" sqrt(rows/cols)). `lr` is the peak of
    optim's schedule for Muon (`train/optim.py:muon_schedule`). Muon updates the hidden
    matrices, AdamW with the `optim.*` keys the rest (`train/optim.py`).

    `ns_dtype` is hp's own: the Newton-Schulz iteration's dtype, "bfloat16" as torch's, or
    "float32" (the iteration's matmuls at float32's cost): bfloat16's rounding turns a
    gradient one float32 step apart (another layout's order of sums) into losses 1e-3 apart
    within 20 steps, torch's own Muon included; in float32 layouts agree within 1e-5."""

    lr: float = 1e-3
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    weight_decay: float = 0.1
    adjust_lr: Literal["original", "match_rms_adamw", "spectral_unclamped"] = "original"
    ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: Literal["adamw", "sgd", "muon"] = "adamw"
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
    muon: Muon | None = None  # muon's own keys (none: its defaults); AdamW's are the above

    @property
    def muon_settings(self) -> Muon:
        """optim.muon, or torch's defaults where it is unset."""
        return self.muon or Muon()


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    interval: int = 0  # steps between saves (and one at the end); 0: none
    resume: str = "auto"  # "auto": the newest in RUN_DIR; "none": fresh; or a checkpoint path
    keep: int = 0  # the newest K committed checkpoints stay; 0: all
    async_save: bool = field(default=False, metadata={"key": "async"})
    allow_data_change: bool = False
    dir: str | None = None  # RUN_DIR/checkpoints; or an fsspec URL prefix (s3://bucket/run/...)
    upload_concurrency: int = 8  # with a URL dir: a rank's parts of a file uploaded at once
    local_copy: bool = False  # with a URL dir: the newest also in RUN_DIR/checkpoints


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


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """`[eval]`: downstream tasks through lm-evaluation-harness (`hp-runtime[eval]`), run inside
    the training job on its layout every `interval` steps and at the last (`train/downstream.py`);
    `hp-train eval` reads the batch size and tokenizer from here too."""

    tasks: tuple[str, ...] = ()  # lm-eval task or group names, or task YAML files; (): none
    interval: int = 1000  # steps between evaluations
    limit: int | None = None  # the first N documents of each task; none: all
    batch_size: int = 8  # sequences a forward, per data-parallel rank
    include: tuple[str, ...] = ()  # directories of the user's own task YAMLs
    tokenizer: str | None = None  # a tokenizer.json, a directory or a hub name; none: data's


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
    eval: EvalConfig


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "eval": EvalConfig,
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


def as_table(value: Any) -> dict[str, Any]:
    """A table key's value (a dataclass) as config.toml holds it: its fields by key."""
    return {key_of(f): getattr(value, f.name) for f in key_fields(value)}
