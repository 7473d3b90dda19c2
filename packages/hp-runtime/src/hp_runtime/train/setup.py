"""A rank's set-up for a run: the layout checked, the model assembled, the data, the
optimizer, a checkpoint resumed (or HF weights loaded), the loaders and the metrics log.
`loop.train` calls `setup` and then runs the steps."""

from __future__ import annotations

import os
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TextIO

import numpy as np
import torch
from hp_data.phases import PhasedDataset, PhasePlan
from hp_data.redact import redact_data

from hp_runtime import __version__
from hp_runtime.model import ModelConfig
from hp_runtime.parallel import Assembly, assemble
from hp_runtime.train.checkpoint import (
    DATA_KEYS,
    Checkpointer,
    CheckpointError,
    check_compatible,
    load,
    read_meta,
)
from hp_runtime.train.config import Config, check_layout, check_paths, to_toml
from hp_runtime.train.data import (
    BatchPlan,
    Datasets,
    Loader,
    batch_plan,
    build_datasets,
    phase_starts,
)
from hp_runtime.train.dirlock import RunDirLock, hold_run_dir
from hp_runtime.train.errors import TrainError
from hp_runtime.train.guard import SpikeGuard
from hp_runtime.train.hf import check_hf_config, init_from_hf
from hp_runtime.train.launch import Runtime, agree, lowest_message
from hp_runtime.train.metrics import MetricsLog, Throughput, continue_log, peak_tflops
from hp_runtime.train.optim import build_optimizer
from hp_runtime.train.state import TrainState
from hp_runtime.train.step import Stepper, TokenLoss


