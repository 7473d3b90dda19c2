"""Data-mixture phases: what the accounting costs, and items against a plain blend.

    uv run python tools/bench/bench_phases.py [--documents 200000] [--samples 4000000]

1. `plan`: `plan_phases` of three phases (a 3-way blend, a single corpus at twice the
   length, a 2-way blend reading the first corpus again) over `--samples` samples, cold (the
   blend indices built and cached) and warm (loaded from the cache); the bytes of the plan's
   arrays per sample; `mix_report` over it; `state_at` (what a checkpoint records) at the last
   step.
2. `items`: 20,000 random items at L=1024 of one phase (the 3-way blend, within one epoch)
   from `PhasedDataset` against today's `build_split` (BlendableDataset): items/s, and that
   they are the same samples.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from hp_data import IndexedDatasetBuilder
from hp_data.blend import build_split
from hp_data.gpt import GPTDatasetConfig
from hp_data.phase_report import mix_report
from hp_data.phases import Phase, build_phased, plan_phases


def corpus(prefix: str, documents: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 2000, documents)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for length in lengths:
            builder.add_document(rng.integers(0, 65535, int(length), dtype=np.uint16), [length])
    return prefix


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=4_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        a, b, c = (corpus(f"{root}/{n}", args.documents, k) for k, n in enumerate("abc"))
        config = GPTDatasetConfig(seq_length=1024, split="1,0,0", cache_dir=f"{root}/cache")
        batch = 256
        steps = args.samples // batch
        cumulative = np.arange(steps + 1, dtype=np.int64) * batch
        phases = [
            Phase(from_step=1, path=f"0.5 {a} 0.3 {b} 0.2 {c}"),
            Phase(from_step=steps // 2, path=b, seq_length=2048),
            Phase(from_step=3 * steps // 4, path=f"0.7 {a} 0.3 {c}"),
        ]
        for label in ("cold", "warm"):
            start = time.perf_counter()
            plan = plan_phases(phases, config, cumulative)
            print(f"plan {label}: {time.perf_counter() - start:.2f} s for {steps:,} steps")
        arrays = [x for x in plan.dataset_index + plan.dataset_sample_index if x is not None]
        per_sample = sum(x.nbytes for x in arrays) / plan.total_samples
        print(f"plan arrays: {per_sample:.1f} bytes a sample ({plan.total_samples:,} samples)")
        start = time.perf_counter()
        report = mix_report(plan)
        print(f"mix_report: {time.perf_counter() - start:.2f} s; {len(report['streams'])} streams")
        start = time.perf_counter()
        plan.state_at(steps, plan.total_samples)
        print(f"state_at (first, corpus hashes included): {time.perf_counter() - start:.3f} s")
        start = time.perf_counter()
        plan.state_at(steps - 1, plan.total_samples - batch)
        print(f"state_at (later): {time.perf_counter() - start:.3f} s")

        one = [phases[0]]
        size = 150_000
        small = np.arange(size // batch + 1, dtype=np.int64) * batch
        phased = build_phased(one, config, small)
        plain = build_split(one[0].path, config, "train", len(phased))
        picks = np.random.default_rng(0).integers(0, len(phased), 20_000)
        for name, dataset in (("PhasedDataset", phased), ("BlendableDataset", plain)):
            dataset[int(picks[0])]
            start = time.perf_counter()
            for i in picks:
                dataset[int(i)]
            seconds = time.perf_counter() - start
            print(f"items {name}: {len(picks) / seconds:,.0f} items/s")
        same = all(
            np.array_equal(phased[int(i)]["tokens"], plain[int(i)]["tokens"]) for i in picks[:2000]
        )
        print(f"same samples (2,000 checked): {same}")
        print(f"corpus: {sum(Path(p + '.bin').stat().st_size for p in (a, b, c)) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
