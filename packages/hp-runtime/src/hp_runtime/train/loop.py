"""The training run: set-up, then the loop — data, step, clip, update, log, validate.

Read top to bottom: `train` builds the rank's share of the model, the data and the optimizer,
then runs the steps. All state a resume needs is in `TrainState`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import torch

from hp_runtime.parallel import Assembly, ParallelDims, ParallelOptions, assemble
from hp_runtime.train.config import Config, ConfigError, to_toml
from hp_runtime.train.data import (
    BatchPlan,
    Loader,
    batch_plan,
    build_datasets,
    default_workers,
    pp_microbatches,
)
from hp_runtime.train.guard import SpikeGuard, check_finite
from hp_runtime.train.launch import Runtime, TrainError, agree
from hp_runtime.train.metrics import LaggedValues, MetricsLog, Throughput, peak_tflops
from hp_runtime.train.optim import build_optimizer
from hp_runtime.train.plot import plot_run
from hp_runtime.train.schedule import lr_at
from hp_runtime.train.state import TrainState
from hp_runtime.train.step import Stepper, TokenLoss


@dataclass
class RunResult:
    """What a finished run reports back (every rank holds the same values)."""

    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)
    seconds: float = 0.0


def precision(
    config: Config, device: torch.device
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(FSDP compute dtype, autocast dtype): bf16 on GPU by default, through FSDP's
    mixed-precision policy when parameters are sharded, else through autocast."""
    mode = config.train.mixed_precision
    bf16 = mode == "bf16" or (mode == "auto" and device.type == "cuda")
    if not bf16:
        return torch.float32, None
    sharded = config.parallel.dp_replicate * config.parallel.dp_shard > 1
    return (torch.bfloat16, None) if sharded else (None, torch.bfloat16)


def build_assembly(
    config: Config, runtime: Runtime, plan: BatchPlan, loss_fn: TokenLoss
) -> Assembly:
    p = config.parallel
    param_dtype, _ = precision(config, runtime.device)
    options = ParallelOptions(
        pp_schedule=p.pp_schedule,
        pp_microbatches=pp_microbatches(config, plan),
        pp_virtual_stages=p.pp_virtual_stages,
        loss_parallel=p.loss_parallel,
        activation_checkpointing=None
        if p.activation_checkpointing == "none"
        else p.activation_checkpointing,
        ac_every=p.ac_every,
        compile_blocks=p.compile,
        tp_reduce_dtype=getattr(torch, p.tp_reduce_dtype) if p.tp_reduce_dtype else None,
        param_dtype=param_dtype,
    )
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, p.pp)
    return assemble(
        config.model, dims, runtime.device, seed=config.train.seed, options=options, loss_fn=loss_fn
    )


def check_layout(config: Config, runtime: Runtime) -> None:
    """Errors every rank finds alike, before any work: the layout against the world size."""
    p = config.parallel
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, p.pp)
    try:
        dims.validate(runtime.world_size, config.model)
    except ValueError as exc:
        raise ConfigError(
            f"parallel: {exc} (set parallel.dp_shard, tp, pp, dp_replicate)"
        ) from None
    if p.loss_parallel and p.tp == 1:
        raise ConfigError("parallel.loss_parallel needs parallel.tp > 1")
    if p.pp == 1 and p.pp_virtual_stages > 1:
        raise ConfigError("parallel.pp_virtual_stages > 1 needs parallel.pp > 1")
    batch_plan(config)


