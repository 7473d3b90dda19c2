"""Training data: hp-data registry → the datasets a run reads (`loader.py` reads them).

Sample counts are Megatron's: `steps x global batch` for training (each step's own batch under
`train.batch_ramp`) and `eval_iters x global batch x (steps // eval_interval + 1)` for
validation. The sampler's global order does not depend on
the data-parallel size, so `consumed_samples` alone says where a run is. Index caches are built
once per machine before the first step: local rank 0 first, the other ranks after it (they then
load what it wrote). Tensor-parallel ranks of one data-parallel line read the same samples; a
pipeline's middle stages read nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from hp_data.blend import megatron_sample_counts, parse_blend
from hp_data.errors import HpDataError
from hp_data.format.commit import recover
from hp_data.format.header import prefix_of
from hp_data.object_store import StoreOptions, exists, is_url
from hp_data.phase_report import mix_report
from hp_data.phases import build_phased, plan_phases
from hp_data.registry import DataSource, resolve
from hp_data.token_ids import token_ids
from hp_data.tokenize import TokenizerFiles, vocab_size

from hp_runtime.train.batch import BatchPlan, batch_plan, phase_starts
from hp_runtime.train.config import Config, DataConfig
from hp_runtime.train.errors import ConfigError, TrainError
from hp_runtime.train.launch import Runtime, agree

# The batch plan lives in batch.py and the loader in loader.py: BatchPlan, batch_plan,


def sample_counts(config: Config, plan: BatchPlan) -> tuple[int, int]:
    """(train, validation) samples: the train steps' own (a ramp's smaller steps counted as
    they are), and Megatron's validation count, always at the full global batch."""
    t = config.train
    _, valid, _ = megatron_sample_counts(
        None, t.steps, plan.global_batch_size, t.eval_iters, t.eval_interval
    )
    return plan.samples_after(t.steps), valid


@dataclass(frozen=True)
class RunData:
    """The run's data, resolved once before anything is read (`resolve_data`): each split's
    source (hp-data's `DataSource`: type, shares, seeds, identity), the samples it gives and
    the config keys that name its corpora in messages. Building, checking, `blame` and
    `mix-report` read this; none of them asks the registry again."""

    sources: dict[str, DataSource]  # "train", and "valid" where the run validates
    counts: dict[str, int]
    keys: dict[str, tuple[tuple[str, str | None], ...]]  # split -> (config key, blend spec)
    vocab_size: int  # model.vocab_size: every id read must be below it
    needs_eod: str | None  # the first data key on that reads the end-of-document id
    cumulative: np.ndarray | None = None  # data.phases: samples consumed after each step

    def build(self, split: str) -> Any:
        """`split`'s dataset: `counts[split]` samples (the train split of phases, by phase)."""
        source = self.sources[split]
        if split == "train" and self.cumulative is not None:
            data = source.shaped
            return build_phased(data.phases, data, self.cumulative, "data.phases")  # type: ignore[attr-defined]
        return source.build(split, self.counts[split])


def _split_configs(config: Config, validation: bool) -> dict[str, DataConfig]:
    """The data config each split is built from: `[data]` itself, its index cache under
    RUN_DIR unless `data.cache_dir` says otherwise and `dummy` ids below `model.vocab_size`;
    validation (when `validation`) from `data.valid_path`, used whole, when one is given, else
    from the valid share of `data.path` (with `data.phases`: the first phase's path)."""
    d = config.data
    d = replace(
        d,
        cache_dir=d.cache_dir or os.path.join(config.train.run_dir, "index-cache"),
        vocab_size=config.model.vocab_size,
    )
    configs = {"train": d}
    if validation:
        first = replace(d, path=d.phases[0].path) if d.phases else d
        configs["valid"] = replace(d, path=d.valid_path, split="0,1,0") if d.valid_path else first
    return configs


def _corpus_keys(config: Config, split: str) -> tuple[tuple[str, str | None], ...]:
    """(config key, blend spec) of each corpus `split` reads, for the checks' messages."""
    d = config.data
    if split == "valid" and d.valid_path:
        return (("data.valid_path", d.valid_path),)
    if d.phases:
        phases = d.phases if split == "train" else d.phases[:1]
        return tuple((f"data.phases[{i}].path", phase.path) for i, phase in enumerate(phases))
    return (("data.path", d.path),)


