"""A rank's set-up for a run, in the order `Setup.run` reads: the layout and the data
resolved, the run directory held, what to resume found, the model assembled, the data built,
the optimizer, a checkpoint resumed (or HF weights loaded), the loaders and the metrics log.
`loop.train` calls `setup` and then runs the steps."""

from __future__ import annotations

import os
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, TextIO

import numpy as np
import torch
from hp_data.fs import write_text
from hp_data.phases import PhasedDataset, PhasePlan
from hp_data.redact import redact, redact_data
from hp_data.remote import set_timeout
from torch import nn

from hp_runtime import __version__
from hp_runtime.model import ModelConfig, Transformer
from hp_runtime.parallel import Assembly, assemble
from hp_runtime.parallel.float8 import high_precision
from hp_runtime.train.batch import BatchPlan, batch_plan, phase_starts
from hp_runtime.train.checkpoint import Checkpointer
from hp_runtime.train.checkpoint_format import CheckpointError, read_meta
from hp_runtime.train.checkpoint_load import load
from hp_runtime.train.checkpoint_remote import is_remote
from hp_runtime.train.compat import DATA_KEYS, check_compatible
from hp_runtime.train.config import Config, check_layout, check_paths, to_toml
from hp_runtime.train.data import Datasets, RunData, build_datasets, resolve_data
from hp_runtime.train.dirlock import RunDirLock, hold_run_dir
from hp_runtime.train.downstream import Downstream, Tasks
from hp_runtime.train.errors import TrainError
from hp_runtime.train.guard import SpikeGuard
from hp_runtime.train.hf import check_hf_config, init_from_hf
from hp_runtime.train.launch import Runtime, agree, lowest_message
from hp_runtime.train.loader import Loader
from hp_runtime.train.metrics import MetricsLog, Throughput, continue_log, peak_tflops
from hp_runtime.train.migrate import as_phased
from hp_runtime.train.mixrecord import write_record
from hp_runtime.train.optim import build_optimizer
from hp_runtime.train.replicas import Replicas
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
        float8=config.train.float8,
    )


def float8_line(config: Config, compute: torch.dtype) -> str:
    """The start-up line of `train.float8`: what runs in float8 and what does not, and why."""
    float8 = config.train.float8
    assert float8 is not None
    with torch.device("meta"):
        model = Transformer(config.model)
    kept = high_precision(model, float8, config.parallel.tp)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    reasons = Counter(why.split(", ")[-1] for why in kept.values())
    text = "; ".join(f"{why} ({count})" for why, count in reasons.items())
    line = (
        f"hp-train: float8 ({float8.recipe}): {linears - len(kept)} of {linears} linears; "
        f"kept in {str(compute).removeprefix('torch.')}: {text or 'none'}"
    )
    if config.model.moe is not None:
        line += (
            "; the routed experts stay in the compute dtype too (hp does not run torchao's "
            "grouped float8 matmuls yet)"
        )
    return line


def write_config(text: str, run_dir: str) -> None:
    """RUN_DIR/config.toml, the resolved config (`to_toml`), written whole or not at all."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.toml")
    write_text(path, text)


def phase_rates(phases: PhasePlan, model: ModelConfig) -> np.ndarray:
    """float64 [steps + 1, 2]: tokens and FLOPs by the end of each step of a phased run, each
    step at its phase's length (tokens/s and MFU count what each step trained)."""
    lengths = phases.step_seq_lengths()
    samples = np.concatenate(([0], np.diff(phases.cumulative)))
    unique, inverse = np.unique(lengths, return_inverse=True)
    per_token = np.array([model.flops_per_token(int(n)) for n in unique], dtype=np.float64)
    tokens = (samples * lengths).astype(np.float64)
    return np.stack([np.cumsum(tokens), np.cumsum(tokens * per_token[inverse])], axis=1)


def checkpoint_meta(config: Config, text: str, datasets: Datasets) -> dict[str, Any]:
    """What every checkpoint of the run records beside its tensors: the version, the config
    (`text`, as config.toml holds it), the data's identity and its redacted keys."""
    d = config.data
    return {
        "hp_runtime": __version__,
        "config": text,
        "data": {
            "fingerprint": datasets.identity,
            "config": redact_data(  # stored: a path's credentials never are
                {k: getattr(d, k) for k in DATA_KEYS}
            ),
        },
    }


