"""A checkpoint of a `data.path` run resumed with `[[data.phases]]` whose first phase reads that
path: the same samples (docs/datasets.md: a single phase within one epoch is exactly
`build_split`'s samples), so the checkpoint's record is read as the phased run's and the
ordinary resume checks go on from there. Where the samples would not be the same, the
refusal says why in one line, instead of the bare "data.path changed" (issue 40)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hp_data.blend import SURPLUS, normalize, parse_blend, sizes_per_dataset
from hp_data.errors import HpDataError
from hp_data.format.header import prefix_of
from hp_data.phases import PhasedDataset, PhasePlan
from hp_data.redact import redact
from hp_data.registry import same_samples

from hp_runtime.train.batch import BatchPlan
from hp_runtime.train.checkpoint_format import CheckpointError
from hp_runtime.train.compat import saved_section
from hp_runtime.train.config import BatchRamp, Config


def _meaning(spec: str) -> tuple[list[str], list[float]]:
    """A blend's prefixes (as `redact` prints them) and normalised weights (one prefix: 1)."""
    prefixes, weights = parse_blend(spec)
    return [redact(prefix_of(p)) for p in prefixes], normalize(weights or [1.0])


def _saved_demand(meta: dict[str, Any], plan: BatchPlan) -> int:
    """The train samples the checkpoint's run built: its `train.steps` under its own ramp."""
    train = saved_section(meta, "train")
    ramp = train.get("batch_ramp")
    before = replace(plan, ramp=None if ramp is None else BatchRamp(**ramp))
    return before.samples_after(int(train.get("steps", meta["step"])))


def _past_an_epoch(meta: dict[str, Any], plan: BatchPlan, phases: PhasePlan) -> str | None:
    """Why the `data.path` run's samples are not the phase's: a corpus it built past one
    epoch (a multi-epoch GPTDataset shuffles its epochs together; a phase reads each epoch
    on its own). None when every corpus stayed within its first epoch."""
    demand = _saved_demand(meta, plan)
    weights = parse_blend(meta["data"]["config"]["path"])[1]
    counts = [demand] if weights is None else sizes_per_dataset(normalize(weights), demand, SURPLUS)
    for stream, count in zip(phases.streams, counts, strict=True):
        if count > stream.epoch_samples:
            return (
                f"the checkpoint's run built {count} samples of {redact(stream.prefix)}, past "
                f"its one epoch of {stream.epoch_samples}, and a phase shuffles each epoch on "
                "its own, so its samples are not that run's"
            )
    return None


def _difference(meta: dict[str, Any], config: Config, plan: BatchPlan, datasets: Any) -> str | None:
    """Why the first phase does not continue the checkpoint's `data.path` samples (None: it
    does). Ranks that read no data check what the config says; the readers check the rest."""
    d, first, step = config.data, config.data.phases[0], meta["step"]
    if _meaning(first.path) != _meaning(meta["data"]["config"]["path"]):
        return "it reads other corpora or weights"
    if first.seq_length not in (None, d.seq_length):
        return f"it reads at seq_length {first.seq_length}, data.seq_length is {d.seq_length}"
    train = datasets.train
    if not isinstance(train, PhasedDataset):
        return None
    phases = train.plan
    if len(phases.start_steps) > 1 and phases.start_steps[1] <= step:
        return f"data.phases[1] begins by the checkpoint's step {step}"
    try:
        corpora = [phases.fingerprint(s.prefix) for s in phases.streams]
    except (HpDataError, OSError) as exc:
        return f"its corpora cannot be read ({exc})"
    identity = {**datasets.identity, "train": {**datasets.identity["train"], "corpora": corpora}}
    if len(corpora) > 1 or "weights" in meta["data"]["fingerprint"].get("train", {}):
        identity["train"]["weights"] = phases.weights[0]
    if not same_samples(meta["data"]["fingerprint"], identity):
        return "the corpus files behind it changed"
    return _past_an_epoch(meta, plan, phases)


def as_phased(
    meta: dict[str, Any], path: str, config: Config, plan: BatchPlan, datasets: Any
) -> dict[str, Any]:
    """`meta` (of the checkpoint at `path`) as the phased run would have written it, where it
    is a `data.path` run and this config's first phase trains the same samples; `meta` itself
    where that is not the question. A first phase that does not is refused in one line
    (unless `checkpoint.allow_data_change`, whose warning the ordinary check then gives)."""
    saved = meta["data"]["config"]
    if not config.data.phases or "mixture" in meta or saved.get("path") is None:
        return meta
    why = _difference(meta, config, plan, datasets)
    if why is not None:
        if config.checkpoint.allow_data_change:
            return meta
        raise CheckpointError(
            f"data.phases[0] (path {redact(config.data.phases[0].path)!r}) does not continue "
            f"data.path {saved['path']!r} of {path}: {why}; keep data.path = "
            f"{saved['path']!r} to resume, or set checkpoint.allow_data_change = true",
            fallback=False,
        )
    return {**meta, "data": {"config": {**saved, "path": None}, "fingerprint": datasets.identity}}