def resolve_data(config: Config, plan: BatchPlan, validation: bool | None = None) -> RunData:
    """The run's data as `RunData`; validation (unless `validation` says otherwise: where the
    run validates) needs a valid share to draw from, or `data.valid_path`."""
    train, valid = sample_counts(config, plan)
    counts = {"train": train, "valid": valid}
    configs = _split_configs(config, valid > 0 if validation is None else validation)
    sources = {split: resolve(part) for split, part in configs.items()}
    if "valid" in sources and not sources["valid"].has("valid"):
        raise ConfigError(
            f"train.eval_interval={config.train.eval_interval} needs validation data: give "
            f'data.valid_path, or a valid share in data.split (e.g. "98,2,0")'
        )
    d = config.data
    names = ("eod_mask_loss", "reset_position_ids", "document_masking")
    return RunData(
        sources,
        {split: counts[split] for split in sources},
        {split: _corpus_keys(config, split) for split in sources},
        config.model.vocab_size,
        next((f"data.{name}" for name in names if getattr(d, name)), None),
        plan.cumulative_samples(config.train.steps) if d.phases else None,
    )


def _prefixes(key: str, spec: str) -> list[str]:
    """The prefixes of the blend `spec` that config `key` names, each checked to exist."""
    try:
        prefixes = [prefix_of(p) for p in parse_blend(spec)[0]]
    except HpDataError as exc:
        raise TrainError(f"{key}: {exc}") from None
    for prefix in prefixes:
        if is_url(prefix):  # asked of the store (the .idx's HEAD)
            try:
                found = exists(prefix)
            except HpDataError as exc:
                raise TrainError(f"{key}: {exc}") from None
        else:
            recover(prefix)
            found = os.path.exists(prefix + ".idx")
        if not found:
            raise TrainError(f"{key}: {prefix}.idx: no such dataset")
    return prefixes


def _resolve_eod(
    given: int | None, needs: str | None, recorded: dict[str, dict[str, Any] | None]
) -> int | None:
    """data.eod_token (`given`), else the EOD id every prefix's PREFIX.hp.json records when a
    key on (`needs`) needs one; refused when they disagree with it or with each other."""
    ids = {prefix: (m or {}).get("eod") for prefix, m in recorded.items()}
    ids = {prefix: eod for prefix, eod in ids.items() if type(eod) is int}
    if given is not None:
        for prefix, eod in ids.items():
            if eod != given:
                raise TrainError(
                    f"data.eod_token = {given} but {prefix}.hp.json records EOD id {eod}: "
                    f"set data.eod_token = {eod}, or leave it unset"
                )
        return given
    if needs is None:
        return None
    unrecorded = [prefix for prefix in recorded if prefix not in ids]
    if unrecorded:
        raise TrainError(
            f"{needs} needs the end-of-document id and {unrecorded[0]}.hp.json records none: "
            f"set data.eod_token"
        )
    if len(set(ids.values())) > 1:
        found = ", ".join(f"{prefix} {eod}" for prefix, eod in ids.items())
        raise TrainError(
            f"{needs} needs one end-of-document id but the blend records several ({found}): "
            f"set data.eod_token"
        )
    return next(iter(ids.values()))


def _too_small(limit: int, where: str, largest: int, vocabulary: Any) -> TrainError:
    hint = f" (the tokenizer's vocabulary is {vocabulary})" if type(vocabulary) is int else ""
    return TrainError(
        f"model.vocab_size = {limit} but {where} holds token id {largest}"
        f"{hint}: set model.vocab_size to at least {largest + 1}"
    )


