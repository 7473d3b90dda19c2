"""Whether this run may resume a checkpoint: the same model (its resolved config, then its
tensors by name and shape), the same optimizer, global batch and ramp, and the same data,
compared with what the checkpoint's `meta.json` recorded; each refusal names the key that
changed and what to do.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from typing import Any

import torch
from hp_data.phases import state_change
from hp_data.redact import redact_data
from hp_data.registry import same_samples

from hp_runtime.model import ModelConfig, Transformer
from hp_runtime.train.batch import BatchPlan
from hp_runtime.train.checkpoint_format import META, CheckpointError
from hp_runtime.train.config import BatchRamp, Config, as_table, toml_value
from hp_runtime.train.config.schema import Muon

# The data keys a checkpoint records and a resume compares (stored redacted: `redact_data`).
DATA_KEYS = ("type", "path", "valid_path", "split", "seed", "seq_length")
# Fields that change nothing a checkpoint holds, so a resume may change them: the init, and
# the attention kernel (every one computes the same rule; a GPU run's `flex` resumes on CPU).
INIT_ONLY = {"init_std", "attention"}
# model.moe's fields a resume may change: the balancing's rates (the bias the checkpoint holds
# goes on from where it is); every other field shapes or routes the model.
MOE_MAY_CHANGE = {"aux_loss_coef", "bias_update_rate"}
# model.mtp's: its loss's weight (DeepSeek-V3 lowered it from 0.3 to 0.1 after 10T tokens)
MTP_MAY_CHANGE = {"loss_weight"}
# the model's table keys, compared as config.toml writes them
TABLES = ("rope_scaling", "moe", "mla", "mtp")


def saved_section(meta: dict[str, Any], name: str) -> dict[str, Any]:
    """A table (`model`, `optim`, ...) of the config a checkpoint was written with."""
    return tomllib.loads(meta["config"]).get(name, {})


def saved_model(meta: dict[str, Any]) -> dict[str, Any]:
    """The [model] table of the config a checkpoint was written with."""
    return saved_section(meta, "model")


def first_change(
    meta: dict[str, Any], name: str, current: Any, keys: Iterable[str]
) -> tuple[str, Any, Any] | None:
    """The first of `keys` whose value in `current` (a config section) differs from the
    checkpoint's [name] table: (key, value now, value saved). A key the checkpoint does not
    record (written by an older hp) is not compared."""
    saved = saved_section(meta, name)
    for key in keys:
        if key in saved and saved[key] != getattr(current, key):
            return key, getattr(current, key), saved[key]
    return None


def check_model(path: str, meta: dict[str, Any], config: ModelConfig) -> None:
    """Refuse a checkpoint of another model before any tensor is read: the resolved model
    config first (every field that shapes or means something), naming what differs."""
    keys = [item.name for item in fields(ModelConfig) if item.name not in {*INIT_ONLY, *TABLES}]
    change = first_change(meta, "model", config, keys)
    if change is not None:
        key, have, saved = change[0], repr(change[1]), repr(change[2])
    else:
        table = _table_change(meta, config)
        if table is None:
            return
        key, have, saved = table
    raise CheckpointError(
        f"model.{key} = {have}, but {path} was trained with {saved}: a checkpoint "
        f"resumes only the model that wrote it; set model.{key} = {saved} (or export it "
        f"and start a new train.run_dir with model.init_from)",
        fallback=False,
    )


def _table_change(meta: dict[str, Any], config: ModelConfig) -> tuple[str, str, str] | None:
    """The first table key that differs from the checkpoint's: (key, value now, value saved)
    as config.toml writes them. Absent is none: a comment where the preset has none, or an hp
    before the key."""
    for key in TABLES:
        then = saved_model(meta).get(key, "none")
        value = getattr(config, key)
        now = "none" if value is None else as_table(value)
        free = {"moe": MOE_MAY_CHANGE, "mtp": MTP_MAY_CHANGE}.get(key, set())
        if isinstance(then, dict) and isinstance(now, dict):  # fields after the checkpoint's hp
            free = free | {k for k in now.keys() - then.keys() if now[k] == _default(value, k)}
        if _without(then, free) != _without(now, free):
            return key, toml_value(now), toml_value(then)
    return None


def _default(table: Any, name: str) -> Any:
    """A table's field's default: what an hp before the field computed (`model.moe.groups`)."""
    field = next(f for f in fields(table) if f.name == name)
    return field.default


def _without(table: Any, names: set[str]) -> Any:
    """A table (or "none") without the fields `names`."""
    return {k: v for k, v in table.items() if k not in names} if isinstance(table, dict) else table


# What the optimizer's state was built with; the schedule keys (lr, warmup, decay) may change.
OPTIMIZER_KEYS = ("name", "weight_decay", "decay_embeddings", "beta1", "beta2", "eps", "momentum")


def check_optimizer(path: str, meta: dict[str, Any], config: Config) -> None:
    """Refuse a resume whose optimizer differs from the checkpoint's: its saved hyperparameters
    would silently win over the config (or another optimizer's state would not load)."""
    change = first_change(meta, "optim", config.optim, OPTIMIZER_KEYS)
    if change is None and config.optim.name == "muon":
        change = _muon_change(meta, config.optim.muon_settings)
    if change is not None:
        key, have, saved = change
        raise CheckpointError(
            f"optim.{key} = {have!r}, but {path} was trained with {saved!r}: set it back to "
            f"resume (the schedule's keys, optim.lr, min_lr, warmup and decay, and "
            f"optim.muon.lr, may change)",
            fallback=False,
        )


def _muon_change(meta: dict[str, Any], muon: Muon) -> tuple[str, Any, Any] | None:
    """The first field of optim.muon but its rate that differs from the checkpoint's (an unset
    table is torch's defaults, on either side)."""
    table = saved_section(meta, "optim").get("muon")
    names = {item.name for item in fields(Muon)}
    saved = (
        Muon(**{k: v for k, v in table.items() if k in names})
        if isinstance(table, dict)
        else Muon()
    )
    for item in fields(Muon):
        have, was = getattr(muon, item.name), getattr(saved, item.name)
        if item.name != "lr" and have != was:
            return f"muon.{item.name}", have, was
    return None


def check_tensors(path: str, metadata: Any, config: ModelConfig) -> None:
    """The checkpoint's model tensors must be exactly the model's, by name and global shape:
    a tensor missing from either side is refused by name, never skipped."""
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in Transformer(config).state_dict().items()}
    saved = {
        key[len("model.") :]: tuple(getattr(value, "size", ()))
        for key, value in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    if missing or extra:
        parts = [f"has no {', '.join(missing)}"] if missing else []
        parts += [f"has {', '.join(extra)}, which this model does not"] if extra else []
        raise CheckpointError(f"{path}: {'; '.join(parts)}: the model changed", fallback=False)
    for name, shape in expected.items():
        if saved[name] != shape:
            raise CheckpointError(
                f"{path}: parameter {name} has shape {list(saved[name])} in the checkpoint but "
                f"{list(shape)} in this model: the model changed",
                fallback=False,
            )


def _ramp_shown(ramp: BatchRamp | None) -> str:
    return "none" if ramp is None else f"[{ramp.start}, {ramp.increment}, {ramp.samples}]"


def check_ramp(meta: dict[str, Any], path: str, plan: BatchPlan, phased: bool = False) -> None:
    """A changed (or added, or removed) `train.batch_ramp` changes which samples the steps
    train on: refused while the checkpoint's next step is inside either ramp. Past both ends
    every step trains the full batch either way; then it is refused only if the new ramp
    counts fewer samples up to the checkpoint than the run trained (the data is built for the
    new count, and would run out), or, with `data.phases` (`phased`), another number: each
    phase's first sample is the plan's count before its step, so the later phases would
    start at other steps."""
    recorded = saved_section(meta, "train").get("batch_ramp")  # none: written without one
    try:
        saved = None if recorded is None else BatchRamp(**recorded)
        before = replace(plan, ramp=saved)
    except (TypeError, ValueError):
        raise CheckpointError(
            f"{os.path.join(path, META)}: field 'config' holds train.batch_ramp = "
            f"{recorded!r}, not a ramp of its global batch"
        ) from None
    if saved == plan.ramp:
        return
    step, trained = meta["step"], meta["consumed_samples"]
    change = (
        f"train.batch_ramp changed from {_ramp_shown(saved)} to {_ramp_shown(plan.ramp)} "
        f"since {path}"
    )
    last = max(before.full_from, plan.full_from) - 1  # the last step smaller than the batch
    if step < last:
        raise CheckpointError(
            f"{change}, whose step {step} is inside a ramp (smaller batches until step {last}): "
            "keep train.batch_ramp as it was to resume",
            fallback=False,
        )
    if plan.samples_after(step) < trained:
        raise CheckpointError(
            f"{change}: the new ramp counts {plan.samples_after(step)} samples up to step "
            f"{step}, fewer than the {trained} trained, so the data built would run out; keep "
            "train.batch_ramp as it was to resume",
            fallback=False,
        )
    if phased and plan.samples_after(step) != trained:
        raise CheckpointError(
            f"{change}: with data.phases the new ramp counts {plan.samples_after(step)} "
            f"samples up to step {step}, not the {trained} trained, so the later phases would "
            "start at other steps than their from_step or from_tokens; keep train.batch_ramp "
            "as it was to resume",
            fallback=False,
        )


def check_compatible(
    meta: dict[str, Any],
    path: str,
    config: Config,
    plan: BatchPlan,
    identity: dict[str, Any],
    warn: Callable[[str], None],
    mixture: Callable[[int, int], dict[str, Any]] | None = None,
) -> None:
    """Refuse a resume that would not continue the same run: another model, another global
    batch size or ramp, or other data (unless `checkpoint.allow_data_change`), naming what
    changed. With `data.phases`, `mixture` (`PhasePlan.state_at`) says what this config
    trained by the checkpoint's step: a phase changed after it is the same run, one before is
    not."""
    check_model(path, meta, config.model)
    check_optimizer(path, meta, config)
    saved_gbs = meta["global_batch_size"]
    if saved_gbs != plan.global_batch_size:
        raise CheckpointError(
            f"train.global_batch_size={plan.global_batch_size}, but {path} was trained with "
            f"{saved_gbs}: keep it to resume (the data-parallel size may change)",
            fallback=False,
        )
    check_ramp(meta, path, plan, phased=mixture is not None)
    saved = meta["data"]
    now = redact_data({key: getattr(config.data, key) for key in DATA_KEYS})
    changes = [
        f"data.{key} changed from {saved['config'][key]!r} to {now[key]!r}"
        for key in saved["config"]
        if key in now and saved["config"][key] != now[key]
    ]
    # A pipeline's middle stages read no data and hold no identity: the others compare.
    if not changes and identity and not same_samples(saved["fingerprint"], identity):
        changes = ["the corpus files behind the data paths changed"]
    if not changes and mixture is not None and "mixture" in meta:
        now_mix = mixture(meta["step"], meta["consumed_samples"])
        reason = state_change(meta["mixture"], now_mix, meta["step"])
        changes = [] if reason is None else [reason]
    if not changes:
        return
    message = f"{'; '.join(changes)} since {path}"
    if not config.checkpoint.allow_data_change:
        raise CheckpointError(
            message + ": set checkpoint.allow_data_change = true to resume anyway",
            fallback=False,
        )
    warn(f"hp-train: warning: {message}; resuming anyway (checkpoint.allow_data_change)")
