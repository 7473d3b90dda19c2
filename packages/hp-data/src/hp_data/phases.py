"""Data-mixture phases: the samples of a run whose mixture changes at given steps, counted
exactly, so that across phases nothing is repeated or skipped that the phases did not ask for.

A *stream* is a corpus read at one sequence length: `(prefix, seq_length)`. Stream sample k
is row `k % E` of epoch `k // E`, E being the one-epoch sample count of the prefix's train
split at that length, and epoch e is megatron-core's one-epoch GPTDataset of the prefix built
with seed `seed` for e = 0 and `epoch_seed(seed, e)` for e >= 1. Why not one GPTDataset sized
to the whole demand, as a plain run builds: a GPTDataset's shuffle depends on its epoch count,
so a phase that reads a corpus once more would change the samples earlier phases already
took. Independent epochs keep every stream prefix-stable, and a stream that stays within its
first epoch (the case at scale) is exactly megatron-core's.

Phase p covers the global samples [S_p, S_{p+1}) (its steps' samples, from the run's
cumulative sample counts: with a batch ramp they are not linear). Within it the samples are
megatron-core's largest-error blend of the phase's weights, and the phase's j-th sample is
stream c's sample `offset[p][c] + dataset_sample_index[j]`, where `offset[p][c]` is what
stream c gave in phases 0..p-1: a stream read again after a gap continues where it stopped.
No torch here: hp-runtime passes the cumulative counts in.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hp_data.blend import _blend_problem, blend_counts, normalize, parse_blend
from hp_data.cache import load_or_build
from hp_data.dataset import IndexedDataset
from hp_data.errors import HpDataError
from hp_data.format.header import prefix_of
from hp_data.gpt import MAX_SEQ_LENGTH, GPTDataset, GPTDatasetConfig, corpus_fingerprint
from hp_data.gpt import epoch_samples as split_epoch_samples
from hp_data.index import BLENDING_DTYPES, build_blending_indices
from hp_data.object_store import StoreOptions
from hp_data.read_ahead import distinct
from hp_data.redact import redact

INT64_MAX = 2**63 - 1


class PhaseError(HpDataError):
    """A value one field of a phase cannot take, the field named apart from the problem (as
    hp-runtime's `FieldError`), so that the trainer names it `data.phases[i].FIELD`."""

    def __init__(self, name: str, value: object, problem: str) -> None:
        super().__init__(f"{name}={value!r} {problem}")
        self.field, self.value, self.problem = name, value, problem


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One entry of `[[data.phases]]`: where it starts (`from_step`, counted from 1, or
    `from_tokens`, the tokens trained before it), what it reads (`path`: a prefix or a blend
    string, as `data.path`) and at which length (`seq_length`; None: the run's)."""

    from_step: int | None = None
    from_tokens: int | None = None
    path: str
    seq_length: int | None = None

    def __post_init__(self) -> None:
        if self.from_step is None and self.from_tokens is None:
            raise PhaseError(
                "from_step", None, "is needed (or from_tokens): where the phase starts"
            )
        if self.from_step is not None and self.from_tokens is not None:
            raise PhaseError("from_tokens", self.from_tokens, "given with from_step: give one")
        if self.from_step is not None and not (
            _integer(self.from_step) and 1 <= self.from_step <= 2**31 - 1
        ):
            raise PhaseError("from_step", self.from_step, "must be a step from 1 to 2**31 - 1")
        if self.from_tokens is not None and not (
            _integer(self.from_tokens) and 0 <= self.from_tokens <= INT64_MAX
        ):
            raise PhaseError("from_tokens", self.from_tokens, "must be from 0 to 2**63 - 1")
        if self.seq_length is not None and not (
            _integer(self.seq_length) and 2 <= self.seq_length <= MAX_SEQ_LENGTH
        ):
            raise PhaseError("seq_length", self.seq_length, "must be from 2 to 2**31 - 2")
        if not isinstance(self.path, str) or not self.path.strip():
            raise PhaseError("path", self.path, "must be a prefix or a blend '0.3 /a 0.7 /b'")
        try:
            prefixes, _ = parse_blend(self.path)
        except HpDataError as exc:
            raise PhaseError("path", self.path, f"is not a blend: {exc}") from None
        names = [prefix_of(p) for p in prefixes]
        twice = next((p for p in names if names.count(p) > 1), None)
        if twice is not None:  # two weights of one stream would read its samples twice
            raise PhaseError("path", self.path, f"names {twice} twice; give it once")

    def blend(self) -> tuple[list[str], list[float]]:
        """The phase's prefixes and normalised weights (a single prefix: weight 1)."""
        prefixes, weights = parse_blend(self.path)
        return [prefix_of(p) for p in prefixes], normalize(weights or [1.0])


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of a stream's epoch `epoch`: `seed` itself for epoch 0 (megatron's
    samples), else the first 32-bit word of numpy's `SeedSequence([seed, epoch])`."""
    if epoch == 0:
        return seed
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


@dataclass(frozen=True)
class Stream:
    prefix: str
    seq_length: int
    epoch_samples: int  # E: the train split's samples in one epoch at this length


@dataclass
class PhasePlan:
    """The accounting of a phased run, without a token read: where each phase starts (in
    steps and samples), its streams and blend, and each stream's offsets and epoch size."""

    phases: tuple[Phase, ...]
    steps: int
    cumulative: np.ndarray  # int64 [steps + 1]: samples after each step
    start_steps: list[int]  # resolved; steps + 1 for a phase the run never reaches
    starts: list[int]  # S_p, and the total samples last
    seq_lengths: list[int]
    streams: list[Stream]
    members: list[list[int]]  # phase -> its streams (numbers into `streams`), blend order
    weights: list[list[float]]
    dataset_index: list[np.ndarray | None]  # None: a single stream (every sample is its own)
    dataset_sample_index: list[np.ndarray | None]
    counts: list[np.ndarray]  # phase -> samples each member gives
    offsets: list[np.ndarray]  # phase -> each member's stream position at the phase's start
    cache_reports: list[dict[str, Any]] = field(default_factory=list)
    store: StoreOptions = field(default_factory=StoreOptions)  # how URL prefixes are read
    _fingerprints: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def total_samples(self) -> int:
        return self.starts[-1]

    def phase_of_step(self, step: int) -> int:
        """The phase that trains step `step`."""
        return bisect.bisect_right(self.start_steps, step) - 1

    def seq_length_at(self, step: int) -> int:
        return self.seq_lengths[self.phase_of_step(step)]

    def step_seq_lengths(self) -> np.ndarray:
        """int64 [steps + 1]: each step's sequence length (index 0 unused)."""
        out = np.empty(self.steps + 1, dtype=np.int64)
        out[0] = self.seq_lengths[0]
        for p, first in enumerate(self.start_steps):
            out[first : self.steps + 1] = self.seq_lengths[p]
        return out

    def locate(self, sample_ids: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """For global sample ids: (stream numbers, stream sample ids), vectorised. What a
        read-ahead asks: which rows of which corpus the next samples read."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        if ids.size and not (int(ids.min()) >= 0 and int(ids.max()) < self.total_samples):
            raise IndexError(f"sample ids outside 0..{self.total_samples - 1}")
        phase = np.searchsorted(np.asarray(self.starts[:-1]), ids, side="right") - 1
        streams = np.empty(ids.shape, dtype=np.int64)
        positions = np.empty(ids.shape, dtype=np.int64)
        for p in np.unique(phase):
            where = phase == p
            local = ids[where] - self.starts[p]
            index = self.dataset_index[p]
            member = np.zeros_like(local) if index is None else index[local].astype(np.int64)
            inner = local if index is None else self.dataset_sample_index[p][local]
            streams[where] = np.asarray(self.members[p], dtype=np.int64)[member]
            positions[where] = self.offsets[p][member] + inner
        return streams, positions

    def consumed(self, samples: int) -> np.ndarray:
        """int64 [streams]: each stream's samples among the first `samples` global ones."""
        out = np.zeros(len(self.streams), dtype=np.int64)
        for p, members in enumerate(self.members):
            first, end = self.starts[p], self.starts[p + 1]
            if samples <= first:
                break
            taken = min(samples, end) - first
            if taken == end - first:
                counts = self.counts[p]
            elif self.dataset_index[p] is None:
                counts = np.array([taken], dtype=np.int64)
            else:
                counts = blend_counts(self.dataset_index[p][:taken], len(members))
            out[members] += counts
        return out

    def fingerprint(self, prefix: str) -> dict[str, Any]:
        """The corpus identity of `prefix` (hashed once per plan)."""
        if prefix not in self._fingerprints:
            with IndexedDataset(prefix, validate=False, store=self.store) as dataset:
                self._fingerprints[prefix] = corpus_fingerprint(dataset)
        return self._fingerprints[prefix]

    def state_at(self, step: int, samples: int) -> dict[str, Any]:
        """What the samples of steps 1..`step` (`samples` of them) depend on: the phases begun
        by then and each stream's consumed count and corpus. A checkpoint keeps it; a resume
        compares it with what its own config gives (`state_change`)."""
        begun = [
            {
                "phase": p,
                "from_step": self.start_steps[p],
                "path": redact(self.phases[p].path),
                "seq_length": self.seq_lengths[p],
            }
            for p in range(len(self.phases))
            if self.start_steps[p] <= step
        ]
        consumed = self.consumed(samples)
        streams = [
            {
                "prefix": redact(s.prefix),
                "seq_length": s.seq_length,
                "consumed": int(n),
                "corpus": self.fingerprint(s.prefix),
            }
            for s, n in zip(self.streams, consumed, strict=True)
            if n
        ]
        return {"phases": begun, "streams": streams}


def state_change(saved: dict[str, Any], current: dict[str, Any], step: int) -> str | None:
    """Why `current` (this config's `state_at` a checkpoint's step) would not continue the run
    that wrote `saved` (None: it would): the first phase begun by `step` that differs, else
    the first stream whose count or corpus differs."""
    old, new = saved.get("phases", []), current["phases"]
    for p in range(max(len(old), len(new))):
        a = old[p] if p < len(old) else None
        b = new[p] if p < len(new) else None
        if a != b:
            shown = b or a
            where = f"data.phases[{p}] (from step {shown['from_step']}, {shown['path']!r})"
            if a is None:
                return f"{where} begins by step {step}, before the checkpoint"
            if b is None:
                return f"{where} no longer begins by step {step}, before the checkpoint"
            was = f"from step {a['from_step']}, {a['path']!r}, seq_length {a['seq_length']}"
            return f"{where} is not the checkpoint's phase {p} ({was}), begun by its step {step}"
    saved_streams = {(s["prefix"], s["seq_length"]): s for s in saved.get("streams", [])}
    now_streams = {(s["prefix"], s["seq_length"]): s for s in current["streams"]}
    for key in sorted(set(saved_streams) | set(now_streams)):
        a, b = saved_streams.get(key, {}), now_streams.get(key, {})
        name = f"{key[0]} at seq_length {key[1]}"
        if a.get("corpus") != b.get("corpus") and a and b:
            return f"the corpus {name} changed since the checkpoint's step {step}"
        if a.get("consumed", 0) != b.get("consumed", 0):
            return (
                f"{name} gave {a.get('consumed', 0)} samples by step {step}, this config gives "
                f"{b.get('consumed', 0)}"
            )
    return None


def _start_steps(
    phases: Sequence[Phase], seq_lengths: list[int], cumulative: np.ndarray, key: str
) -> list[int]:
    """Each phase's first step; `from_tokens` becomes the first step whose first sample
    starts at or after that many tokens (each earlier phase's samples times its length)."""
    steps = len(cumulative) - 1
    out: list[int] = []  # clamped to steps + 1: a phase the run does not reach
    previous = 0  # the previous phase's start as given (a from_step past the run stays)
    for p, phase in enumerate(phases):
        field = "from_step" if phase.from_step is not None else "from_tokens"
        if phase.from_step is not None:
            start = phase.from_step
        elif p == 0:
            start = 1 if phase.from_tokens == 0 else 0
        else:
            start = out[-1]
            if start <= steps:  # the tokens at the previous phase's start, then its rate
                before = _tokens_before(out, seq_lengths, cumulative)
                needed = phase.from_tokens - before  # type: ignore[operator]
                if needed > 0:
                    first = int(cumulative[start - 1]) + -(-needed // seq_lengths[p - 1])
                    start = int(np.searchsorted(cumulative, first, side="left")) + 1
        if p == 0 and start != 1:
            raise HpDataError(
                f"{key}[0].{field}: the first phase starts the run (from_step = 1 or "
                f"from_tokens = 0), got {getattr(phase, field)}"
            )
        unreached = phase.from_tokens is not None and start > steps and previous > steps
        if p and start <= previous and not unreached:
            raise HpDataError(
                f"{key}[{p}].{field}: starts at step {start}, not after {key}[{p - 1}]'s step "
                f"{previous}; list the phases in the order they start"
            )
        previous = max(start, previous)
        out.append(min(start, steps + 1))
    return out


def resolve_starts(
    phases: Sequence[Phase], seq_length: int, cumulative: np.ndarray, key: str = "phases"
) -> list[int]:
    """Each phase's first step (steps + 1 for one the run never reaches) in a run whose step
    s ends after `cumulative[s]` samples, `seq_length` the length of phases without one;
    an HpDataError naming `key[i].FIELD` when they do not start at step 1 and in order."""
    if not phases:
        raise HpDataError(f"{key}: give at least one phase")
    lengths = [phase.seq_length or seq_length for phase in phases]
    return _start_steps(phases, lengths, np.asarray(cumulative, dtype=np.int64), key)


def _tokens_before(starts: list[int], seq_lengths: list[int], cumulative: np.ndarray) -> int:
    """Tokens trained before the last phase in `starts` begins."""
    total = 0
    for p in range(len(starts) - 1):
        total += int(cumulative[starts[p + 1] - 1] - cumulative[starts[p] - 1]) * seq_lengths[p]
    return total


def plan_phases(
    phases: Sequence[Phase],
    config: GPTDatasetConfig,
    cumulative: np.ndarray,
    key: str = "phases",
) -> PhasePlan:
    """The accounting of `phases` over a run whose step s ends after `cumulative[s]` samples
    (int64, [steps + 1]); `config` shapes the samples (its `seq_length` for phases without
    one). Blend indices come from `config.cache_dir`. Messages name fields as `key[i].FIELD`."""
    cumulative = np.asarray(cumulative, dtype=np.int64)
    steps = len(cumulative) - 1
    seq_lengths = [phase.seq_length or config.seq_length for phase in phases]
    start_steps = resolve_starts(phases, config.seq_length, cumulative, key)
    starts = [int(cumulative[s - 1]) for s in start_steps] + [int(cumulative[-1])]
    streams: list[Stream] = []
    numbers: dict[tuple[str, int], int] = {}
    members, weights, index, sample_index, counts, offsets = [], [], [], [], [], []
    reports: list[dict[str, Any]] = []
    position = np.zeros(0, dtype=np.int64)
    for p, phase in enumerate(phases):
        prefixes, shares = phase.blend()
        seq = seq_lengths[p]
        own = []
        for prefix in prefixes:
            if (prefix, seq) not in numbers:
                shaped = replace(config, seq_length=seq)
                try:
                    size = split_epoch_samples(prefix, "train", shaped)
                except (HpDataError, OSError) as exc:
                    raise HpDataError(f"{key}[{p}].path: {exc}") from None
                numbers[(prefix, seq)] = len(streams)
                streams.append(Stream(prefix, seq, size))
                position = np.append(position, 0)
            own.append(numbers[(prefix, seq)])
        size = starts[p + 1] - starts[p]
        if len(own) == 1:
            chosen, ids, given = None, None, np.array([size], dtype=np.int64)
        else:
            chosen, ids, report = _blend(shares, size, config.cache_dir)
            reports.append(report)
            given = blend_counts(chosen, len(own))
        members.append(own)
        weights.append(shares)
        index.append(chosen)
        sample_index.append(ids)
        counts.append(given)
        offsets.append(position[own].copy())
        position[own] += given
    for c, stream in enumerate(streams):
        if position[c] and not stream.epoch_samples:
            p = next(p for p, own in enumerate(members) if c in own)
            raise HpDataError(
                f"{key}[{p}].path: {stream.prefix} has no train sample of {stream.seq_length} "
                "tokens; give a longer corpus or a shorter seq_length"
            )
    return PhasePlan(
        tuple(phases),
        steps,
        cumulative,
        start_steps,
        starts,
        seq_lengths,
        streams,
        members,
        weights,
        index,
        sample_index,
        counts,
        offsets,
        reports,
        StoreOptions.of(config),
    )


def _blend(
    weights: list[float], size: int, cache_dir: str | None
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """megatron-core's blending indices of `size` samples, through the index cache."""
    description = {"weights": weights, "size": size, "dtypes": BLENDING_DTYPES}
    names = ("dataset_index", "dataset_sample_index")
    arrays, report = load_or_build(
        cache_dir,
        description,
        "PhaseBlend",
        "train",
        names,
        lambda: dict(zip(names, build_blending_indices(weights, size), strict=True)),
        lambda arrays: _blend_problem(arrays, size, len(weights)),
    )
    return arrays["dataset_index"], arrays["dataset_sample_index"], report


class PhasedDataset:
    """The train samples of a phased run: `len` is the run's total, item i is its stream
    sample's GPTDataset item plus `dataset_id` (the stream's number). O(log phases) an item
    and no Python object per sample; the epochs the plan reaches are built (or loaded from
    the index cache) here, before the first step."""

    def __init__(self, plan: PhasePlan, config: GPTDatasetConfig) -> None:
        self.plan = plan
        self.config = config
        total = plan.consumed(plan.total_samples)
        self.epochs: list[list[GPTDataset]] = []
        corpora: dict[str, IndexedDataset] = {}
        for stream, demand in zip(plan.streams, total, strict=True):
            count = -(-int(demand) // stream.epoch_samples) if demand else 0
            if stream.prefix not in corpora:  # a URL prefix reads through the node's cache
                corpora[stream.prefix] = IndexedDataset(
                    stream.prefix, store=StoreOptions.of(config)
                )
            self.epochs.append(
                [
                    GPTDataset(
                        corpora[stream.prefix],
                        "train",
                        None,
                        replace(
                            config, seq_length=stream.seq_length, seed=epoch_seed(config.seed, e)
                        ),
                    )
                    for e in range(count)
                ]
            )
        reports = [d.cache_report for epochs in self.epochs for d in epochs] + plan.cache_reports
        self.cache_report = {
            "key": [r["key"] for r in reports],
            "files": [f for r in reports for f in r["files"]],
            "built_seconds": sum(r["built_seconds"] or 0.0 for r in reports) or None,
        }
        self._starts = plan.starts[:-1]
        self._members = plan.members
        self._offsets = [o.tolist() for o in plan.offsets]
        self._sizes = [s.epoch_samples for s in plan.streams]

    def __len__(self) -> int:
        return self.plan.total_samples

    def locate(self, idx: int) -> tuple[int, int, int]:
        """(stream, epoch, row of that epoch's GPTDataset) of global sample `idx`."""
        i = int(idx)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        p = bisect.bisect_right(self._starts, i) - 1
        j = i - self._starts[p]
        index = self.plan.dataset_index[p]
        if index is None:
            member, inner = 0, j
        else:
            member, inner = int(index[j]), int(self.plan.dataset_sample_index[p][j])  # type: ignore[index]
        stream = self._members[p][member]
        epoch, row = divmod(self._offsets[p][member] + inner, self._sizes[stream])
        return stream, epoch, row

    def part_of(self, idx: int) -> tuple[GPTDataset, int]:
        """The GPTDataset (a stream's epoch) sample `idx` is read from, and its row there."""
        stream, epoch, row = self.locate(idx)
        return self.epochs[stream][epoch], row

    def __getitem__(self, idx: int) -> dict[str, Any]:
        stream, epoch, row = self.locate(idx)
        return {"dataset_id": stream, **self.epochs[stream][epoch][row]}

    def state_at(self, step: int, samples: int) -> dict[str, Any]:
        return self.plan.state_at(step, samples)

    def chunks_for(self, sample_ids: Sequence[int]) -> list[tuple[Any, int]]:
        """The remote chunks samples `sample_ids` read, in order, each once (`ReadAhead`)."""
        streams, positions = self.plan.locate(sample_ids)
        return distinct(
            pair
            for stream, position in zip(streams.tolist(), positions.tolist(), strict=True)
            for pair in self._epoch_row(stream, position)
        )

    def _epoch_row(self, stream: int, position: int) -> list[tuple[Any, int]]:
        epoch, row = divmod(position, self._sizes[stream])
        return self.epochs[stream][epoch].chunks_for([row])


def build_phased(
    phases: Sequence[Phase],
    config: GPTDatasetConfig,
    cumulative: np.ndarray,
    key: str = "phases",
) -> PhasedDataset:
    """The train split of a phased run (see `plan_phases`)."""
    return PhasedDataset(plan_phases(phases, config, cumulative, key), config)