def write_config(config: Config, run_dir: str) -> None:
    """RUN_DIR/config.toml, the resolved config, written whole or not at all."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.toml")
    with open(path + ".tmp", "w", encoding="utf-8") as stream:
        stream.write(to_toml(config))
    os.replace(path + ".tmp", path)


def evaluate(stepper: Stepper, loader: Loader | None, plan: BatchPlan, iters: int) -> float:
    """Mean loss over the same first `iters` global batches of the validation set."""
    if loader is not None:
        loader.restart(0)
    sums = torch.zeros(2, device=stepper.device)
    for _ in range(iters):
        micro = loader.take(plan.accumulation) if loader is not None else []
        sums += stepper.eval_sums(micro, plan.accumulation)
    return float(stepper.eval_loss(sums))


def train(config: Config, runtime: Runtime, stream: TextIO | None = None) -> RunResult:
    """Run `config` on this rank; every rank of the job calls it."""
    t, stream = config.train, stream or sys.stdout
    started = time.perf_counter()
    check_layout(config, runtime)
    plan = batch_plan(config)
    if runtime.is_main:
        write_config(config, t.run_dir)
        print(f"hp-train: resolved config (also in {t.run_dir}/config.toml)", file=stream)
        print(to_toml(config), file=stream, flush=True)
    torch.manual_seed(t.seed)

    # The rank's share of the model, its data and its optimizer.
    loss_fn = TokenLoss(runtime.device)
    failure = None
    try:
        assembly = build_assembly(config, runtime, plan, loss_fn)
    except ValueError as exc:  # e.g. a schedule that cannot take this many micro-batches
        failure = TrainError(f"parallel: {exc}")
    agree(failure, runtime)
    reads = assembly.has_first_stage or assembly.has_last_stage
    datasets = build_datasets(config, plan, runtime, reads, t.run_dir)
    workers = default_workers(config)
    loader = valid_loader = None
    state = TrainState(
        assembly.modules,
        build_optimizer(
            assembly.modules, config.optim, config.model.tie_embeddings, runtime.device
        ),
        plan.global_batch_size,
    )
    if reads:
        loader = Loader(
            datasets.train,
            plan,
            assembly.dp_rank,
            state.consumed_samples,
            runtime.device,
            workers,
            config.data.prefetch_factor,
        )
        if datasets.valid is not None:
            valid_loader = Loader(
                datasets.valid, plan, assembly.dp_rank, 0, runtime.device, 0, 2, background=False
            )
    _, autocast_dtype = precision(config, runtime.device)
    stepper = Stepper(
        assembly,
        loss_fn,
        pp_microbatches(config, plan),
        autocast_dtype,
        config.parallel.loss_parallel,
        config.data.reset_position_ids,
        config.data.document_masking,
    )
    seq = config.data.seq_length
    metrics = MetricsLog(
        t.run_dir,
        runtime.is_main,
        runtime.device,
        t.steps,
        Throughput(
            plan.global_batch_size * seq,
            runtime.world_size,
            config.model.flops_per_token(seq),
            peak_tflops(runtime.device, config.metrics.peak_tflops),
        ),
        config.metrics.tensorboard,
        stream,
    )
    metrics.say(
        f"hp-train: {config.model.num_params() / 1e6:.1f}M parameters | {runtime.world_size} "
        f"rank(s) on {runtime.device.type} | global batch {plan.global_batch_size} = "
        f"{plan.micro_batch_size} x {plan.dp_size} data-parallel x {plan.accumulation} "
        f"accumulation | {t.steps} steps | data ready in {datasets.build_seconds:.2f} s"
    )

    # The loop.
    result = RunResult(t.steps)
    guard = SpikeGuard(t.spike_action, t.spike_window, t.spike_sigma)
    lagged = LaggedValues()
    skipped_since_log: set[int] = set()

    def settle(entry: tuple[int, list[float]] | None) -> None:
        """A step's values have reached the host: check them and keep them."""
        if entry is None:
            return
        step, (loss, norm) = entry
        check_finite(step, loss, norm, state.samples_of(step))
        result.losses[step], result.grad_norms[step] = loss, norm

    metrics.mark(state.step)
    try:
        for step in range(state.step + 1, t.steps + 1):
            lr = lr_at(step, config.optim, t.steps)
            for group in state.optimizer.param_groups:
                group["lr"] = lr
            micro = loader.take(plan.accumulation) if loader is not None else []
            loss = stepper.train_step(micro, plan.accumulation)
            norm = assembly.finish_gradients(t.max_norm)
            values = torch.stack([loss.float(), norm.float()])
            skip = False
            if guard.enabled:  # the guard must see this step before the update: one sync
                host_loss, host_norm = values.tolist()
                check_finite(step, host_loss, host_norm, state.samples_of(step))
                reason = guard.judge(host_loss, host_norm)
                if reason is not None:
                    first, end = state.samples_of(step)
                    message = f"step {step}: {reason} (samples {first} to {end - 1})"
                    if guard.action == "stop":
                        raise TrainError(message + "; stopping (train.spike_action = 'stop')")
                    metrics.say(message + "; update skipped")
                    metrics.write(
                        {"kind": "skip", "step": step, "reason": reason, "samples": [first, end]}
                    )
                    skip = True
                    result.skipped.append(step)
                    skipped_since_log.add(step)
            if not skip:
                state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            state.advance()
            settle(lagged.push(step, values))

            if step % config.metrics.log_interval == 0 or step == t.steps:
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
                if loader is not None:
                    loader.waited = 0.0
            if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
                settle(lagged.flush())
                result.val_losses[step] = evaluate(stepper, valid_loader, plan, t.eval_iters)
                metrics.validation(step, result.val_losses[step])
                metrics.mark(step)
                if loader is not None:
                    loader.waited = 0.0
        settle(lagged.flush())
        result.seconds = time.perf_counter() - started
        metrics.write(
            {
                "kind": "end",
                "status": "completed",
                "step": state.step,
                "consumed_samples": state.consumed_samples,
                "final_loss": result.losses.get(state.step),
                "elapsed_s": result.seconds,
            }
        )
        metrics.say(
            f"hp-train: done, {state.step} steps in {result.seconds:.1f} s; final loss "
            f"{result.losses.get(state.step, float('nan')):.4f}; metrics in {metrics.path}"
        )
    except TrainError as exc:
        metrics.write({"kind": "end", "status": "stopped", "step": state.step, "reason": str(exc)})
        raise
    finally:
        metrics.close()
    if config.metrics.plot and runtime.is_main:
        try:
            metrics.say(f"hp-train: curves in {plot_run(t.run_dir)}")
        except TrainError as exc:  # matplotlib missing: a notice, not a failure
            metrics.say(f"hp-train: no plot: {exc}")
    return result
