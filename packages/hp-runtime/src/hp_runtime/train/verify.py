"""`hp-train verify`: a config's parallel layout checked against one process before GPU hours.

The job is launched as the real run will be (torchrun, the same world size), but trains a model
shrunk to a few layers and a small width — the same head counts, experts and vocabulary, so
that every dimension shards as it will — for a few steps, in fp32, on the config's own data
cut to short sequences. Rank 0 meanwhile trains the same shrunk model on one process (a plain
`hp-train` subprocess) on the same samples. Both save a checkpoint at every step; the largest
relative differences of loss, gradient norm and parameters are printed per step, and the job
exits 1 when one is above the tolerance: a layout that trains a different model (an
unsynchronised tied weight, a wrong TP reduction as in torchtitan#1750) is caught here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Any, TextIO

import torch.distributed as dist

from hp_runtime.train.config import Config, load_config, toml_value
from hp_runtime.train.dirlock import hold_run_dir
from hp_runtime.train.errors import TrainError
from hp_runtime.train.launch import Runtime, fresh_directory

HEAD_WIDTH = 8  # the shrunk model's head_dim: rotary needs an even width
SHORT_SEQUENCE = 128  # tokens a sample; rounded to what cp and tp need
TOLERANCE = 1e-4  # relative; one-process parity tests hold layouts within 1e-5 in fp32
# torchrun's variables: the one-process reference must not join the job's rendezvous.
LAUNCHER_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE",
)  # fmt: skip


def shrink(config: Config) -> list[str]:
    """Overrides that shrink `config`'s model and run to a few fp32 steps of the same layout:
    head counts, experts and vocabulary kept (each divides as before), widths cut to
    `HEAD_WIDTH` a head, a layer a pipeline stage (at least two, and one past MoE's leading
    dense layers), sequences cut to `SHORT_SEQUENCE`."""
    m, p = config.model, config.parallel
    dim = m.n_heads * HEAD_WIDTH
    layers = max(2, p.pp * p.pp_virtual_stages, (m.moe.first_dense_layers + 1) if m.moe else 0)
    multiple = math.lcm(2 * p.cp, p.tp)  # context-parallel load balancing halves; SP splits
    seq = max(multiple, SHORT_SEQUENCE // multiple * multiple)
    seq = min(seq, config.data.seq_length) if config.data.seq_length % multiple == 0 else seq
    out = [
        f"model.dim={dim}",
        "model.head_dim=none",
        f"model.ffn_hidden={2 * dim}",
        f"model.n_layers={layers}",
        f"model.max_seq_len={max(seq, m.max_seq_len)}",
        f"data.seq_length={seq}",
        "train.mixed_precision=fp32",
        "train.eval_interval=0",
        "train.spike_action=off",
        "train.time_limit=0",
        "checkpoint.interval=1",
        "checkpoint.keep=0",
        "checkpoint.resume=none",
        "checkpoint.dir=none",  # each run's own, under its run directory
        "checkpoint.local_copy=false",
        "checkpoint.async=false",
        "metrics.log_interval=1",
        "metrics.tensorboard=false",
        "metrics.plot=false",
        "eval.tasks=[]",  # the shrunk model's answers would mean nothing
    ]
    if m.moe is not None:  # a table is set whole
        out.append(f"model.moe={toml_value(replace(m.moe, expert_ffn_hidden=dim))}")
    return out


def one_process(global_batch: int, device: str) -> list[str]:
    """Overrides that put the same run on one process of `device`'s type: every degree 1, the
    same global batch (so the same samples, a step each); replica groups' all in it."""
    return [
        *(f"parallel.{k}=1" for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")),
        "parallel.fault_tolerance=none",
        "parallel.pp_microbatches=none",
        "parallel.pp_virtual_stages=1",
        f"train.global_batch_size={global_batch}",
        f"train.device={device}",
    ]


@dataclass
class StepDifference:
    step: int
    loss: float
    reference_loss: float
    loss_error: float
    grad_norm_error: float
    param_error: float
    worst_param: str


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def param_error(layout: str, reference: str) -> tuple[float, str]:
    """The largest ||a - b|| / ||b|| over the two checkpoints' tensors, and its tensor."""
    from hp_runtime.train.hf import read_model

    _, mine = read_model(layout)
    _, theirs = read_model(reference)
    worst, name = 0.0, ""
    for key, tensor in theirs.items():
        error = float((mine[key] - tensor).norm() / tensor.norm().clamp_min(1e-12))
        if error > worst:
            worst, name = error, key
    return worst, name


def _records(run_dir: str) -> dict[int, dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as log:
        lines = [json.loads(line) for line in log]
    return {r["step"]: r for r in lines if r.get("kind") == "train"}


def compare(layout_dir: str, reference_dir: str, steps: int) -> list[StepDifference]:
    """Per step, the layout run against the one-process run: loss, gradient norm, parameters."""
    from hp_runtime.train.checkpoint_format import step_name

    mine, theirs = _records(layout_dir), _records(reference_dir)
    out = []
    for step in range(1, steps + 1):
        if step not in mine or step not in theirs:
            raise TrainError(f"verify: step {step} is missing from a run's metrics.jsonl")
        a, b = mine[step], theirs[step]
        params, worst = param_error(
            os.path.join(layout_dir, "checkpoints", step_name(step)),
            os.path.join(reference_dir, "checkpoints", step_name(step)),
        )
        out.append(
            StepDifference(
                step,
                a["loss"],
                b["loss"],
                relative(a["loss"], b["loss"]),
                relative(a["grad_norm"], b["grad_norm"]),
                params,
                worst,
            )
        )
    return out


def verify(
    config_path: str | None,
    overrides: list[str],
    runtime: Runtime,
    steps: int = 3,
    tolerance: float = TOLERANCE,
    keep: bool = False,
    stream: TextIO | None = None,
) -> bool:
    """Run the shrunk layout on every rank and its one-process twin on rank 0; print the
    differences on rank 0; True (on every rank) when all are within `tolerance`."""
    from hp_runtime.train.batch import batch_plan
    from hp_runtime.train.loop import train

    stream = stream or sys.stdout
    overrides = [*overrides, f"train.steps={steps}"]  # the run's own length is not verify's
    config = load_config(config_path, overrides)
    with hold_run_dir(config.train.run_dir, runtime, stream):  # a live run there: refused
        work = fresh_directory(config.train.run_dir, "verify-", runtime)
        shrunk = [*overrides, *shrink(config)]
        layout_config = load_config(config_path, [*shrunk, f"train.run_dir={work}/layout"])
        reference_dir = os.path.join(work, "one-process")
        reference = None
        if runtime.is_main:
            gbs = batch_plan(layout_config).global_batch_size
            command = [sys.executable, "-m", "hp_runtime.train"]
            command += ["--config", config_path] if config_path else []
            command += [
                *shrunk,
                *one_process(gbs, runtime.device.type),
                f"train.run_dir={reference_dir}",
            ]
            env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
            log = open(os.path.join(work, "one-process.log"), "w")  # noqa: SIM115 (kept to the end)
            reference = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            with open(os.devnull, "w") as quiet:
                train(layout_config, runtime, stream=quiet)
            # [verdict, error]: rank 0's judgement reaches every rank, a failure too (a rank 0
            # that raised alone would leave its peers in this broadcast while it waits in the
            # barrier below)
            outcome: list[Any] = [True, None]
            if runtime.is_main:
                assert reference is not None
                try:
                    outcome[0] = _judge(
                        reference, work, reference_dir, steps, tolerance, config, stream
                    )
                except TrainError as exc:
                    outcome[1] = str(exc)
            if runtime.world_size > 1:
                dist.broadcast_object_list(outcome, src=0)
            if outcome[1] is not None:
                failure = TrainError(outcome[1])
                failure.everywhere = True  # rank 0 alone reports it
                raise failure
            return bool(outcome[0])
        finally:
            if reference is not None and reference.poll() is None:
                reference.kill()
                reference.wait()
            if runtime.world_size > 1:
                dist.barrier()
            if runtime.is_main and not keep:
                shutil.rmtree(work, ignore_errors=True)  # made by this run, under a fresh name


def _judge(
    reference: subprocess.Popen,
    work: str,
    reference_dir: str,
    steps: int,
    tolerance: float,
    config: Config,
    stream: TextIO,
) -> bool:
    """Rank 0: wait for the one-process twin (no longer than its peers wait for rank 0),
    compare and report; whether every difference is within `tolerance`."""
    limit = config.train.collective_timeout_s
    try:
        code = reference.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        raise TrainError(
            f"verify: the one-process run did not finish in {limit:g} s "
            "(train.collective_timeout_s); rerun with a larger one"
        ) from None
    if code != 0:
        with open(os.path.join(work, "one-process.log")) as log:
            tail = log.read().strip().splitlines()[-1:] or ["no output"]
        raise TrainError(f"verify: the one-process run failed: {tail[0]}")
    differences = compare(f"{work}/layout", reference_dir, steps)
    return report(differences, tolerance, config, stream)


def report(
    differences: list[StepDifference], tolerance: float, config: Config, stream: TextIO
) -> bool:
    """The table and the verdict line; whether every difference is within `tolerance`."""
    p = config.parallel
    layout = " x ".join(
        f"{name} {getattr(p, name)}"
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
        if getattr(p, name) > 1
    )
    print(f"hp-train verify: {layout or 'one process'} against one process", file=stream)
    print("step | loss (layout) | loss (one process) | rel. loss | rel. grad norm | "
          "rel. params (worst tensor)", file=stream)  # fmt: skip
    worst = 0.0
    for d in differences:
        worst = max(worst, d.loss_error, d.grad_norm_error, d.param_error)
        print(
            f"{d.step:4d} | {d.loss:.6f} | {d.reference_loss:.6f} | {d.loss_error:.2e} | "
            f"{d.grad_norm_error:.2e} | {d.param_error:.2e} ({d.worst_param or '-'})",
            file=stream,
        )
    ok = worst <= tolerance
    verdict = "the layout trains the same model" if ok else "the layout DIFFERS from one process"
    print(
        f"hp-train verify: {verdict}: largest relative difference {worst:.2e} "
        f"(tolerance {tolerance:g})",
        file=stream,
    )
    return ok