def agreed(outcome: TrainError | None, runtime: Runtime) -> str | None:
    """One part of a resume (its checks, its load), judged on every rank alike: a refusal on
    any rank stops them all (the lowest reports it); damage on any is named by the lowest
    damaged rank's message everywhere (None: no rank found any)."""
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
        local, listing = path, None
        try:
            local, listing = checkpointer.open(path)  # a remote one's mirror on this node
            meta = as_phased(read_meta(local), path, config, state.plan, datasets)
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
        reason = agreed(outcome, runtime)
        if reason is None:
            try:
                load(local, state, runtime, meta, config.model, listing)
                outcome = None
            except TrainError as exc:
                outcome = exc
            reason = agreed(outcome, runtime)
        if reason is None:
            checkpointer.close(path)
            if not checkpointer.seeds(path):
                checkpointer.adopt(meta)
            return path
        checkpointer.close(path)  # its mirror, where it was a remote one's
        failures.append(reason)
        if number < len(candidates):
            say(f"hp-train: warning: {failures[-1]}; trying the checkpoint before it")
    if failures and len(candidates) == 1 and checkpointer.seeds(candidates[0]):
        raise CheckpointError(f"checkpoint.resume = {candidates[0]!r}: {failures[-1]}", False)
    if failures:
        raise CheckpointError(
            f"no checkpoint of {redact(checkpointer.root)} could be loaded: {failures[-1]}; "
            f"move them aside (hp deletes none) or choose a new train.run_dir to start afresh",
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
    downstream: Downstream | None = None  # `[eval]`'s tasks on the run's model
    replicas: Replicas | None = None  # `parallel.fault_tolerance`'s groups (torchft)


def setup(config: Config, runtime: Runtime, stream: TextIO, started: float | None = None) -> Run:
    """This rank's part of the run (`Setup.run`)."""
    return Setup(config, runtime, stream, started).run()


class Setup:
    """One rank's set-up, step by step (`run`); each step is a few lines, and what a step
    finds out (a refusal) every rank agrees on before the next (`agree`)."""

    def __init__(
        self, config: Config, runtime: Runtime, stream: TextIO, started: float | None
    ) -> None:
        self.config, self.t, self.runtime = config, config.train, runtime
        self.stream, self.started = stream, started
        self.text = to_toml(config)  # the resolved config, as config.toml holds it
        self.load_seconds = 0.0

    def say(self, line: str) -> None:
        if self.runtime.is_main:
            print(line, file=self.stream, flush=True)

    def run(self) -> Run:
        """The layout and the data resolved and the paths checked before the job holds its
        run directory (`dirlock`: before anything is written there; `Loop.train` lets it go
        at the end, a failure here at once)."""
        plan = checked_plan(self.config, self.runtime)
        check_paths(self.config)
        ev = self.config.eval
        tasks = Tasks.agreed(ev.tasks, ev.include, "eval.tasks", self.runtime) if ev.tasks else None
        data = resolve_data(self.config, plan)
        held = hold_run_dir(self.t.run_dir, self.runtime, self.stream)
        try:
            return self.build(plan, data, held, tasks)
        except BaseException:
            held.release()
            raise

    def build(self, plan: BatchPlan, data: RunData, held: RunDirLock, tasks: Tasks | None) -> Run:
        checkpointer, candidates = self.find_checkpoints()
        self.announce()
        assembly, loss_fn, autocast_dtype = self.assemble(plan)
        reads = assembly.has_first_stage or assembly.has_last_stage
        datasets = build_datasets(data, self.runtime, reads)
        state = self.train_state(assembly, plan, datasets)
        checkpointer.clean()
        resumed = self.resume_or_init(checkpointer, candidates, state, datasets, assembly)
        assembly.weights_changed()  # a checkpoint's or Hugging Face's weights
        self.record_start(checkpointer, resumed, state, datasets.train)
        loader, valid_loader = self.loaders(datasets, plan, assembly, state, reads)
        stepper = Stepper(
            assembly,
            loss_fn,
            plan.pp_microbatches,
            autocast_dtype,
            self.config.parallel.loss_parallel,
            self.config.data.reset_position_ids,
            datasets.eod_token if self.config.data.document_masking else None,
            self.t.loss_chunk_tokens,
        )
        metrics = self.metrics_log(plan, datasets, stepper, resumed, state)
        meta = checkpoint_meta(self.config, self.text, datasets)
        return Run(
            assembly,
            state,
            plan,
            stepper,
            loader,
            valid_loader,
            metrics,
            checkpointer,
            meta,
            resumed,
            held,
            tasks and self.downstream(tasks, assembly, autocast_dtype),
            self.replicas(state),
        )

    def downstream(
        self, tasks: Tasks, assembly: Assembly, autocast_dtype: torch.dtype | None
    ) -> Downstream:
        """`[eval]`'s tasks on the run's own model (`train/lm_eval_model.py`)."""
        from hp_runtime.train.lm_eval_model import HpLM

        lm = HpLM.of(assembly, autocast_dtype, self.config)
        tasks.check_length(lm.max_length, "eval.tasks")
        return Downstream(lm, tasks, self.config.eval.limit, self.runtime.device)

    def replicas(self, state: TrainState) -> Replicas | None:
        ft = self.config.parallel.fault_tolerance
        return None if ft is None else Replicas(ft, self.runtime, state)

    def find_checkpoints(self) -> tuple[Checkpointer, list[str]]:
        """What to resume, decided before anything is written; HF weights to start from
        checked before anything is built."""
        if is_remote(self.config.checkpoint.dir or ""):  # its requests bounded as data reads
            set_timeout(self.config.data.remote_timeout_s, "data.remote_timeout_s")
        checkpointer = Checkpointer(self.t.run_dir, self.config.checkpoint, self.runtime, self.text)
        failure, candidates = None, []
        try:
            candidates = checkpointer.candidates(self.say)
        except CheckpointError as exc:
            failure = exc
        agree(failure, self.runtime)
        failure = None
        if self.config.model_init_from is not None and not candidates:
            try:
                check_hf_config(self.config.model, self.config.model_init_from)
            except TrainError as exc:
                failure = exc
            agree(failure, self.runtime)
        return checkpointer, candidates

    def announce(self) -> None:
        self.say(f"hp-train: resolved config (also in {self.t.run_dir}/config.toml)\n{self.text}")

    def assemble(self, plan: BatchPlan) -> tuple[Assembly, TokenLoss, torch.dtype | None]:
        """The model on this rank's device, laid out; a layout the schedule refuses, or a
        model the device cannot hold, in one line."""
        config, runtime = self.config, self.runtime
        torch.manual_seed(self.t.seed)
        loss_fn = TokenLoss(runtime.device)
        param_dtype, autocast_dtype = precision(config, runtime.device)
        failure, assembly = None, None
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
        assert assembly is not None
        if self.t.float8 is not None:
            self.say(float8_line(config, param_dtype or autocast_dtype or torch.float32))
        return assembly, loss_fn, autocast_dtype

    def train_state(self, assembly: Assembly, plan: BatchPlan, datasets: Datasets) -> TrainState:
        config, t = self.config, self.t
        optimizer = build_optimizer(
            assembly.modules, config.optim, config.model.tie_embeddings, self.runtime.device
        )
        guard = SpikeGuard(t.spike_action, t.spike_window, t.spike_sigma)
        state = TrainState(assembly.modules, optimizer, plan, guard)
        if isinstance(datasets.train, PhasedDataset):
            state.mixture = datasets.train.plan.state_at
        return state

    def resume_or_init(
        self,
        checkpointer: Checkpointer,
        candidates: list[str],
        state: TrainState,
        datasets: Datasets,
        assembly: Assembly,
    ) -> str | None:
        """The checkpoint resumed from (None: a fresh start, from `model.init_from` if given)."""
        config, runtime = self.config, self.runtime
        start = time.perf_counter()
        resumed = resume(checkpointer, candidates, state, config, datasets, runtime, self.say)
        self.load_seconds = time.perf_counter() - start
        if resumed is not None:
            self.say(
                f"hp-train: resumed from {resumed} at step {state.step} "
                f"({state.consumed_samples} samples consumed) in {self.load_seconds:.2f} s"
            )
        elif config.model_init_from is not None:
            failure = None
            try:
                init_from_hf(assembly.modules, config.model, config.model_init_from)
            except TrainError as exc:
                failure = exc
            agree(failure, runtime)
            self.say(f"hp-train: initialised from {config.model_init_from}")
        return resumed

    def record_start(
        self, checkpointer: Checkpointer, resumed: str | None, state: TrainState, train: Any
    ) -> None:
        """config.toml, metrics.jsonl and a phased run's mix-report.json (what `hp-train
        mix-report RUN_DIR` prints, no credential needed), once the run is this config's: a
        refused resume leaves the run's own."""
        if not self.runtime.is_main:
            return
        write_config(self.text, self.t.run_dir)
        if isinstance(train, PhasedDataset):
            write_record(train.plan, self.t.run_dir)
        fresh = resumed is None or checkpointer.seeds(resumed)
        aside = continue_log(self.t.run_dir, state.step, fresh)
        if aside is not None:
            self.say(f"hp-train: a fresh start keeps the earlier metrics.jsonl as {aside}")

    def loaders(
        self,
        datasets: Datasets,
        plan: BatchPlan,
        assembly: Assembly,
        state: TrainState,
        reads: bool,
    ) -> tuple[Loader | None, Loader | None]:
        """This rank's train and validation loaders (none where it reads nothing, or where a
        finished run was resumed)."""
        if not reads or state.step >= self.t.steps:
            return None, None
        d, device, rank = self.config.data, self.runtime.device, assembly.dp_rank
        ft = self.config.parallel.fault_tolerance
        if ft is not None:  # group g reads the ranks g x dp .. (g + 1) x dp - 1 of groups x dp
            rank += ft.replica_group * assembly.dp_size
        loader = Loader(
            datasets.train,
            plan,
            rank,
            state.consumed_samples,
            device,
            d.num_workers,
            d.prefetch_factor,
        )
        valid = None
        if datasets.valid is not None:
            valid = Loader(datasets.valid, plan, rank, 0, device, 0, 2, background=False)
        return loader, valid

    def metrics_log(
        self,
        plan: BatchPlan,
        datasets: Datasets,
        stepper: Stepper,
        resumed: str | None,
        state: TrainState,
    ) -> MetricsLog:
        config, runtime, t = self.config, self.runtime, self.t
        seq, model = config.data.seq_length, config.model
        phased = isinstance(datasets.train, PhasedDataset)
        throughput = Throughput(
            plan,
            seq,
            runtime.world_size,
            model.flops_per_token(seq),  # a MoE model's active parameters: MFU counts those
            peak_tflops(runtime.device, config.metrics.peak_tflops),
            phase_rates(datasets.train.plan, model) if phased else None,
        )
        metrics = MetricsLog(
            t.run_dir,
            runtime.is_main,
            runtime.device,
            t.steps,
            throughput,
            config.metrics.tensorboard,
            self.stream,
            self.started,
            moe_layers=tuple(stepper.moe_layers),
            moe_aux_loss=model.moe is not None and model.moe.load_balance == "aux_loss",
            wandb=config.metrics.wandb,
            settings=tomllib.loads(self.text),  # redacted, as config.toml is
        )
        if resumed is not None:
            metrics.write(
                {
                    "kind": "resume",
                    "step": state.step,
                    "path": resumed,
                    "load_s": self.load_seconds,
                    "world_size": runtime.world_size,
                }
            )
        metrics.say(start_line(config, runtime, plan, datasets))
        return metrics


def start_line(config: Config, runtime: Runtime, plan: BatchPlan, datasets: Datasets) -> str:
    """The start-up line: the model, the layout, the batch, the steps, the data's time."""
    model = config.model
    active = "" if model.moe is None else f" ({model.num_params(active=True):,} active a token)"
    return (
        f"hp-train: {model.num_params():,} parameters{active} | {runtime.world_size} "
        f"rank(s) on {runtime.device.type} | global batch {plan.global_batch_size} = "
        f"{plan.micro_batch_size} x {plan.dp_size} data-parallel x {plan.accumulation} "
        f"accumulation{ramp_text(plan)} | {config.train.steps} steps | data ready in "
        f"{datasets.build_seconds:.2f} s"
    )
