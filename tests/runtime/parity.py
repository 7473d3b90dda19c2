"""Train the tiny model for a few steps in one layout and report what parity tests compare."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor.parallel
import torch.nn.functional as F
from hp_runtime.model import preset
from hp_runtime.model.attention import document_ids
from hp_runtime.model.moe import Experts
from hp_runtime.parallel import ParallelDims, ParallelOptions, assemble, canonical_name
from hp_runtime.parallel.ep import ExpertDispatch
from hp_runtime.parallel.options import Float8
from hp_runtime.parallel.pp import carry_positions, pipeline_step
from hp_runtime.train.balance import Balance
from hp_runtime.train.config import OptimConfig
from hp_runtime.train.config.schema import Muon
from hp_runtime.train.optim import Optimizers, build_optimizer
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STEPS = 10
BATCH = 4
SEQ = 32
MAX_NORM = 1.0  # small enough that clipping acts on some steps
MUON = OptimConfig(name="muon", lr=3e-3, muon=Muon(lr=0.02, ns_dtype="float32"))


def batches(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def position_batches() -> list[torch.Tensor]:
    """Position ids of samples packed with documents of 1 to 11 tokens, the first of each
    continuing from the previous sample (starting above 0) about half the time."""
    generator = torch.Generator().manual_seed(321)

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (), generator=generator))

    steps = []
    for _ in range(STEPS):
        rows = []
        for _ in range(BATCH):
            ids, first = [], draw(2) * draw(20)
            while len(ids) < SEQ:
                ids += range(first, first + 1 + draw(11))
                first = 0
            rows.append(ids[:SEQ])
        steps.append(torch.tensor(rows))
    return steps


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(
    rank: int,
    world: int,
    dims: dict[str, int] | None,
    optimizer: str,
    model_overrides: dict[str, Any],
    pipeline: dict[str, Any] | None = None,
    documents: str | None = None,
) -> dict[str, Any]:
    """Per-step global losses, gradient norms and the final full parameters of one layout;
    for a MoE model (`model_overrides["moe"]`) also each step's `Balance.finish_step` figures
    and the final balancing biases, by layer.

    `pipeline`: schedule, microbatches, virtual_stages, loss_parallel, ac, compile, and
    sync_tied (False: the negative control that leaves the tied copies' gradients apart);
    regroup (False: the negative control that leaves the rows expert parallelism receives
    in their order from the ranks, [source rank][local expert]);
    accumulate: without a pipeline, the micro-batches a rank's batch runs as (one process
    with as many as a layout has micro-batches in all computes the same auxiliary losses);
    checkpoint: ("save" or "load", directory, step): save the model and optimizer after
    `step` steps, or load them and run the steps from `step` on (the losses and norms of
    those only); float8: a `Float8`'s fields (`train.float8`), the linears converted;
    per_shard (True: Muon's negative control, each rank orthogonalising its own shards).
    `optimizer`: "sgd", "momentum", "adamw" (torch's) or "muon" (hp's, `MUON`).
    `documents`: None (positions 0..s-1), "reset" (packed documents' position
    ids) or "mask" (those and document masking)."""
    config = preset("tiny", **model_overrides)
    pipeline = pipeline or {}
    layout = ParallelDims(**(dims or {}))
    microbatches = pipeline.get("microbatches", 2)
    accumulate = pipeline.get("accumulate", 1)
    options = ParallelOptions(
        pp_schedule=pipeline.get("schedule", "1f1b"),
        pp_microbatches=microbatches,
        pp_virtual_stages=pipeline.get("virtual_stages", 1),
        loss_parallel=pipeline.get("loss_parallel", False),
        activation_checkpointing=pipeline.get("ac", "none"),
        compile=pipeline.get("compile", False),
    )

    def micro_batch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets) / microbatches  # its share of the batch mean

    float8 = pipeline.get("float8")
    if pipeline.get("float64"):
        torch.set_default_dtype(torch.float64)
    assembly = assemble(
        config,
        layout,
        torch.device("cpu"),
        seed=7,
        options=options,
        loss_fn=micro_batch_loss,
        float8=Float8(**float8) if float8 is not None else None,
    )
    params = assembly.parameters
    per_shard = pipeline.get("per_shard", False)  # Muon's negative control
    if optimizer == "muon":  # hp's (AdamW beside it), its iteration in float32
        opt = build_optimizer(assembly.modules, MUON, config.tie_embeddings, torch.device("cpu"))
    elif optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=0.5)
    elif optimizer == "momentum":  # state for a checkpoint to carry
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, foreach=False)
    balance = Balance(assembly.modules, assembly.dp_group) if config.moe is not None else None
    if not pipeline.get("regroup", True):
        for module in (m for part in assembly.modules for m in part.modules()):
            if isinstance(module, Experts) and isinstance(module.kernel, ExpertDispatch):
                module.kernel.regroup = lambda received, rows: torch.arange(rows)  # type: ignore[method-assign]
    checkpoint = pipeline.get("checkpoint")
    first = 0
    if checkpoint is not None and checkpoint[0] == "load":
        _, directory, first = checkpoint
        _load(assembly.modules, opt, directory)
        assembly.weights_changed()
    masking = documents == "mask"
    # Context parallelism: the position ids travel whole (a stage's rows from their length).
    carries = documents is not None or assembly.cp is not None
    if carries and assembly.schedule is not None:
        names = ("position_ids", "documents") if masking else ("position_ids",)
        carry_positions(assembly.stages, assembly.total_stages, names, assembly.cp)

    def carried(positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (positions, document_ids(positions)) if masking else (positions,)

    losses, norms, figures = [], [], []
    data_steps = zip(batches(config.vocab_size), position_batches(), strict=True)
    for step, (data, position_ids) in enumerate(data_steps):
        if step < first:
            continue
        if balance is not None:
            balance.start_step(microbatches if assembly.schedule is not None else accumulate)
        local = data.chunk(assembly.dp_size)[assembly.dp_rank]
        inputs, targets, rows = local[:, :-1], local[:, 1:], None
        positions = position_ids.chunk(assembly.dp_size)[assembly.dp_rank]
        if documents is None:
            positions = torch.arange(SEQ).repeat(positions.shape[0], 1)
        if assembly.cp is not None:  # this rank's rows of the sequence; positions stay whole
            rows = assembly.cp.rows(SEQ, inputs.device)
            inputs, targets = inputs[:, rows], targets[:, rows]
        if assembly.schedule is not None:
            loss = pipeline_step(
                assembly.schedule,
                assembly.stage_ids,
                assembly.total_stages,
                (inputs, *carried(positions)) if carries else inputs,
                targets,
                microbatches,
            )
        elif documents is not None or rows is not None:
            # Every rank holds as many tokens, so the mean of the ranks' means is the batch's.
            marked = document_ids(positions) if masking else None
            logits = assembly.model(inputs, positions, marked, rows=rows)
            loss = loss_fn(logits, targets)
            loss.backward()
        elif options.loss_parallel:
            # Logits stay sharded over the vocabulary; the loss is computed on the shards.
            with torch.distributed.tensor.parallel.loss_parallel():
                loss = loss_fn(assembly.model(inputs), targets)
                loss.backward()
        else:
            loss = torch.zeros(())
            parts = zip(inputs.chunk(accumulate), targets.chunk(accumulate), strict=True)
            for part, part_targets in parts:
                share = loss_fn(assembly.model(part), part_targets) / accumulate
                share.backward()
                loss += share.detach()
        norm = assembly.finish_gradients(MAX_NORM, sync_tied=pipeline.get("sync_tied", True))
        norms.append(float(norm))
        if balance is not None:
            layers = [layer for layer, _ in balance.layers]
            figures.append(dict(zip(layers, balance.finish_step().numpy().copy(), strict=True)))
        if per_shard:  # each rank orthogonalises its own shard: not Muon
            with mock.patch("hp_runtime.train.muon._layout", lambda param: None):
                opt.step()
        else:
            opt.step()
        assembly.weights_changed()
        opt.zero_grad()
        if balance is not None:
            balance.update_bias()
        if checkpoint is not None and checkpoint[0] == "save" and step + 1 == checkpoint[2]:
            _save(assembly.modules, opt, checkpoint[1])
        if loss is not None and hasattr(loss, "full_tensor"):  # loss_parallel gives a DTensor
            loss = loss.full_tensor()
        reported = loss.detach().clone() if loss is not None else torch.zeros(())
        if dims is not None:  # mean over data-parallel lines; tp copies and pp stages counted once
            dist.all_reduce(reported)
            reported /= world // layout.pp
        losses.append(float(reported))
    full = {}
    for module in assembly.modules:
        for name, param in module.named_parameters():
            value = param.full_tensor() if hasattr(param, "full_tensor") else param
            # numpy: crosses process boundaries
            full[canonical_name(name)] = plain(value).numpy().copy()
    biases, local = {}, {}
    for layer, moe in balance.layers if balance is not None else ():
        biases[layer] = moe.router.expert_bias.detach().numpy().copy()
        w1 = moe.experts.w1
        local[layer] = (w1.to_local() if hasattr(w1, "to_local") else w1).shape[0]
    return {
        "losses": losses,
        "norms": norms,
        "params": full,
        "balance": figures,  # per step: {layer: Balance.finish_step's row}
        "bias": biases,
        "local_experts": local,  # rows of the experts' weights this rank holds, by layer
    }


_STATE = StateDictOptions(flatten_optimizer_state_dict=True)  # as the trainer's checkpoints


def _part(opt: Any) -> Any:
    """What DCP takes for the one model part: torch's optimizer, or hp's list (`Optimizers`)."""
    return opt.optimizers[0] if isinstance(opt, Optimizers) else opt


def _state(modules: list[torch.nn.Module], opt: Any) -> dict[str, Any]:
    (module,) = modules  # one model part: the optimizer is over its parameters
    opt = _part(opt)
    return {
        "model": get_model_state_dict(module, options=_STATE),
        "optim": get_optimizer_state_dict(module, opt, options=_STATE),
    }


def _save(modules: list[torch.nn.Module], opt: torch.optim.Optimizer, directory: str) -> None:
    """The model (the balancing biases with it) and the optimizer, with DCP, resharded on load."""
    dcp.save(_state(modules, opt), checkpoint_id=directory)


def _load(modules: list[torch.nn.Module], opt: Any, directory: str) -> None:
    state = _state(modules, opt)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(modules[0], state["model"], options=_STATE)
    set_optimizer_state_dict(modules[0], _part(opt), state["optim"], options=_STATE)


def plain(value: torch.Tensor) -> torch.Tensor:
    """A parameter's values as a plain tensor (float8's mxfp8 wraps its weights)."""
    value = value.detach()
    return value.as_subclass(torch.Tensor) if type(value) is not torch.Tensor else value
