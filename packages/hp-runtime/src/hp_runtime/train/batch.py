"""The batch plan: how a run's global batch divides into micro-batches (and pipeline schedule
steps) and how it grows under `train.batch_ramp`, in Megatron's arithmetic, so that every
step's batch and the samples consumed before it are known before the first step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

import numpy as np
from hp_data.errors import HpDataError
from hp_data.phases import resolve_starts

from hp_runtime.train.config import BatchRamp, Config
from hp_runtime.train.errors import ConfigError

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
    groups = 1 if p.fault_tolerance is None else p.fault_tolerance.groups  # each a replica
    dp = p.dp_replicate * p.dp_shard * groups
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


def phase_starts(config: Config, plan: BatchPlan) -> list[int]:
    """Each of `[[data.phases]]`'s first step, checked to start the run and in order (a
    `from_tokens` needs each step's samples); a ConfigError naming the phase."""
    cumulative = plan.cumulative_samples(config.train.steps)
    try:
        return resolve_starts(config.data.phases, config.data.seq_length, cumulative, "data.phases")
    except HpDataError as exc:
        raise ConfigError(str(exc)) from None
