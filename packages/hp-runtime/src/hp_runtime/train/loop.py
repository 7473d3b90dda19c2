"""The training loop: data, step, clip, update, log, validate, save — top to bottom.

`setup` (setup.py) builds the rank's share of the model, the data and the optimizer and
resumes from a checkpoint; `train` runs the steps. All state a resume needs is in `TrainState`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import torch

from hp_runtime.train.config import Config
from hp_runtime.train.data import BatchPlan, Loader
from hp_runtime.train.guard import SpikeStop, check_finite
from hp_runtime.train.launch import Runtime, StopSignals, TrainError
from hp_runtime.train.metrics import LaggedValues, MetricsLog
from hp_runtime.train.plot import plot_run
from hp_runtime.train.schedule import lr_at
from hp_runtime.train.setup import Run, setup
from hp_runtime.train.state import TrainState
from hp_runtime.train.step import Stepper

TIME_LIMIT_FLAG = float(2**20)  # the clock adds this to the stop flag; a signal adds 1 a rank
SAVE_FAILED_FLAG = float(2**21)  # a rank whose background save failed adds this


@dataclass
class RunResult:
    """What a finished run reports back (every rank holds the same values)."""

    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)
    resumed_from: str | None = None
    stopped_by: str | None = None  # a signal's name, or "time_limit"
    seconds: float = 0.0


def evaluate(stepper: Stepper, loader: Loader | None, plan: BatchPlan, iters: int) -> float:
    """Mean loss over the same first `iters` global batches of the validation set."""
    if loader is not None:
        loader.restart(0)
    sums = torch.zeros(2, device=stepper.device)
    for _ in range(iters):
        micro = loader.take(plan.accumulation) if loader is not None else []
        sums += stepper.eval_sums(micro, plan.accumulation)
    return float(stepper.eval_loss(sums))


def train(
    config: Config, runtime: Runtime, stream: TextIO | None = None, run: Run | None = None
) -> RunResult:
    """Run `config` on this rank (set up by `setup` unless `run` is given); every rank of the
    job calls it."""
    t, stream = config.train, stream or sys.stdout
    started = time.perf_counter()
    run = run or setup(config, runtime, stream, started)
    state, plan, stepper, loader, metrics = (
        run.state,
        run.plan,
        run.stepper,
        run.loader,
        run.metrics,
    )
    result = RunResult(t.steps, resumed_from=run.resumed_from)
    lagged = LaggedValues()
    skipped_since_log: set[int] = set()
    step_times: list[float] = []

    def settle(entry: tuple[int, list[float]] | None) -> None:
        """A step's values have reached the host: check them, keep them, note a stop."""
        if entry is None:
            return
        step, (loss, norm, stop) = entry
        check_finite(step, loss, norm, state.samples_of(step))
        result.losses[step], result.grad_norms[step] = loss, norm
        if stop > 0 and result.stopped_by is None:
            if stop >= SAVE_FAILED_FLAG:  # every rank stops here; `wait` raises the failure
                result.stopped_by = "a failed checkpoint save"
            elif stop >= TIME_LIMIT_FLAG:
                result.stopped_by = "train.time_limit"
            else:
                result.stopped_by = signals.received or "signal"

    def log_commits() -> None:
        """Log checkpoints once they are committed (never one still being written)."""
        for saved in run.checkpointer.take():
            metrics.write(
                {
                    "kind": "checkpoint",
                    "step": saved.step,
                    "path": saved.path,
                    "seconds": saved.seconds,
                    "async": saved.background,
                }
            )
            metrics.say(
                f"hp-train: checkpoint of step {saved.step}: {saved.path} ({saved.seconds:.2f} s)"
            )

    def near_time_limit() -> bool:
        """Rank 0's clock: stop when two more steps and a save would pass the limit."""
        if not t.time_limit or not runtime.is_main or not step_times:
            return False
        margin = 2 * max(step_times[-5:]) + run.checkpointer.last_save_seconds
        return time.perf_counter() - started + margin >= t.time_limit

    metrics.mark(state.step)
    try:
        with StopSignals() as signals:
            for step in range(state.step + 1, t.steps + 1):
                step_start = time.perf_counter()
                lr = lr_at(step, config.optim, t.steps)
                for group in state.optimizer.param_groups:
                    group["lr"] = lr
                micro = loader.take(plan.accumulation) if loader is not None else []
                stop_flag = float(signals.received is not None)
                stop_flag += TIME_LIMIT_FLAG if near_time_limit() else 0.0
                stop_flag += SAVE_FAILED_FLAG if run.checkpointer.save_failed() else 0.0
                loss, stop = stepper.train_step(micro, plan.accumulation, stop_flag)
                norm = run.assembly.finish_gradients(t.max_norm)
                values = torch.stack([loss, norm.float(), stop])
                skip = state.guard.enabled and guard_step(step, values, state, metrics, result)
                if not skip:
                    state.optimizer.step()
                else:
                    skipped_since_log.add(step)
                state.optimizer.zero_grad(set_to_none=True)
                state.advance()
                settle(lagged.push(step, values))
                run.checkpointer.poll()
                log_commits()
                step_times.append(time.perf_counter() - step_start)

                last = step == t.steps
                boundary = False  # time spent outside steps is not training time
                if step % config.metrics.log_interval == 0 or last or result.stopped_by:
                    settle(lagged.flush())
                    metrics.train(
                        step,
                        result.losses[step],
                        result.grad_norms[step],
                        lr,
                        state.consumed_samples,
                        loader.waited if loader is not None else 0.0,
                        skipped=step in skipped_since_log,
                    )
                    skipped_since_log.clear()
                    boundary = True
                if t.eval_interval and (step % t.eval_interval == 0 or last):
                    settle(lagged.flush())
                    result.val_losses[step] = evaluate(
                        stepper, run.valid_loader, plan, t.eval_iters
                    )
                    metrics.validation(step, result.val_losses[step])
                    boundary = True
                interval = config.checkpoint.interval
                if (interval and (step % interval == 0 or last)) or result.stopped_by:
                    settle(lagged.flush())
                    block = bool(result.stopped_by) or not config.checkpoint.async_save
                    run.checkpointer.save(state, run.meta, block=block)
                    log_commits()
                    if run.checkpointer.pending is not None:
                        metrics.say(
                            f"hp-train: checkpoint of step {step}: writing in the background "
                            f"({run.checkpointer.last_save_seconds:.2f} s to stage it)"
                        )
                    boundary = True
                if boundary:
                    metrics.mark(step)
                    if loader is not None:
                        loader.waited = 0.0
                if result.stopped_by:
                    break
            settle(lagged.flush())
            run.checkpointer.finish()
            log_commits()
        result.seconds = time.perf_counter() - started
        status = "completed" if result.stopped_by is None else f"stopped by {result.stopped_by}"
        metrics.write(
            {
                "kind": "end",
                "status": status,
                "step": state.step,
                "consumed_samples": state.consumed_samples,
                "final_loss": result.losses.get(state.step),
                "elapsed_s": result.seconds,
            }
        )
        if run.resumed_from is not None and not result.losses:  # resumed at the end
            metrics.say(
                f"hp-train: nothing to do: the run is at step {state.step} of train.steps "
                f"{t.steps}; raise train.steps to train further"
            )
        else:
            metrics.say(
                f"hp-train: {status}: {state.step} steps in {result.seconds:.1f} s; loss "
                f"{result.losses.get(state.step, float('nan')):.4f}; metrics in {metrics.path}"
                + ("" if result.stopped_by is None else "; run the same command to resume")
            )
    except TrainError as exc:
        metrics.write({"kind": "end", "status": "failed", "step": state.step, "reason": str(exc)})
        raise
    finally:
        metrics.close()
    if config.metrics.plot and runtime.is_main:
        try:
            metrics.say(f"hp-train: curves in {plot_run(t.run_dir)}")
        except TrainError as exc:  # matplotlib missing: a notice, not a failure
            metrics.say(f"hp-train: no plot: {exc}")
    return result


def guard_step(
    step: int, values: torch.Tensor, state: TrainState, metrics: MetricsLog, result: RunResult
) -> bool:
    """The spike guard's verdict on this step, before its update (one device sync); True
    to skip the update."""
    loss, norm, _ = values.tolist()
    check_finite(step, loss, norm, state.samples_of(step))
    reason = state.guard.judge(loss, norm)
    if reason is None:
        return False
    first, end = state.samples_of(step)
    message = f"step {step}: {reason} (samples {first} to {end - 1})"
    if state.guard.action == "stop":
        raise SpikeStop(message + "; stopping (train.spike_action = 'stop')")
    metrics.say(message + "; update skipped")
    metrics.write({"kind": "skip", "step": step, "reason": reason, "samples": [first, end]})
    result.skipped.append(step)
    return True
