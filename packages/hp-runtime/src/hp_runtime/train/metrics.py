"""What a run reports: a log line on rank 0, `RUN_DIR/metrics.jsonl`, TensorBoard when it is
installed, and the MFU against the device's dense bf16 peak.

Values come off the device one step late (`LaggedValues`), so reading them never stalls the GPU;
a logged step, a validation or a checkpoint reads its own step at once. A MoE model's figures
(the auxiliary loss, the expert load) stay on the device until a logged step reads them.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from statistics import fmean
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
from hp_data.fs import write_text
from hp_data.progress import clock, human

if TYPE_CHECKING:
    from hp_runtime.train.batch import BatchPlan

# Dense bf16 tensor-core peaks (TFLOP/s per device) from the vendors' data sheets; the first
# name contained in torch.cuda.get_device_name() wins, so specific names come first.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("MI300X", 1307.4),
    ("MI325X", 1307.4),
    ("MI250X", 383.0),
]


def peak_for_name(name: str) -> float | None:
    """The table's peak for a device name, None when it is not in the table."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The device's peak, `override` first; None for a device not in the table (CPU too):
    an unknown peak gives no MFU rather than a made-up one."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def mfu(tokens_per_s_per_device: float, flops_per_token: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak, per device."""
    if peak is None:
        return None
    return tokens_per_s_per_device * flops_per_token / (peak * 1e12)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def continue_log(run_dir: str, step: int, fresh: bool) -> str | None:
    """Make `RUN_DIR/metrics.jsonl` end at `step` (the step a run resumes from): records of
    later steps, written before the run was stopped or killed, would come again. A fresh or a
    seeded run never inherits another run's records: an existing log is moved aside to
    `metrics.jsonl.N` (its path is returned), never emptied."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    if fresh:
        if os.path.getsize(path) == 0:
            return None
        number = 1
        while os.path.exists(f"{path}.{number}"):
            number += 1
        os.rename(path, f"{path}.{number}")
        return f"{path}.{number}"
    kept = []
    with open(path, encoding="utf-8") as stream:
        for line in stream:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    write_text(path, "".join(kept))
    return None


class LaggedValues:
    """Device scalars of each step copied to the host without waiting; `push` returns the
    previous step's (long finished by then), `flush` the latest at once."""

    def __init__(self) -> None:
        self._pending: tuple[int, torch.Tensor, Any] | None = None

    def push(self, step: int, values: torch.Tensor) -> tuple[int, list[float]] | None:
        previous = self._pending
        host = values.detach().to("cpu", non_blocking=True)
        event = None
        if values.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = (step, host, event)
        return self._read(previous)

    def flush(self) -> tuple[int, list[float]] | None:
        previous, self._pending = self._pending, None
        return self._read(previous)

    @staticmethod
    def _read(entry: tuple[int, torch.Tensor, Any] | None) -> tuple[int, list[float]] | None:
        if entry is None:
            return None
        step, host, event = entry
        if event is not None:
            event.synchronize()
        return step, host.tolist()


