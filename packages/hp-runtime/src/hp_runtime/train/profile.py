"""Profiler traces and memory snapshots of chosen steps, one file per rank.

`metrics.profile_steps = [first, count]` records steps first..first+count-1 with
`torch.profiler` (CPU, and CUDA kernels on a GPU) and writes a Chrome trace per rank to
`RUN_DIR/profiles/rank-R-steps-A-B.json` (open it in Perfetto or chrome://tracing);
`metrics.profile_every = N` records the same window again every N steps. On CUDA,
`metrics.memory_snapshot = true` records every allocation from the start
(`torch.cuda.memory._record_memory_history`) and dumps the history beside each trace, and once
more when the run runs out of memory (`rank-R-oom.pickle`; open it at pytorch.org/memory_viz).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hp_runtime.train.config import MetricsConfig

HISTORY = 100_000  # allocations the CUDA memory history keeps


class StepProfiler:
    """`before(step)` at each step's start, `after(step)` at its end; idle when nothing is
    asked (two integer comparisons a step)."""

    def __init__(self, metrics: MetricsConfig, run_dir: str, rank: int, device: torch.device):
        self.window, self.every = metrics.profile_steps, metrics.profile_every
        self.directory = os.path.join(run_dir, "profiles")
        self.rank, self.device = rank, device
        self.snapshots = metrics.memory_snapshot and device.type == "cuda"
        self._profile: Any = None
        self._first = 0
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY)

    def _window_start(self, step: int) -> bool:
        if self.window is None:
            return False
        first, _ = self.window
        if self.every:
            return step >= first and (step - first) % self.every == 0
        return step == first

    def before(self, step: int) -> None:
        if self._profile is None and self._window_start(step):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profile.start()
            self._first = step

    def after(self, step: int) -> None:
        if self._profile is None or step < self._first + self.window[1] - 1:  # type: ignore[index]
            return
        self.finish(step)

    def finish(self, step: int) -> None:
        """The trace of the window so far (the run ended or stopped inside it)."""
        if self._profile is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels are in the trace
        self._profile.stop()
        os.makedirs(self.directory, exist_ok=True)
        name = f"rank-{self.rank}-steps-{self._first}-{step}"
        self._profile.export_chrome_trace(os.path.join(self.directory, f"{name}.json"))
        self._profile = None
        if self.snapshots:
            self.snapshot(f"{name}.pickle")

    def snapshot(self, name: str) -> None:
        if self.snapshots:
            os.makedirs(self.directory, exist_ok=True)
            torch.cuda.memory._dump_snapshot(os.path.join(self.directory, name))

    def out_of_memory(self) -> None:
        """Called as an out-of-memory error leaves the loop: where the memory went."""
        self.snapshot(f"rank-{self.rank}-oom.pickle")
