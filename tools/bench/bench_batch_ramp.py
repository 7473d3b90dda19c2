"""`train.batch_ramp`: what the per-step batch plan costs, against megatron-core's calculator.

For each ramp (Megatron's GPT-3 175B ramp, and a worst case: a batch of 1 growing by 1 to 4096
over a billion samples), in one process:

- build: the seconds to build hp's `BatchPlan` (one column per batch size) and its size;
- per step: `global_batch_at` + `accumulation_at` (what the loop asks each step), in
  microseconds, against megatron-core's `update` + `get` for the same step;
- the whole run's cumulative samples (`cumulative_samples`, one array) for `--steps` steps,
  against Megatron's loop over its steps (counted to the end of the ramp only, for time).

    uv run python tools/bench/bench_batch_ramp.py [--steps 10000000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hp_runtime.train.batch import BatchPlan
from hp_runtime.train.config import BatchRamp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.helpers
from tests.helpers.megatron import ramp_calculator

RAMPS = {  # name: (start, increment, samples), global batch, data-parallel size
    "gpt3-175b": ((16, 16, 5_859_375), 1536, 16),
    "worst": ((1, 1, 1_000_000_000), 4096, 1),
}


def measure(name: str, steps: int) -> dict[str, float]:
    (start, increment, samples), gbs, dp = RAMPS[name]
    began = time.perf_counter()
    plan = BatchPlan(1, gbs, dp, ramp=BatchRamp(start, increment, samples))
    build = time.perf_counter() - began
    ramp_steps = plan.full_from - 1
    probe = min(ramp_steps, 200_000)
    began = time.perf_counter()
    for step in range(1, probe + 1):
        plan.global_batch_at(step)
        plan.accumulation_at(step)
    per_step = (time.perf_counter() - began) / probe
    calculator = ramp_calculator()(gbs, 1, dp, False, 0, start, increment, samples)
    consumed = 0
    began = time.perf_counter()
    for _ in range(ramp_steps):
        calculator.update(consumed, consistency_check=True)
        calculator.get()
        consumed += calculator.get_current_global_batch_size()
    megatron_ramp = time.perf_counter() - began
    began = time.perf_counter()
    cumulative = plan.cumulative_samples(max(steps, ramp_steps))
    whole = time.perf_counter() - began
    assert int(cumulative[ramp_steps]) == consumed  # the same samples at the ramp's end
    return {
        "ramp steps": ramp_steps,
        "levels": len(plan.levels),
        "build ms": build * 1e3,
        "per step us": per_step * 1e6,
        "megatron per step us": megatron_ramp / ramp_steps * 1e6,
        "cumulative s": whole,
        "megatron ramp loop s": megatron_ramp,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000_000)
    args = parser.parse_args()
    for name in RAMPS:
        row = measure(name, args.steps)
        print(
            name,
            " | ".join(
                f"{k} {v:,}" if isinstance(v, int) else f"{k} {v:,.3f}" for k, v in row.items()
            ),
        )


if __name__ == "__main__":
    main()