def _checked_source(data: RunData, split: str) -> DataSource:
    """`split`'s source with the EOD id it reads, once every id its corpora hold is checked
    to fit `model.vocab_size` and to be no negative."""
    source, limit = data.sources[split], data.vocab_size
    recorded = {}
    for prefix in (p for key, spec in data.keys[split] for p in _prefixes(key, spec)):  # type: ignore[arg-type]
        found = token_ids(prefix, source.config.cache_dir, limit, StoreOptions.of(source.config))
        recorded[prefix] = found.metadata
        if found.largest is not None and found.largest >= limit:
            vocabulary = (found.metadata or {}).get("vocab_size")
            raise _too_small(limit, prefix, found.largest, vocabulary)
        if found.smallest is not None and found.smallest < 0:
            raise TrainError(
                f"{prefix} holds token id {found.smallest}: an embedding takes ids from 0 "
                f"to model.vocab_size - 1; check how it was tokenized"
            )
    eod = _resolve_eod(source.config.eod_token, data.needs_eod, recorded)
    return resolve(replace(source.config, eod_token=eod))


def check_data(data: RunData) -> RunData:
    """Before the first step: every token id the run can read fits model.vocab_size (an id
    beyond the embedding fails at the first sample holding it, on a GPU as a device-side
    assert), and the EOD id is known where a key needs one. Returns `data` with the EOD id
    each split reads. The largest id is exact and cheap: recorded at preprocess, else scanned
    once and kept in the index cache (hp_data.token_ids)."""
    train = data.sources["train"]
    if train.config.type == "dummy":  # ids drawn from [0, model.vocab_size): nothing to check
        return data
    if train.kind.needs_tokenizer:  # tokenized by the run: the tokenizer's ids
        tokenizer = train.config.tokenizer
        count = vocab_size(TokenizerFiles.locate(tokenizer).load())  # type: ignore[arg-type]
        if count > data.vocab_size:
            raise _too_small(data.vocab_size, f"the tokenizer {tokenizer}", count - 1, count)
        return data
    return replace(data, sources={split: _checked_source(data, split) for split in data.sources})


@dataclass
class Datasets:
    train: Any | None
    valid: Any | None
    identity: dict[str, Any]  # each split's `DataSource.identity`, stored in checkpoints
    build_seconds: float
    eod_token: int | None = None  # resolved (data.eod_token or the corpus's), where read


def build_datasets(data: RunData, runtime: Runtime, reads: bool) -> Datasets:
    """The train and validation datasets on ranks that `reads`; local rank 0 builds the index
    caches first (even when it reads nothing), the others load them after."""
    built: dict[str, Any] = {}
    start = time.perf_counter()

    def build() -> None:
        nonlocal data
        data = check_data(data)
        built.update({split: data.build(split) for split in data.sources})
        if data.needs_eod and data.sources["train"].document_end(built["train"]) is None:
            raise TrainError(
                f"{data.needs_eod} needs the end-of-document id, which this data does not "
                f"give: set data.eod_token"
            )

    for turn in (True, False):  # local rank 0's turn, then everyone else's
        failure = None
        if (runtime.local_rank == 0) == turn and (reads or turn):
            try:
                build()
            except TrainError as exc:  # the checks' own, naming the key to change
                failure = exc
            except (HpDataError, OSError, ValueError) as exc:
                failure = TrainError(f"data: {exc}")
        agree(failure, runtime)
    seconds = time.perf_counter() - start
    keys = {split: data.sources[split].identity(built[split], split) for split in built}
    eod = data.sources["train"].document_end(built["train"]) if "train" in built else None
    return Datasets(built.get("train"), built.get("valid"), keys, seconds, eod)


def mixture_report(config: Config) -> dict[str, Any]:
    """`hp-train mix-report`: `hp_data.phase_report.mix_report` of the config's phases, counted
    as the run counts them (its batch plan, its index cache) without reading a token."""
    if not config.data.phases:
        raise ConfigError(
            "data.phases: mix-report reports the phases of a run, and this config gives none"
        )
    plan = batch_plan(config)
    phase_starts(config, plan)
    data = resolve_data(config, plan, validation=False)
    shaped = data.sources["train"].shaped
    try:
        phases = plan_phases(shaped.phases, shaped, data.cumulative, "data.phases")  # type: ignore[attr-defined]
    except HpDataError as exc:
        raise TrainError(str(exc)) from None
    return mix_report(phases)
