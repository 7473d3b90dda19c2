"""Training data: hp-data registry → Megatron's pretraining sampler → DataLoader workers.

Sample counts are Megatron's: `steps x global batch` for training (each step's own batch under
`train.batch_ramp`) and `eval_iters x global batch x (steps // eval_interval + 1)` for
validation. The sampler's global order does not depend on
the data-parallel size, so `consumed_samples` alone says where a run is. Index caches are built
once per machine before the first step: local rank 0 first, the other ranks after it (they then
load what it wrote). Tensor-parallel ranks of one data-parallel line read the same samples; a
pipeline's middle stages read nothing.
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from hp_data.blend import megatron_sample_counts, parse_blend
from hp_data.errors import HpDataError
from hp_data.format.commit import recover
from hp_data.format.header import prefix_of
from hp_data.object_store import StoreOptions, exists, is_url
from hp_data.phase_report import mix_report
from hp_data.phases import build_phased, plan_phases, resolve_starts
from hp_data.read_ahead import ReadAhead
from hp_data.registry import DataSource, resolve
from hp_data.sampler import PretrainingSampler
from hp_data.token_ids import token_ids
from hp_data.tokenize import TokenizerFiles, vocab_size
from hp_data.torch_adapter import make_dataloader, worker_message

from hp_runtime.train.config import BatchRamp, Config, DataConfig
from hp_runtime.train.errors import ConfigError, TrainError
from hp_runtime.train.launch import Runtime, agree

Batch = dict[str, torch.Tensor]


Level = tuple[int, int, int]  # (first step, samples consumed before it, batch size)


def _ramp_levels(ramp: BatchRamp | None, global_batch_size: int) -> tuple[Level, ...]:
    """Each batch size the run trains at: its first step, the samples consumed before that
    step, and the size; one level without a ramp. Megatron's rule
    (`RampupBatchsizeNumMicroBatchesCalculator.update`, in its float arithmetic, so that the
    steps are Megatron's to the sample): a step's batch is `start + int(consumed /
    (samples / n)) x increment` for `n = (global - start) / increment` increments, and the
    full batch once `consumed > samples`. One level per increment at most (a few hundred),
    whatever the number of steps: each level's length is arithmetic."""
    if ramp is None:
        return ((1, 0, global_batch_size),)
    n, rest = divmod(global_batch_size - ramp.start, ramp.increment)
    if n < 1 or rest or ramp.start < 1 or ramp.samples < 1:  # `_check_ramp` names the key
        raise ValueError(f"{ramp} does not ramp up to a global batch of {global_batch_size}")
    per = ramp.samples / n

    def level(consumed: int) -> int:
        return n if consumed > ramp.samples else int(consumed / per)

    def threshold(j: int) -> int:
        """The fewest consumed samples at which the level is at least `j` (<= samples + 1)."""
        c = -(-j * ramp.samples // n)  # exact where the float rounding agrees; then mended
        while c > 0 and level(c - 1) >= j:
            c -= 1
        while level(c) < j:
            c += 1
        return c

    levels, step, consumed = [], 1, 0
    while True:
        k = level(consumed)
        size = ramp.start + k * ramp.increment
        levels.append((step, consumed, size))
        if k == n:
            return tuple(levels)
        count = -(-(threshold(k + 1) - consumed) // size)  # steps at this size
        step, consumed = step + count, consumed + count * size


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch divides into micro-batches (and, with PP, into schedule steps), and
    how it grows over the first steps under `train.batch_ramp`."""

    micro_batch_size: int
    global_batch_size: int
    dp_size: int
    pp_microbatches: int = 1  # micro-batches per pipeline schedule step
    ramp: BatchRamp | None = None
    levels: tuple[Level, ...] = field(init=False, repr=False, compare=False)
    _firsts: list[int] = field(init=False, repr=False, compare=False)  # for bisect

    def __post_init__(self) -> None:
        levels = _ramp_levels(self.ramp, self.global_batch_size)
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "_firsts", [first for first, _, _ in levels])

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per step at the full global batch."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def full_from(self) -> int:
        """The first step that trains the full global batch (1 without a ramp)."""
        return self.levels[-1][0]

    # The per-step view (issue 24): with `train.batch_ramp` the global batch grows over the
    # first steps; every caller that needs a step's batch, its micro-batches or the samples
    # trained so far asks these, never `global_batch_size` times a step count.

    def _before(self, step: int) -> tuple[int, int]:
        """(samples consumed before step `step` >= 1, the step's batch)."""
        first, consumed, size = self.levels[bisect.bisect_right(self._firsts, step) - 1]
        return consumed + (step - first) * size, size

    def global_batch_at(self, step: int) -> int:
        """The global batch of step `step` (steps count from 1)."""
        return self._before(step)[1]

    def accumulation_at(self, step: int) -> int:
        """Micro-batches per rank in step `step`."""
        return self.global_batch_at(step) // (self.micro_batch_size * self.dp_size)

    def samples_after(self, step: int) -> int:
        """Samples consumed once steps 1..`step` are done (0 for step 0)."""
        return self._before(step + 1)[0]

    def cumulative_samples(self, steps: int) -> np.ndarray:
        """int64 [steps + 1]: `samples_after(s)` for s = 0..steps, in one array (the ramp's
        levels looked up, the full batch's steps arithmetic)."""
        first, consumed, size = np.array(self.levels, dtype=np.int64).T
        ramp = min(self.full_from - 1, steps + 1)  # entries before the first full step
        head = np.arange(1, ramp + 1, dtype=np.int64)  # entry s - 1 is consumed before step s
        i = np.searchsorted(first, head, side="right") - 1
        tail = np.arange(ramp + 1, steps + 2, dtype=np.int64)
        return np.concatenate(
            [
                consumed[i] + (head - first[i]) * size[i],
                consumed[-1] + (tail - first[-1]) * size[-1],
            ]
        )


def _check_ramp(config: Config, plan: BatchPlan) -> None:
    """`train.batch_ramp` against the global batch and the layout of `plan` (built without
    it): Megatron's asserts, as one line each, and what the pipeline cannot do."""
    ramp, gbs, p = config.train.batch_ramp, plan.global_batch_size, config.parallel
    if ramp is None:
        return
    key = f"train.batch_ramp = [{ramp.start}, {ramp.increment}, {ramp.samples}]"
    if p.pp > 1:
        raise ConfigError(
            f"{key} with parallel.pp={p.pp} is not supported: the pipeline schedule's "
            f"micro-batch count is fixed when it is built; remove train.batch_ramp or set "
            f"parallel.pp = 1"
        )
    if ramp.start >= gbs:
        raise ConfigError(
            f"{key}: start must be less than train.global_batch_size={gbs} (the ramp grows "
            f"the batch up to it); lower start, or remove train.batch_ramp"
        )
    if (gbs - ramp.start) % ramp.increment:
        raise ConfigError(
            f"{key}: increment does not divide train.global_batch_size - start = "
            f"{gbs - ramp.start}; choose an increment that does"
        )
    unit = plan.micro_batch_size * plan.dp_size
    if ramp.start % unit or ramp.increment % unit:
        raise ConfigError(
            f"{key}: every global batch of the ramp must be a multiple of "
            f"train.micro_batch_size x data-parallel size = {plan.micro_batch_size} x "
            f"{plan.dp_size} = {unit}; make start and increment multiples of {unit}"
        )


def batch_plan(config: Config) -> BatchPlan:
    """Global batch = micro-batch x data-parallel size x accumulation steps, checked."""
    p, t = config.parallel, config.train
    dp = p.dp_replicate * p.dp_shard
    gbs = t.global_batch_size or t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size={gbs} is not a multiple of train.micro_batch_size x "
            f"data-parallel size = {t.micro_batch_size} x {dp} = {t.micro_batch_size * dp}"
        )
    plan = BatchPlan(t.micro_batch_size, gbs, dp)
    n = p.pp_microbatches or plan.accumulation
    if p.pp > 1 and plan.accumulation % n:
        raise ConfigError(
            f"parallel.pp_microbatches={n} does not divide the {plan.accumulation} "
            f"micro-batches per step (global batch {gbs} / micro-batch "
            f"{t.micro_batch_size} / data-parallel {dp})"
        )
    _check_ramp(config, plan)
    return replace(plan, pp_microbatches=n, ramp=t.batch_ramp)


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


def phase_starts(config: Config, plan: BatchPlan) -> list[int]:
    """Each of `[[data.phases]]`'s first step, checked to start the run and in order (a
    `from_tokens` needs each step's samples); a ConfigError naming the phase."""
    cumulative = plan.cumulative_samples(config.train.steps)
    try:
        return resolve_starts(config.data.phases, config.data.seq_length, cumulative, "data.phases")
    except HpDataError as exc:
        raise ConfigError(str(exc)) from None


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


class _Prefetch:
    """Pulls micro-batches from a DataLoader on a background thread, so that receiving a batch
    from a worker process (unpickling, mapping its shared memory: milliseconds) overlaps the
    step instead of adding to it. An error in the thread is raised in the caller."""

    _END = object()

    def __init__(self, loader: Any, depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, args=(loader,), daemon=True)
        self._thread.start()

    def _run(self, loader: Any) -> None:
        try:
            for batch in loader:
                self._queue.put(batch)
            self._queue.put(self._END)
        except BaseException as exc:  # handed to the consumer
            self._queue.put(exc)

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item


class Loader:
    """This rank's micro-batches from `consumed_samples` on, moved to the device; the time
    spent waiting for them is kept in `waited` (seconds, reset by the caller). `workers`
    DataLoader processes (`data.num_workers`; None: 1 on a multi-core machine, 0 on one
    core). With `background`, batches are received ahead on a thread (`depth` of them). The
    chunks of a URL prefix that the next micro-batches will read are fetched ahead into the
    node's cache (`ReadAhead`), as far ahead as the DataLoader's own prefetch and one step."""

    def __init__(
        self,
        dataset: Any,
        plan: BatchPlan,
        dp_rank: int,
        consumed_samples: int,
        device: torch.device,
        workers: int | None,
        prefetch_factor: int,
        background: bool = True,
    ) -> None:
        self.sampler = PretrainingSampler(
            len(dataset), consumed_samples, plan.micro_batch_size, dp_rank, plan.dp_size
        )
        if workers is None:
            workers = 1 if (os.cpu_count() or 1) > 1 else 0
        self.loader = make_dataloader(
            dataset,
            self.sampler,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            prefetch_factor=prefetch_factor,
        )
        self.device = device
        self.depth = 2 * plan.accumulation if background else 0
        self.waited = 0.0
        self._iterator: Iterator[Batch] | _Prefetch | None = None
        self.read_ahead = ReadAhead(dataset)
        self._ahead = self.depth + max(workers, 1) * prefetch_factor + plan.accumulation
        self._next, self._taken = consumed_samples, 0  # where the next micro-batch starts

    def restart(self, consumed_samples: int) -> None:
        """Start over from `consumed_samples` (validation starts at 0 every time)."""
        self.sampler.load_state_dict({"consumed_samples": consumed_samples})
        self._iterator = None
        self._next, self._taken = consumed_samples, 0

    def _coming(self) -> list[int]:
        """The sample ids of this rank's next micro-batches (the sampler's order: global
        micro-batch j starts `j * mbs * dp` samples on; this rank reads its slice)."""
        s = self.sampler
        first = (
            self._next
            + self._taken * s.global_batch_size
            + s.data_parallel_rank * s.micro_batch_size
        )
        return [
            start + i
            for start in range(
                first, first + self._ahead * s.global_batch_size, s.global_batch_size
            )
            for i in range(s.micro_batch_size)
            if start + i < s.total_samples
        ]

    def take(self, count: int) -> list[Batch]:
        self.read_ahead.want(self._coming())
        self._taken += count
        if self._iterator is None:
            self._iterator = _Prefetch(self.loader, self.depth) if self.depth else iter(self.loader)
        out = []
        for _ in range(count):
            start = time.perf_counter()
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise TrainError(
                    "data: the sampler ran out of samples; the dataset is smaller than "
                    "train.steps x train.global_batch_size (less a train.batch_ramp's share)"
                ) from None
            except HpDataError as exc:  # a worker's read (a store gone): one line, no trace
                raise TrainError(worker_message(exc)) from None
            self.waited += time.perf_counter() - start
            out.append(
                {
                    k: v.to(self.device, non_blocking=True)
                    for k, v in batch.items()
                    if isinstance(v, torch.Tensor)
                }
            )
        return out