def gather_ranks(values: list[float], device: torch.device) -> np.ndarray:
    """float64 [world, len(values)]: every rank's `values`, row r from rank r (one small
    all-gather into one tensor: no tensor per rank, at 1,000 ranks either; a collective)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    rows = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(rows, mine)
    return rows.view(-1, len(values)).cpu().numpy()


class StepClock:
    """This rank's own step times over a log interval, for the straggler figures: the host's
    clock and, on CUDA, the stream's time between two events, the larger of the two per step
    (as Megatron's straggler detector takes them). The events are read at log time, when the
    logged values have synchronised the device anyway: no step waits for them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start = 0.0
        self._event: Any = None
        self._steps: list[tuple[float, Any, Any]] = []  # (host seconds, start, end event)

    def start(self) -> None:
        self._start = time.perf_counter()
        if self.cuda:
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()

    def stop(self) -> float:
        """The step's host seconds (the watchdog's and the time limit's clock)."""
        seconds = time.perf_counter() - self._start
        end = None
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self._steps.append((seconds, self._event, end))
        return seconds

    def take(self) -> float:
        """The mean step seconds since the last take (0 when no step ran), and a new interval."""
        steps, self._steps = self._steps, []
        if not steps:
            return 0.0
        total = 0.0
        for seconds, start, end in steps:
            if end is not None:
                end.synchronize()
                seconds = max(seconds, start.elapsed_time(end) / 1000)
            total += seconds
        return total / len(steps)


def moe_fields(figures: list[list[float]], aux_loss: bool) -> dict[str, Any]:
    """A train record's MoE fields from a step's figures (`Stepper.train_step`: one row a MoE
    layer, [mean auxiliary loss, max / mean tokens per expert, tokens routed]); none for a
    dense model. The auxiliary loss only where it is the balancing (`aux_loss`)."""
    if not figures:
        return {}
    ratios = [row[1] for row in figures]
    fields: dict[str, Any] = {}
    if aux_loss:
        fields["moe_aux_loss"] = fmean(row[0] for row in figures)
    fields["moe_load_max_over_mean"] = ratios
    fields["moe_load_max_over_mean_worst"] = max(ratios)
    return fields


@dataclass(frozen=True)
class Throughput:
    plan: BatchPlan  # each step's own global batch: a ramp's first steps are smaller
    seq_length: int
    world_size: int
    flops_per_token: int
    peak_tflops: float | None
    # float64 [steps + 1, 2]: tokens and model FLOPs trained by the end of each step, where
    # steps differ in length (`[[data.phases]]` of another seq_length); None: all alike.
    cumulative: np.ndarray | None = None

    def between(self, first: int, last: int) -> tuple[float, float]:
        """Tokens, and FLOPs per token, of steps first+1..last, each at its own batch and
        length."""
        if self.cumulative is None:
            samples = self.plan.samples_after(last) - self.plan.samples_after(first)
            return float(samples * self.seq_length), self.flops_per_token
        tokens, flops = self.cumulative[last] - self.cumulative[first]
        return float(tokens), float(flops / tokens) if tokens else self.flops_per_token


class MetricsLog:
    """Rank 0's log line, JSONL records and TensorBoard scalars. Other ranks hold one too and
    take part in the collectives, but write nothing."""

    def __init__(
        self,
        run_dir: str,
        is_main: bool,
        device: torch.device,
        steps: int,
        throughput: Throughput,
        tensorboard: bool,
        stream: TextIO | None = None,
        started: float | None = None,
        moe_layers: tuple[int, ...] = (),
        moe_aux_loss: bool = False,
        wandb: Any = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.is_main, self.device, self.steps = is_main, device, steps
        self.throughput = throughput
        self.moe_layers, self.moe_aux_loss = moe_layers, moe_aux_loss  # the figures' rows
        self.stream = stream or sys.stdout
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8") if is_main else None  # noqa: SIM115
        self._writer = self._tensorboard(run_dir) if is_main and tensorboard else None
        self._wandb = self._wandb_log(wandb, run_dir, settings or {}) if is_main and wandb else None
        self._mark_time = time.perf_counter()
        self._mark_step = 0
        self._started = started if started is not None else self._mark_time  # elapsed_s from it

    def _tensorboard(self, run_dir: str) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.say(
                "metrics: tensorboard is not installed, so no event files are written "
                "(pip install 'hp-runtime[tensorboard]')"
            )
            return None
        return SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def _wandb_log(self, config: Any, run_dir: str, settings: dict[str, Any]) -> Any:
        """`metrics.wandb`'s log (`WandbConfig`), or None with a notice when wandb is missing."""
        try:
            from hp_runtime.train.wandb_log import WandbLog

            return WandbLog(config, run_dir, settings)
        except ImportError:
            self.say(
                "metrics: wandb is not installed, so metrics.wandb logs nothing "
                "(pip install 'hp-runtime[wandb]')"
            )
            return None

    def say(self, line: str) -> None:
        if self.is_main:
            print(line, file=self.stream, flush=True)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._wandb is not None:
            self._wandb.log(record)

    def mark(self, step: int) -> None:
        """Start a new interval at `step` (after a resume, a validation or a checkpoint, whose
        time is not training time)."""
        self._mark_time, self._mark_step = time.perf_counter(), step

    def train(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        consumed_samples: int,
        data_wait_s: float,
        step_s: float = 0.0,
        skipped: bool = False,
        moe: list[list[float]] | None = None,
        mtp: list[float] | None = None,
    ) -> dict[str, Any]:
        """Log `step` (a collective: every rank calls it at the same steps); `step_s`: this
        rank's mean step time over the interval (`StepClock`); `moe`: the step's MoE
        figures, one row per layer of `moe_layers`; `mtp`: each multi-token prediction
        module's mean loss (`loss` is then the main loss alone: the step trained on it plus
        `model.mtp.loss_weight` times their mean)."""
        now = time.perf_counter()
        elapsed = max(now - self._mark_time, 1e-9)
        t = self.throughput
        tokens, flops_per_token = t.between(self._mark_step, step)
        tokens_per_s = tokens / elapsed
        per_device = tokens_per_s / t.world_size
        ranks = gather_ranks(
            [100.0 * data_wait_s / elapsed, peak_memory_gib(self.device), step_s], self.device
        )
        waits, memories, step_times = ranks.T
        slowest, fastest = int(np.argmax(step_times)), int(np.argmin(step_times))
        wait_pct, memory = float(waits.max()), float(memories.max())
        eta = t.between(step, self.steps)[0] / max(tokens_per_s, 1e-9)  # at this interval's rate
        record = {
            "kind": "train",
            "step": step,
            "steps": self.steps,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "consumed_samples": consumed_samples,
            "global_batch_size": t.plan.global_batch_at(step),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "mfu": mfu(per_device, flops_per_token, t.peak_tflops),
            "peak_memory_gib": memory,
            "data_wait_pct": wait_pct,
            "data_wait_slowest_rank": int(np.argmax(waits)),
            "step_time_slowest_s": float(step_times[slowest]),
            "step_time_fastest_s": float(step_times[fastest]),
            "step_time_slowest_rank": slowest,
            "elapsed_s": now - self._started,
            "eta_s": eta,
            "skipped": skipped,
            **moe_fields(moe or [], self.moe_aux_loss),
            **({"mtp_loss": fmean(mtp), "mtp_losses": mtp} if mtp else {}),
        }
        self.write(record)
        logged = ("loss", "grad_norm", "lr", "tokens_per_s", "mtp_loss")
        self._scalars(step, {k: record[k] for k in logged if k in record})
        self._moe_scalars(step, record)
        width = len(str(self.steps))
        mfu_text = f"{record['mfu']:.1%}" if record["mfu"] is not None else "n/a"
        self.say(
            f"step {step:>{width}}/{self.steps} | loss {loss:.4f} | grad {grad_norm:.3f} | "
            f"lr {lr:.3e} | {human(tokens_per_s)} tok/s ({human(per_device)}/dev) | "
            f"mfu {mfu_text} | mem {memory:.2f} GiB | data {wait_pct:.1f}% | "
            f"eta {clock(eta)}"
            + (self._ranks_text(record) if t.world_size > 1 else "")
            + (f" | batch {record['global_batch_size']}" if step < t.plan.full_from else "")
            + self._moe_text(record)
            + (f" | mtp {record['mtp_loss']:.4f}" if "mtp_loss" in record else "")
            + (" | skipped" if skipped else "")
        )
        self.mark(step)
        return record

    def validation(self, step: int, val_loss: float) -> None:
        ppl = math.exp(val_loss) if val_loss < 700 else math.inf
        self.write({"kind": "validation", "step": step, "val_loss": val_loss, "val_ppl": ppl})
        self._scalars(step, {"val_loss": val_loss, "val_ppl": ppl})
        self.say(f"validation at step {step} | loss {val_loss:.4f} | perplexity {ppl:.2f}")

    def downstream(self, step: int, values: dict[str, float], seconds: float) -> None:
        """`[eval]`'s results: a `downstream` record of `eval/TASK/METRIC` values."""
        self.write({"kind": "downstream", "step": step, **values, "eval_s": seconds})
        self._scalars(step, values)
        shown = " | ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in values.items())
        self.say(f"downstream at step {step} | {shown} | {seconds:.1f} s")

    @staticmethod
    def _ranks_text(record: dict[str, Any]) -> str:
        """The log line's straggler part: the fastest and slowest rank's step time."""
        return (
            f" | ranks {record['step_time_fastest_s']:.2f}-{record['step_time_slowest_s']:.2f}"
            f" s/step, slowest {record['step_time_slowest_rank']}"
        )

    @staticmethod
    def _moe_text(record: dict[str, Any]) -> str:
        """The log line's MoE part: the auxiliary loss and the worst layer's load ratio."""
        if "moe_load_max_over_mean_worst" not in record:
            return ""
        aux = f"aux {record['moe_aux_loss']:.4f} " if "moe_aux_loss" in record else ""
        return f" | moe {aux}load {record['moe_load_max_over_mean_worst']:.2f}x"

    def _moe_scalars(self, step: int, record: dict[str, Any]) -> None:
        """TensorBoard's MoE scalars: those of the record, and each layer's ratio under the
        layer's index in the model."""
        values = {
            k: record[k] for k in ("moe_aux_loss", "moe_load_max_over_mean_worst") if k in record
        }
        ratios = record.get("moe_load_max_over_mean", [])
        for layer, ratio in zip(self.moe_layers, ratios, strict=True):
            values[f"moe_load_max_over_mean/layer_{layer}"] = ratio
        self._scalars(step, values)

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()
