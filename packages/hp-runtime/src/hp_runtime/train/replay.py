"""`hp-train replay RUN_DIR --step N`: the steps up to N again, from the checkpoint before N,
on any layout, beside what the run logged.

The run's own `config.toml` is loaded with the overrides (typically a smaller layout: one
process, fewer ranks) and trained into a fresh `RUN_DIR/replay-*` directory, seeded from the
newest committed checkpoint before step N (or from the start, whose initialisation is a
function of the seed alone). Nothing of the run is written to: its checkpoints are read, its
log is read; the replay holds the run directory meanwhile (`dirlock`), so that a replay and a
live run there exclude each other. The learning rate keeps the run's `train.steps`, so each
replayed step is the step the run took: bit-identical on the same layout, within 1e-5 in fp32
on another.
`--dump DIR` writes step N's per-sample losses and per-parameter gradient norms.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch.distributed as dist
from hp_data.fs import write_json
from hp_data.remote import local_path
from torch.distributed.tensor import DTensor

from hp_runtime.parallel.parallelize import canonical_name
from hp_runtime.train import checkpoint_remote as remote
from hp_runtime.train.checkpoint_format import CHECKPOINTS, CheckpointError, committed, read_meta
from hp_runtime.train.checkpoint_remote import is_remote
from hp_runtime.train.config import load_config
from hp_runtime.train.dirlock import hold_run_dir
from hp_runtime.train.errors import TrainError
from hp_runtime.train.launch import Runtime, fresh_directory
from hp_runtime.train.loader import Batch


@dataclass
class ReplayedStep:
    step: int
    loss: float
    grad_norm: float
    logged_loss: float | None  # None: the run did not log that step
    logged_grad_norm: float | None


def starting_point(root: str, step: int) -> str | None:
    """The newest committed checkpoint of the run's checkpoint directory or URL `root` before
    `step`; None: the run's start."""
    if is_remote(root):
        steps = {}
        for url in remote.steps(root):
            try:
                listing = remote.read_commit(url)
            except CheckpointError as exc:
                if not exc.fallback:  # the store unreachable: no silent older start
                    raise
                continue  # a damaged one is not a starting point
            if listing is not None:
                steps[url] = listing.step
    else:
        steps = {path: _step(path) for path in committed(local_path(root))}
    before = [path for path, at in steps.items() if at < step]
    return before[-1] if before else None


def _step(checkpoint: str) -> int:
    try:
        return int(read_meta(checkpoint)["step"])
    except TrainError:  # a damaged one is not a starting point
        return 1 << 62


