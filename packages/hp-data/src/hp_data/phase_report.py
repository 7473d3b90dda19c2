"""The mixture report of a phased run: what each phase's datasets were planned to give
and what they gave (`mix_report`, the run's mix-report.json), and its table (`report_table`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hp_data.phases import PhasePlan
from hp_data.redact import redact


def _nth(index: np.ndarray, member: int, n: int) -> int:
    """The position of the n-th (from 0) entry equal to `member` in `index`, by chunks."""
    seen = 0
    for first in range(0, len(index), 1 << 20):
        hits = np.flatnonzero(index[first : first + (1 << 20)] == member)
        if seen + len(hits) > n:
            return first + int(hits[n - seen])
        seen += len(hits)
    raise ValueError("fewer entries than asked")


def _step_of(plan: PhasePlan, sample: int) -> int:
    """The step that trains global sample `sample`."""
    return int(np.searchsorted(plan.cumulative, sample, side="right"))


def mix_report(plan: PhasePlan) -> dict[str, Any]:
    """Per phase and stream: samples, tokens, epochs touched, repeats (samples past the
    stream's first epoch); per stream, the step at which it enters each epoch after the
    first. The JSON of `hp-train mix-report --json` (fields in docs/training.md)."""
    phases = _phase_entries(plan)
    streams = _stream_entries(plan)
    tokens = sum(phase["tokens"] for phase in phases)
    return {
        "steps": plan.steps,
        "samples": plan.total_samples,
        "tokens": tokens,
        "phases": phases,
        "streams": streams,
    }


def _phase_entries(plan: PhasePlan) -> list[dict[str, Any]]:
    """The report's `phases`: each phase's steps, samples and tokens, and its streams' shares."""
    phases = []
    for p, members in enumerate(plan.members):
        rows = []
        for m, c in enumerate(members):
            stream, first = plan.streams[c], int(plan.offsets[p][m])
            count = int(plan.counts[p][m])
            size = stream.epoch_samples
            rows.append(
                {
                    "stream": c,
                    "prefix": redact(stream.prefix),
                    "seq_length": stream.seq_length,
                    "weight": plan.weights[p][m],
                    "samples": count,
                    "tokens": count * stream.seq_length,
                    "first_sample": first,
                    "epochs": list(range(first // size, (first + count - 1) // size + 1))
                    if count
                    else [],
                    "repeats": max(0, first + count - max(first, size)),
                }
            )
        samples = plan.starts[p + 1] - plan.starts[p]
        phases.append(
            {
                "phase": p,
                "path": redact(plan.phases[p].path),
                "from_step": plan.start_steps[p],
                "to_step": (
                    plan.start_steps[p + 1] - 1 if p + 1 < len(plan.phases) else plan.steps
                ),
                "seq_length": plan.seq_lengths[p],
                "first_sample": plan.starts[p],
                "samples": samples,
                "tokens": samples * plan.seq_lengths[p],
                "streams": rows,
            }
        )
    return phases


def _stream_entries(plan: PhasePlan) -> list[dict[str, Any]]:
    """The report's `streams`: each stream's demand over the run, and where it wraps."""
    total = plan.consumed(plan.total_samples)
    streams = []
    for c, stream in enumerate(plan.streams):
        size, demand = stream.epoch_samples, int(total[c])
        wraps = []
        for epoch in range(1, -(-demand // size) if demand else 0):
            target = epoch * size  # the stream sample that opens `epoch`
            p, m = next(
                (p, m)
                for p, members in enumerate(plan.members)
                for m, s in enumerate(members)
                if s == c and plan.offsets[p][m] <= target < plan.offsets[p][m] + plan.counts[p][m]
            )
            local = target - int(plan.offsets[p][m])
            index = plan.dataset_index[p]
            j = local if index is None else _nth(index, m, local)
            sample = plan.starts[p] + j
            wraps.append(
                {"epoch": epoch, "phase": p, "step": _step_of(plan, sample), "sample": sample}
            )
        streams.append(
            {
                "stream": c,
                "prefix": redact(stream.prefix),
                "seq_length": stream.seq_length,
                "epoch_samples": size,
                "samples": demand,
                "tokens": demand * stream.seq_length,
                "epochs": -(-demand // size) if demand else 0,
                "repeats": max(0, demand - size),
                "wraps": wraps,
            }
        )
    return streams


def report_table(report: dict[str, Any]) -> str:
    """`mix_report` as the text `hp-train mix-report` prints."""
    lines = [
        f"{report['steps']} steps, {report['samples']:,} samples, {report['tokens']:,} tokens",
        "",
        f"{'phase':>5} {'steps':>15} {'stream':>6} {'weight':>7} {'samples':>12} "
        f"{'tokens':>14} {'epochs':>7} {'repeats':>9}  corpus",
    ]
    for phase in report["phases"]:
        span = f"{phase['from_step']}-{phase['to_step']}"
        for row in phase["streams"]:
            epochs = ",".join(map(str, row["epochs"])) or "-"
            lines.append(
                f"{phase['phase']:>5} {span:>15} {row['stream']:>6} {row['weight']:>7.3f} "
                f"{row['samples']:>12,} {row['tokens']:>14,} {epochs:>7} {row['repeats']:>9,}  "
                f"{row['prefix']} (seq {row['seq_length']})"
            )
    lines += [
        "",
        f"{'stream':>6} {'epoch':>12} {'samples':>12} {'epochs':>7} {'repeats':>9}  wraps",
    ]
    for s in report["streams"]:
        wraps = ", ".join(f"epoch {w['epoch']} at step {w['step']}" for w in s["wraps"]) or "none"
        lines.append(
            f"{s['stream']:>6} {s['epoch_samples']:>12,} {s['samples']:>12,} {s['epochs']:>7} "
            f"{s['repeats']:>9,}  {wraps}  ({s['prefix']}, seq {s['seq_length']})"
        )
    return "\n".join(lines)