def precision(
    config: Config, device: torch.device
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(FSDP compute dtype, autocast dtype): bf16 on GPU by default, through FSDP's
    mixed-precision policy when parameters are sharded, else through autocast."""
    mode = config.train.mixed_precision
    if not (mode == "bf16" or (mode == "auto" and device.type == "cuda")):
        return torch.float32, None
    sharded = config.parallel.dp_cp_size > 1  # FSDP runs over dp_shard x cp
    return (torch.bfloat16, None) if sharded else (None, torch.bfloat16)


def checked_plan(config: Config, runtime: Runtime) -> BatchPlan:
    """The batch plan of a layout checked against the world size: errors every rank finds
    alike, before any work."""
    check_layout(config, runtime.world_size, runtime.device.type)
    plan = batch_plan(config)
    if config.data.phases:
        phase_starts(config, plan)
    return plan


def ramp_text(plan: BatchPlan) -> str:
    """The start-up line's account of `train.batch_ramp` (empty without one)."""
    ramp = plan.ramp
    if ramp is None:
        return ""
    return (
        f", ramped from {ramp.start} by {ramp.increment} over {ramp.samples} samples (full "
        f"from step {plan.full_from})"
    )


def build_assembly(
    config: Config,
    runtime: Runtime,
    plan: BatchPlan,
    param_dtype: torch.dtype | None,
    loss_fn: TokenLoss,
) -> Assembly:
    parallel = replace(config.parallel, pp_microbatches=plan.pp_microbatches)
    return assemble(
        config.model,
        parallel,
        runtime.device,
        seed=config.train.seed,
        options=parallel,
        param_dtype=param_dtype,
        loss_fn=loss_fn,
    )


def write_config(config: Config, run_dir: str) -> None:
    """RUN_DIR/config.toml, the resolved config, written whole or not at all."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.toml")
    with open(path + ".tmp", "w", encoding="utf-8") as stream:
        stream.write(to_toml(config))
    os.replace(path + ".tmp", path)


def phase_rates(phases: PhasePlan, model: ModelConfig) -> np.ndarray:
    """float64 [steps + 1, 2]: tokens and FLOPs by the end of each step of a phased run, each
    step at its phase's length (tokens/s and MFU count what each step trained)."""
    lengths = phases.step_seq_lengths()
    samples = np.concatenate(([0], np.diff(phases.cumulative)))
    unique, inverse = np.unique(lengths, return_inverse=True)
    per_token = np.array([model.flops_per_token(int(n)) for n in unique], dtype=np.float64)
    tokens = (samples * lengths).astype(np.float64)
    return np.stack([np.cumsum(tokens), np.cumsum(tokens * per_token[inverse])], axis=1)


def checkpoint_meta(config: Config, datasets: Datasets) -> dict[str, Any]:
    d = config.data
    return {
        "hp_runtime": __version__,
        "config": to_toml(config),
        "data": {
            "fingerprint": datasets.identity,
            "config": redact_data(  # stored: a path's credentials never are
                {k: getattr(d, k) for k in DATA_KEYS}
            ),
        },
    }


def together(outcome: TrainError | None, runtime: Runtime) -> str | None:
    """One phase of a resume, judged on every rank alike: a refusal on any rank stops them
    all (the lowest reports it); damage on any is named by the lowest damaged rank's message
    everywhere (None: no rank found any)."""
    refused = outcome is not None and not outcome.fallback
    agree(outcome if refused else None, runtime)
    return lowest_message(None if outcome is None else str(outcome), runtime)


def resume(
    checkpointer: Checkpointer,
    candidates: list[str],
    state: TrainState,
    config: Config,
    datasets: Datasets,
    runtime: Runtime,
    say: Any,
) -> str | None:
    """Load the checkpoint `checkpoint.resume` names; the newest of a run falls back to the
    one before when it cannot be loaded (never silently to a fresh start)."""
    failures = []
    for number, path in enumerate(candidates, 1):
        meta: dict[str, Any] = {}
        try:
            meta = read_meta(path)
            check_compatible(
                meta,
                path,
                config,
                state.plan,
                datasets.identity,
                say if runtime.is_main else lambda _: None,
                state.mixture,
            )
            outcome = None
        except TrainError as exc:
            outcome = exc
        reason = together(outcome, runtime)
        if reason is None:
            try:
                load(path, state, runtime, meta, config.model)
                outcome = None
            except TrainError as exc:
                outcome = exc
            reason = together(outcome, runtime)
        if reason is None:
            if not checkpointer.seeds(path):
                checkpointer.adopt(meta)
            return path
        failures.append(reason)
        if number < len(candidates):
            say(f"hp-train: warning: {failures[-1]}; trying the checkpoint before it")
    if failures and len(candidates) == 1 and checkpointer.seeds(candidates[0]):
        raise CheckpointError(f"checkpoint.resume = {candidates[0]!r}: {failures[-1]}", False)
    if failures:
        raise CheckpointError(
            f"no checkpoint of {checkpointer.root} could be loaded: {failures[-1]}; move them "
            f"aside (hp deletes none) or choose a new train.run_dir to start afresh",
            False,
        )
    return None


@dataclass
class Run:
    """A rank's set-up: everything the loop touches."""

    assembly: Assembly
    state: TrainState
    plan: BatchPlan
    stepper: Stepper
    loader: Loader | None
    valid_loader: Loader | None
    metrics: MetricsLog
    checkpointer: Checkpointer
    meta: dict[str, Any]
    resumed_from: str | None
    held: RunDirLock  # the job's hold on the run directory, let go when the loop ends


def setup(config: Config, runtime: Runtime, stream: TextIO, started: float | None = None) -> Run:
    """This rank's part of the run, once the layout and the paths are checked and the job
    holds its run directory (`dirlock`: before anything is written there; `Loop.train` lets
    it go at the end, a failure here at once)."""
    plan = checked_plan(config, runtime)
    check_paths(config)

    def say(line: str) -> None:
        if runtime.is_main:
            print(line, file=stream, flush=True)

    held = hold_run_dir(config.train.run_dir, runtime, stream)
    try:
        return _set_up(config, runtime, stream, started, plan, say, held)
    except BaseException:
        held.release()
        raise


def _set_up(
    config: Config,
    runtime: Runtime,
    stream: TextIO,
    started: float | None,
    plan: BatchPlan,
    say: Callable[[str], None],
    held: RunDirLock,
) -> Run:
    t = config.train
    checkpointer = Checkpointer(t.run_dir, config.checkpoint, runtime, to_toml(config))
    failure, candidates = None, []
    try:  # what to resume, decided before anything is written
        candidates = checkpointer.candidates(say)
    except CheckpointError as exc:
        failure = exc
    agree(failure, runtime)
    failure = None
    if config.model_init_from is not None and not candidates:  # before anything is built
        try:
            check_hf_config(config.model, config.model_init_from)
        except TrainError as exc:
            failure = exc
        agree(failure, runtime)
    if runtime.is_main:
        print(f"hp-train: resolved config (also in {t.run_dir}/config.toml)", file=stream)
        print(to_toml(config), file=stream, flush=True)
    torch.manual_seed(t.seed)
    loss_fn = TokenLoss(runtime.device)
    param_dtype, autocast_dtype = precision(config, runtime.device)
    failure = None
    try:
        assembly = build_assembly(config, runtime, plan, param_dtype, loss_fn)
    except ValueError as exc:  # e.g. a schedule that cannot take this many micro-batches
        failure = TrainError(f"parallel: {exc}")
    except RuntimeError as exc:  # an allocation the device cannot hold: torch's own is long
        if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate" not in str(exc):
            raise
        failure = TrainError(
            f"model: {config.model.num_params():,} parameters do not fit in this "
            f"{runtime.device.type} rank's memory; shrink the model or shard it "
            "(parallel.dp_shard, parallel.tp, parallel.pp)"
        )
    agree(failure, runtime)
    reads = assembly.has_first_stage or assembly.has_last_stage
    datasets = build_datasets(config, plan, runtime, reads, t.run_dir)
    optimizer = build_optimizer(
        assembly.modules, config.optim, config.model.tie_embeddings, runtime.device
    )
    guard = SpikeGuard(t.spike_action, t.spike_window, t.spike_sigma)
    state = TrainState(assembly.modules, optimizer, plan, guard)
    if isinstance(datasets.train, PhasedDataset):
        state.mixture = datasets.train.plan.state_at
    checkpointer.clean()
    load_start = time.perf_counter()
    resumed = resume(checkpointer, candidates, state, config, datasets, runtime, say)
    load_seconds = time.perf_counter() - load_start
    if resumed is not None:
        say(
            f"hp-train: resumed from {resumed} at step {state.step} "
            f"({state.consumed_samples} samples consumed) in {load_seconds:.2f} s"
        )
    elif config.model_init_from is not None:
        failure = None
        try:
            init_from_hf(assembly.modules, config.model, config.model_init_from)
        except TrainError as exc:
            failure = exc
        agree(failure, runtime)
        say(f"hp-train: initialised from {config.model_init_from}")
    if runtime.is_main:  # once the run is this config's: a refused resume leaves the run's own
        write_config(config, t.run_dir)
        fresh = resumed is None or checkpointer.seeds(resumed)
        aside = continue_log(t.run_dir, state.step, fresh)
        if aside is not None:
            say(f"hp-train: a fresh start keeps the earlier metrics.jsonl as {aside}")
    loader = valid_loader = None
    if reads and state.step < t.steps:  # a finished run resumed has nothing left to read
        loader = Loader(
            datasets.train,
            plan,
            assembly.dp_rank,
            state.consumed_samples,
            runtime.device,
            config.data.num_workers,
            config.data.prefetch_factor,
        )
        if datasets.valid is not None:
            valid_loader = Loader(
                datasets.valid, plan, assembly.dp_rank, 0, runtime.device, 0, 2, background=False
            )
    stepper = Stepper(
        assembly,
        loss_fn,
        plan.pp_microbatches,
        autocast_dtype,
        config.parallel.loss_parallel,
        config.data.reset_position_ids,
        datasets.eod_token if config.data.document_masking else None,
        t.loss_chunk_tokens,
    )
    seq, model = config.data.seq_length, config.model
    throughput = Throughput(
        plan,
        seq,
        runtime.world_size,
        model.flops_per_token(seq),  # a MoE model's active parameters: MFU counts those
        peak_tflops(runtime.device, config.metrics.peak_tflops),
        phase_rates(datasets.train.plan, model)
        if isinstance(datasets.train, PhasedDataset)
        else None,
    )
    metrics = MetricsLog(
        t.run_dir,
        runtime.is_main,
        runtime.device,
        t.steps,
        throughput,
        config.metrics.tensorboard,
        stream,
        started,
        moe_layers=tuple(stepper.moe_layers),
        moe_aux_loss=model.moe is not None and model.moe.load_balance == "aux_loss",
        wandb=config.metrics.wandb,
        settings=tomllib.loads(to_toml(config)),  # redacted, as config.toml is
    )
    if resumed is not None:
        metrics.write(
            {
                "kind": "resume",
                "step": state.step,
                "path": resumed,
                "load_s": load_seconds,
                "world_size": runtime.world_size,
            }
        )
    active = "" if model.moe is None else f" ({model.num_params(active=True):,} active a token)"
    metrics.say(
        f"hp-train: {model.num_params():,} parameters{active} | {runtime.world_size} "
        f"rank(s) on {runtime.device.type} | global batch {plan.global_batch_size} = "
        f"{plan.micro_batch_size} x {plan.dp_size} data-parallel x {plan.accumulation} "
        f"accumulation{ramp_text(plan)} | {t.steps} steps | data ready in "
        f"{datasets.build_seconds:.2f} s"
    )
    return Run(
        assembly,
        state,
        plan,
        stepper,
        loader,
        valid_loader,
        metrics,
        checkpointer,
        checkpoint_meta(config, datasets),
        resumed,
        held,
    )