def logged(run_dir: str) -> dict[int, dict[str, Any]]:
    """The run's train records by step (the last of each: a resumed run logs a step once)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    out: dict[int, dict[str, Any]] = {}
    if os.path.exists(path):
        with open(path) as log:
            for line in log:
                try:
                    record = json.loads(line)
                except ValueError:  # a line a kill cut short
                    continue
                if record.get("kind") == "train":
                    out[record["step"]] = record
    return out


class Dump:
    """Step N's per-sample losses and per-parameter gradient norms, gathered to rank 0 and
    written to `DIR/step-N.json` (new: an existing file is refused before the replay)."""

    def __init__(self, directory: str, step: int) -> None:
        self.path = os.path.join(directory, f"step-{step:07d}.json")
        self.step = step
        self.out: dict[str, Any] = {}

    def check(self) -> None:
        if os.path.lexists(self.path):
            raise TrainError(
                f"--dump: {self.path} exists; choose another directory or move it aside"
            )

    def __call__(self, step: int, micro: list[Batch], loop: Any) -> None:
        if step != self.step:
            return
        run = loop.run
        sums, counts = run.stepper.sample_losses(micro)
        plan, first = run.plan, loop.state.consumed_samples  # before this step's advance
        wide = plan.micro_batch_size * plan.dp_size
        rank = run.assembly.dp_rank
        ids = [
            first + m * wide + rank * plan.micro_batch_size + i
            for m in range(len(micro))
            for i in range(plan.micro_batch_size)
        ]
        mine = list(zip(ids, sums.tolist(), counts.tolist(), strict=True))
        gathered = [mine]
        if dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        samples = sorted({row[0]: row for part in gathered for row in part}.values())
        norms = {}
        for module in run.assembly.modules:
            for name, param in module.named_parameters():
                grad = param.grad
                if grad is None:
                    continue
                if isinstance(grad, DTensor):  # a collective: every rank, the same order
                    grad = grad.full_tensor()
                norms[canonical_name(name)] = float(grad.double().norm())
        self.out = {
            "step": step,
            "samples": [
                {"index": i, "loss": s / max(c, 1.0), "loss_sum": s, "loss_tokens": int(c)}
                for i, s, c in samples
            ],
            "grad_norms": norms,
        }
        if loop.runtime.is_main:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            write_json(self.path, self.out, indent=1)


def replay(
    run_dir: str,
    step: int,
    overrides: list[str],
    runtime: Runtime,
    dump: str | None = None,
    keep: bool = False,
    stream: TextIO | None = None,
) -> list[ReplayedStep]:
    """Replay the run in `run_dir` up to `step` on the layout `overrides` give; print each
    replayed step beside the logged one (rank 0) and return them (every rank)."""
    from hp_runtime.train.loop import Loop
    from hp_runtime.train.setup import setup

    stream = stream or sys.stdout
    config_path = os.path.join(run_dir, "config.toml")
    if not os.path.isfile(config_path):
        raise TrainError(f"{run_dir}: no config.toml here: give a hp-train run directory")
    base = load_config(config_path, overrides)
    if not 1 <= step <= base.train.steps:
        raise TrainError(f"--step {step}: the run trains steps 1 to {base.train.steps}")
    dumper = Dump(dump, step) if dump else None
    if dumper is not None:
        dumper.check()
        p = base.parallel
        if p.pp > 1 or p.cp > 1:
            raise TrainError("--dump needs pp = 1 and cp = 1 (whole samples): replay with them")
    start = starting_point(base.checkpoint.dir or os.path.join(run_dir, CHECKPOINTS), step)
    with hold_run_dir(run_dir, runtime, stream):  # a live run there, or another replay: refused
        work = fresh_directory(run_dir, "replay-", runtime)
        try:
            config = load_config(
                config_path,
                [
                    *overrides,
                    f"train.run_dir={work}",
                    f"checkpoint.resume={start or 'none'}",
                    "checkpoint.dir=none",  # the replay's own, under its run directory
                    "checkpoint.interval=0",
                    "metrics.log_interval=1",
                    "metrics.plot=false",
                    "metrics.tensorboard=false",
                    "eval.tasks=[]",  # steps and losses only: no downstream tasks
                ],
            )
            started = time.perf_counter()
            with open(os.devnull, "w") as quiet:
                run = setup(config, runtime, quiet, started)
                loop = Loop(config, runtime, run, started)
                if dumper is not None:
                    loop.on_gradients = lambda s, micro: dumper(s, micro, loop)
                result = loop.train(last=step)
            seen = logged(run_dir)
            out = [
                ReplayedStep(
                    s,
                    result.losses[s],
                    result.grad_norms[s],
                    seen.get(s, {}).get("loss"),
                    seen.get(s, {}).get("grad_norm"),
                )
                for s in sorted(result.losses)
            ]
            if runtime.is_main:
                _print(out, start, dumper, stream)
            return out
        finally:
            if runtime.world_size > 1:
                dist.barrier()
            if runtime.is_main and not keep:
                shutil.rmtree(work, ignore_errors=True)  # made by this replay, under a fresh name


def _print(
    steps: list[ReplayedStep], start: str | None, dumper: Dump | None, stream: TextIO
) -> None:
    origin = os.path.basename(start) if start else "the run's start"
    print(f"hp-train replay: from {origin}", file=stream)
    print("step | loss | logged loss | grad norm | logged grad norm", file=stream)
    for s in steps:
        loss = "-" if s.logged_loss is None else f"{s.logged_loss:.6f}"
        norm = "-" if s.logged_grad_norm is None else f"{s.logged_grad_norm:.6f}"
        print(f"{s.step:4d} | {s.loss:.6f} | {loss} | {s.grad_norm:.6f} | {norm}", file=stream)
    if dumper is not None:
        print(f"hp-train replay: step {dumper.step}'s samples and gradients in {dumper.path}",
              file=stream)  # fmt: skip
