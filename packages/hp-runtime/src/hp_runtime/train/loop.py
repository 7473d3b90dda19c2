"""The training loop: data, step, clip, update, log, validate, save — top to bottom.

`setup` (setup.py) builds the rank's share of the model, the data and the optimizer and
resumes from a checkpoint; `train` runs the steps. All state a resume needs is in `TrainState`.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import torch
from hp_data.redact import redact

from hp_runtime.train.batch import BatchPlan
from hp_runtime.train.config import Config
from hp_runtime.train.errors import TrainError
from hp_runtime.train.guard import SpikeStop, blame_command, check_finite
from hp_runtime.train.launch import Runtime, StopSignals
from hp_runtime.train.loader import Batch, Loader
from hp_runtime.train.metrics import LaggedValues, StepClock
from hp_runtime.train.plot import plot_run
from hp_runtime.train.profile import StepProfiler
from hp_runtime.train.setup import Run, setup
from hp_runtime.train.step import Stepper
from hp_runtime.train.watchdog import Watchdog


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


@dataclass(frozen=True)
class StopRequest:
    """A rank's reasons to stop after this step. It rides in the step's loss all-reduce (no
    collective of its own) as one float, each reason its own power of two, so that the sum
    over the ranks still says the weightiest reason any rank gave."""

    signal: bool = False  # SIGTERM or SIGINT on this rank
    time_limit: bool = False  # rank 0's clock only
    save_failed: bool = False  # this rank's background save failed

    _SIGNAL, _TIME_LIMIT, _SAVE_FAILED = 1.0, float(2**20), float(2**21)  # below 2**20 ranks

    def encode(self) -> float:
        return (
            self._SIGNAL * self.signal
            + self._TIME_LIMIT * self.time_limit
            + self._SAVE_FAILED * self.save_failed
        )

    @classmethod
    def decode(cls, total: float) -> StopRequest | None:
        """The job's request from the sum of every rank's `encode()`: its weightiest reason
        only (a float32 sum may round the lighter ones off)."""
        if total >= cls._SAVE_FAILED:
            return cls(save_failed=True)
        if total >= cls._TIME_LIMIT:
            return cls(time_limit=True)
        return cls(signal=True) if total > 0 else None

    def describe(self, signal_name: str | None) -> str:
        """The reason as the log says it (`signal_name`: this rank's, if it got one)."""
        if self.save_failed:  # every rank stops; `Checkpointer.finish` raises the failure
            return "a failed checkpoint save"
        if self.time_limit:
            return "train.time_limit"
        return signal_name or "signal"


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
    started = time.perf_counter()
    run = run or setup(config, runtime, stream or sys.stdout, started)
    return Loop(config, runtime, run, started).train()


class Loop:
    """One rank's run: each `step` → `maybe_log` → `maybe_eval` → `maybe_downstream` →
    `maybe_checkpoint`, then
    `finish` and the `end` record. A step's values reach the host one step late
    (`LaggedValues`); a step that logs, validates or saves reads its own at once."""

    def __init__(self, config: Config, runtime: Runtime, run: Run, started: float) -> None:
        self.config, self.t, self.runtime, self.run = config, config.train, runtime, run
        self.state, self.metrics, self.loader = run.state, run.metrics, run.loader
        self.started = started
        self.result = RunResult(self.t.steps, resumed_from=run.resumed_from)
        self.lagged = LaggedValues()
        self.skipped_since_log: set[int] = set()
        self.step_times: deque[float] = deque(maxlen=5)  # the time limit's margin
        self.clock = StepClock(runtime.device)  # this rank's step times, for the stragglers
        self.signals = StopSignals()
        self.moe = torch.zeros(0, 3)  # the last step's MoE figures, on the device until logged
        # Called with (step, micro-batches) once a step's gradients are reduced, before they
        # are clipped (and a pipeline's tied copies summed): `hp-train replay --dump`.
        self.on_gradients: Callable[[int, list[Batch]], None] | None = None
        self.profiler = StepProfiler(config.metrics, self.t.run_dir, runtime.rank, runtime.device)
        self.watchdog = Watchdog(
            self.t.run_dir, runtime.rank, runtime.world_size, self.t.hang_timeout_s
        )

    def train(self, last: int | None = None) -> RunResult:
        """Steps up to `last` (default: train.steps; `hp-train replay` stops earlier); the
        run directory is let go at the end, whatever ends the run (its lock: `dirlock`)."""
        try:
            return self._train(last)
        finally:
            self.run.held.release()

    def _train(self, last: int | None) -> RunResult:
        self.metrics.mark(self.state.step)
        self.watchdog.start()
        try:
            self.join_replicas()
            with self.signals:
                for step in range(self.state.step + 1, (last or self.t.steps) + 1):
                    lr = self.step(step)
                    done = self.maybe_log(step, lr)  # each one that ran is not training time
                    done |= self.maybe_eval(step)
                    done |= self.maybe_downstream(step)
                    done |= self.maybe_checkpoint(step)
                    if done:
                        self.mark(step)
                    if self.result.stopped_by:
                        break
                self.finish()
            self.end()
        except TrainError as exc:
            self.metrics.write(
                {"kind": "end", "status": "failed", "step": self.state.step, "reason": str(exc)}
            )
            raise
        except torch.OutOfMemoryError:
            self.profiler.out_of_memory()
            raise
        finally:
            self.profiler.finish(self.state.step)
            self.watchdog.stop()
            for loader in (self.loader, self.run.valid_loader):
                if loader is not None:
                    loader.close()
            if self.run.replicas is not None:
                self.run.replicas.close()
            self.metrics.close()
        self.plot()
        return self.result

    def step(self, step: int) -> float:
        """Train one global batch and update (unless the spike guard skips it); its lr."""
        run, state, plan = self.run, self.state, self.run.plan
        self.clock.start()
        self.watchdog.beat(step, "data")
        self.profiler.before(step)
        lr = state.optimizer.set_lr(step, self.t.steps)
        count = plan.accumulation_at(step)
        micro = self.loader.take(count) if self.loader is not None else []
        self.watchdog.beat(step, "forward-backward")
        request = StopRequest(
            signal=self.signals.received is not None,
            time_limit=self.near_time_limit(),
            save_failed=run.checkpointer.save_failed(),
        )
        loss, stop = self.forward_backward(step, micro, count, request.encode())
        self.watchdog.beat(step, "update")
        if self.on_gradients is not None:
            self.on_gradients(step, micro)
        norm = run.assembly.finish_gradients(self.t.max_norm)
        values = torch.stack([loss, norm.float(), stop])
        if state.guard.enabled and self.guard(step, values):
            self.skipped_since_log.add(step)
        else:
            state.optimizer.step()
            run.assembly.weights_changed()
            run.stepper.balance.update_bias()  # a skipped step moves no bias either
        state.optimizer.zero_grad(set_to_none=True)
        state.advance()
        self.settle(self.lagged.push(step, values))
        run.checkpointer.poll()
        self.log_commits()
        self.step_times.append(self.clock.stop())
        self.watchdog.step_done(self.step_times[-1])
        self.profiler.after(step)
        return lr

    def forward_backward(
        self, step: int, micro: list[Batch], count: int, request: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's loss, stop request and gradients; with replica groups, averaged over the
        groups of its quorum, the step trained again until one commits (`train/replicas.py`)."""
        run, replicas = self.run, self.run.replicas
        while True:
            loss, stop, self.moe = run.stepper.train_step(micro, count, request)
            if replicas is None:
                return loss, stop
            averaged = replicas.average(loss, self.state.modules)
            if averaged is not None:
                break
            self.state.optimizer.zero_grad(set_to_none=True)
        first = self.state.consumed_samples
        plan = run.plan
        record = replicas.account(step, first, count, plan.micro_batch_size, plan.dp_size)
        if record is not None:
            self.metrics.write(record)
        return averaged, stop

    def join_replicas(self) -> None:
        """With replica groups: the first quorum; a group that healed from a peer reads its
        samples from the peer's step on."""
        replicas = self.run.replicas
        if replicas is None or not replicas.join():
            return
        self.run.assembly.weights_changed()
        if self.loader is not None:
            self.loader.restart(self.state.consumed_samples)
        self.metrics.say(
            f"hp-train: replica group {replicas.ft.replica_group} healed from a peer at step "
            f"{self.state.step}"
        )
        self.metrics.write({"kind": "healed", "step": self.state.step})

    def guard(self, step: int, values: torch.Tensor) -> bool:
        """The spike guard's verdict on this step, before its update (one device sync); True
        to skip the update."""
        loss, norm, _ = values.tolist()
        state = self.state
        check_finite(step, loss, norm, state.samples_of(step), self.t.run_dir)
        reason = state.guard.judge(loss, norm)
        if reason is None:
            return False
        first, end = state.samples_of(step)
        message = (
            f"step {step}: {reason} (samples {first} to {end - 1}: "
            f"{blame_command(self.t.run_dir, step)})"
        )
        if state.guard.action == "stop":
            raise SpikeStop(message + "; stopping (train.spike_action = 'stop')")
        self.metrics.say(message + "; update skipped")
        self.metrics.write(
            {"kind": "skip", "step": step, "reason": reason, "samples": [first, end]}
        )
        self.result.skipped.append(step)
        return True

    def maybe_log(self, step: int, lr: float) -> bool:
        """The train record at log steps, the last and a stop; whether it wrote one."""
        interval = self.config.metrics.log_interval
        if not (step % interval == 0 or step == self.t.steps or self.result.stopped_by):
            return False
        self.settle_all()
        self.metrics.train(
            step,
            self.result.losses[step],
            self.result.grad_norms[step],
            lr,
            self.state.consumed_samples,
            self.loader.waited if self.loader is not None else 0.0,
            self.clock.take(),
            skipped=step in self.skipped_since_log,
            moe=self.moe.tolist(),  # a logged step reads its values at once (a host sync)
            mtp=self.run.stepper.mtp_loss.tolist() if self.run.stepper.mtp_depth else None,
        )
        self.skipped_since_log.clear()
        return True

    def maybe_eval(self, step: int) -> bool:
        """Validate at eval steps and the last; whether it did."""
        t = self.t
        if not (t.eval_interval and (step % t.eval_interval == 0 or step == t.steps)):
            return False
        self.settle_all()
        run = self.run
        self.result.val_losses[step] = evaluate(
            run.stepper, run.valid_loader, run.plan, t.eval_iters
        )
        self.metrics.validation(step, self.result.val_losses[step])
        return True

    def maybe_downstream(self, step: int) -> bool:
        """`[eval]`'s tasks at its steps and the last; whether they ran."""
        downstream, interval = self.run.downstream, self.config.eval.interval
        if downstream is None or not (step % interval == 0 or step == self.t.steps):
            return False
        if self.result.stopped_by:  # a stop asked for: the save first, the tasks not at all
            return False
        self.settle_all()
        started = time.perf_counter()
        values = downstream()
        self.metrics.downstream(step, values, time.perf_counter() - started)
        return True

    def maybe_checkpoint(self, step: int) -> bool:
        """Save at checkpoint steps, the last and a stop (blocking then); whether it did."""
        interval, checkpointer = self.config.checkpoint.interval, self.run.checkpointer
        if not (
            (interval and (step % interval == 0 or step == self.t.steps)) or self.result.stopped_by
        ):
            return False
        replicas, ending = self.run.replicas, step == self.t.steps or self.result.stopped_by
        if replicas is not None and not ending and not replicas.saves():
            return False  # a periodic save is one group's: the lowest in the step's quorum
        self.settle_all()
        block = bool(self.result.stopped_by) or not self.config.checkpoint.async_save
        checkpointer.save(self.state, self.run.meta, block=block)
        self.log_commits()
        if checkpointer.pending is not None:
            self.metrics.say(
                f"hp-train: checkpoint of step {step}: writing in the background "
                f"({checkpointer.last_save_seconds:.2f} s to stage it)"
            )
        return True

    def finish(self) -> None:
        """The last step's values, and the save in flight committed (every rank together)."""
        self.settle_all()
        self.run.checkpointer.finish()
        self.log_commits()

    def end(self) -> None:
        """The end record and the closing line."""
        state, result, metrics, t = self.state, self.result, self.metrics, self.t
        result.seconds = time.perf_counter() - self.started
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
        if self.run.resumed_from is not None and not result.losses:  # resumed at the end
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

    def plot(self) -> None:
        if self.config.metrics.plot and self.runtime.is_main:
            try:
                self.metrics.say(f"hp-train: curves in {plot_run(self.t.run_dir)}")
            except TrainError as exc:  # matplotlib missing: a notice, not a failure
                self.metrics.say(f"hp-train: no plot: {exc}")

    def settle(self, entry: tuple[int, list[float]] | None) -> None:
        """A step's values have reached the host: check them, keep them, note a stop."""
        if entry is None:
            return
        step, (loss, norm, stop) = entry
        check_finite(step, loss, norm, self.state.samples_of(step), self.t.run_dir)
        self.result.losses[step], self.result.grad_norms[step] = loss, norm
        request = StopRequest.decode(stop)
        if request is not None and self.result.stopped_by is None:
            self.result.stopped_by = request.describe(self.signals.received)

    def settle_all(self) -> None:
        """The latest step's values at once (a logged, validated or saved step needs them)."""
        self.settle(self.lagged.flush())

    def mark(self, step: int) -> None:
        """Time from here on is training time again."""
        self.metrics.mark(step)
        if self.loader is not None:
            self.loader.waited = 0.0

    def log_commits(self) -> None:
        """Log checkpoints once they are committed (never one still being written)."""
        for saved in self.run.checkpointer.take():
            path = redact(saved.path)  # a URL dir's credentials, where it has any
            self.metrics.write(
                {
                    "kind": "checkpoint",
                    "step": saved.step,
                    "path": path,
                    "seconds": saved.seconds,
                    "blocked_s": saved.blocked,
                    "async": saved.background,
                }
            )
            self.metrics.say(
                f"hp-train: checkpoint of step {saved.step}: {path} ({saved.seconds:.2f} s)"
            )
            if saved.warning is not None:
                self.metrics.say(f"hp-train: warning: {saved.warning}")

    def near_time_limit(self) -> bool:
        """Rank 0's clock: stop when two more steps and a save would pass the limit."""
        t, times = self.t, self.step_times
        if not t.time_limit or not self.runtime.is_main or not times:
            return False
        margin = 2 * max(times) + self.run.checkpointer.last_save_seconds
        return time.perf_counter() - self.started + margin >= t.time_limit
