"""`hp-train plan --config run.toml --world N [--gpu h100-80gb]`: a run's memory and time per
rank at any world size, from the real code, on one CPU and without the hardware.

Each distinct kind of rank (the first and the last rank of each distinct pipeline stage: the
stages' layers, embedding and head differ, and an uneven FSDP shard is the last rank's) is
built as the run builds it — `parallel.assemble.shard_stages`, the code every run shards its
model with — over torch's fake process group (`FakeStore`) of N ranks and on the meta device,
so a layout that cannot be built fails here with the run's own one-line error, and no memory of
the model's is allocated. From those shards, exactly: `param_bytes` (fp32 master weights),
`grad_bytes` (fp32, as FSDP reduces them), `optim_bytes` (AdamW's two moments and a step per
tensor; SGD's momentum). Activations are traced, not guessed: one micro-batch's forward of the
model at this rank's local widths (heads, kv heads and ffn / tp, experts / ep, sequence / cp)
on the meta device, with torch's saved-tensor hooks counting what autograd keeps (activation
checkpointing applied as the run applies it); with sequence parallelism the residual stream's
share is divided by tp. A pipeline stage holds `pp - stage` micro-batches of them under 1F1B
(every micro-batch under GPipe). `peak_bytes` adds FSDP's gathered blocks (the one computing
and the one prefetched, in the compute dtype) and their unsharded gradients.

`train.float8` is built in as the run builds it: the converted linears' weights are counted
(`float8_param_bytes`, of `param_bytes`), and under `fsdp_all_gather` they are gathered in
float8, one byte an element instead of the compute dtype's two, in the FSDP traffic and the
gathered blocks. Activations do not change: torchao's float8 linears keep their inputs in
high precision for the backward and cast them again there. The roofline's compute stays at
the bf16 peak: what float8's matmuls gain is measured (`tools/gpu/check.py`), not assumed.

With `--gpu`, a roofline: the step's model FLOPs at the GPU's dense bf16 peak, each dimension's
communication at its link's bandwidth (inside a node for a group that fits in one, else the
network), FSDP and context-parallel traffic overlapped with compute, tensor-parallel and expert
all-to-all traffic not, and the pipeline's bubble — never a silent default: without `--gpu`
there is no time estimate.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hp_runtime.model import Transformer
from hp_runtime.parallel.mesh import ParallelDims
from hp_runtime.parallel.pp import layers_per_stage
from hp_runtime.train.batch import batch_plan
from hp_runtime.train.config import Config
from hp_runtime.train.errors import ConfigError

GIB = 2**30
LAYOUT = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


@dataclass(frozen=True)
class Gpu:
    """One accelerator of the plan's table (vendors' data sheets)."""

    name: str
    bf16_tflops: float  # dense tensor-core peak
    memory_gib: float
    intra_gbps: float  # GB/s a GPU sends inside its node, one direction (NVLink)
    inter_gbps: float  # GB/s a GPU sends across nodes (its share of the network)
    per_node: int = 8


GPUS: dict[str, Gpu] = {
    "h100-80gb": Gpu("H100 SXM 80GB", 989.4, 80, 450, 50),  # NVLink 4; 400 Gb/s NDR a GPU
    "h200-141gb": Gpu("H200 SXM 141GB", 989.4, 141, 450, 50),
    "a100-80gb": Gpu("A100 SXM 80GB", 312.0, 80, 300, 25),  # NVLink 3; 200 Gb/s HDR a GPU
    "b200-180gb": Gpu("B200 180GB", 2250.0, 180, 900, 50),  # NVLink 5
}


@dataclass
class RankType:
    ranks: list[int]
    stage: int
    layers: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int  # one micro-batch
    in_flight: int  # micro-batches of activations held at once
    gathered_bytes: int  # FSDP's unsharded blocks and their gradients, at their peak
    peak_bytes: int
    float8_param_bytes: int = 0  # of param_bytes: the weights `train.float8` converts
    # what one gather of all its FSDP-sharded parameters sends, in elements: each its shard
    # times the other ranks of its group ((dp_shard·cp) - 1; experts': (dp_shard·cp / ep) - 1)
    fsdp_sent_elements: int = 0
    # Muon: what its gathers and scatters send in a step; the optimizer step's own memory (a
    # whole matrix and the iteration's copies); its iterations' FLOPs on this rank
    muon_sent_bytes: int = 0
    muon_step_bytes: int = 0
    muon_flops: int = 0

    def json(self) -> dict[str, Any]:
        return dict(vars(self))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class _State:
    """A rank's state bytes, and what FSDP gathers of its largest block (elements)."""

    params: int
    grads: int
    optim: int
    float8_params: int  # of params: the converted linears' weights
    block: int  # the largest block's local (TP-sharded, FSDP-unsharded) parameter count
    block_float8: int  # of block: the converted weights' elements
    sent: int  # elements one gather of every parameter sends (`RankType.fsdp_sent_elements`)
    muon: tuple[int, int, int] = (0, 0, 0)  # `RankType.muon_*`: sent, step bytes, FLOPs


def _state_bytes(modules: list[nn.Module], optim: Any, float8: bool) -> _State:
    params = [p for m in modules for p in m.parameters()]
    numel = sum(_local(p).numel() for p in params)
    parts = _muon_params(modules) if optim.name == "muon" else []
    hidden = {id(p) for part in parts for p in part}
    rest = [p for p in params if id(p) not in hidden]
    if optim.name == "muon":  # a momentum a hidden matrix, AdamW's two moments and step the rest
        rest_numel = sum(_local(p).numel() for p in rest)
        optim_bytes = (numel - rest_numel) * 4 + rest_numel * 8 + len(rest) * 4
    else:
        moments = {"adamw": 2, "sgd": 1 if optim.momentum else 0}[optim.name]
        steps = len(params) * 4 if optim.name == "adamw" else 0  # a float32 step a tensor
        optim_bytes = numel * 4 * moments + steps
    converted = _float8_weights(modules) if float8 else set()
    block = block_float8 = 0
    for m in modules:
        for layer in m.layers.values():
            size = sum(_full_local(p) for p in layer.parameters())
            if size > block:
                block = size
                block_float8 = sum(_full_local(p) for p in layer.parameters() if p in converted)
    float8 = sum(_local(p).numel() for p in converted)
    sent = sum(_fsdp_sent(p) for p in params)
    muon = _muon_costs(parts, optim) if hidden else (0, 0, 0)
    return _State(numel * 4, numel * 4, optim_bytes, float8 * 4, block, block_float8, sent, muon)


def _muon_params(modules: list[nn.Module]) -> list[list[nn.Parameter]]:
    """The hidden matrices of each model part (each part has its own Muon)."""
    from hp_runtime.train.optim import hidden_matrices

    return [hidden_matrices(m) for m in modules]


def _muon_costs(parts: list[list[nn.Parameter]], optim: Any) -> tuple[int, int, int]:
    """Muon's step on this rank: the bytes its gathers and scatters send (`muon.sent_elements`,
    the step's own window and owner rule, part by part); the step's own memory at its largest
    matrix: a whole one (a sharded matrix's gathered pieces, the matrix, its result and the
    pieces to scatter; a matrix held whole, its local experts: the matrix, its copy and its
    result) in the iteration's dtype, the iteration's two Gram matrices, and the float32
    updates of a window (about one whole matrix); and its iterations' FLOPs (a sharded matrix
    on one of its ranks: a share of them; ns_steps of 4 m^2 n + 2 m^3 for an m x n matrix,
    m <= n)."""
    from hp_runtime.train.muon import DTYPES, layouts_of, sent_elements

    muon = optim.muon_settings
    size = DTYPES[muon.ns_dtype].itemsize
    largest = step_flops = sent = 0
    for part in parts:
        layouts = layouts_of(part)
        sent += sent_elements(layouts) * size
        for p, layout in zip(part, layouts, strict=True):
            rows, cols = sorted(p.shape[-2:])
            stack = math.prod((p if layout else _local(p)).shape[:-2])  # whole: its own experts
            whole = stack * rows * cols
            held = (4 if layout else 3) * whole * size + 2 * rows * rows * size + 4 * whole
            largest = max(largest, held)
            ranks = math.prod(layout.sizes) if layout else 1  # its iteration on one of them
            step_flops += muon.ns_steps * stack * (4 * rows * rows * cols + 2 * rows**3) // ranks
    return sent, largest, step_flops


def _float8_weights(modules: list[nn.Module]) -> set[nn.Parameter]:
    """The weights of the linears `train.float8` converted (none without it)."""
    from hp_runtime.parallel.float8 import is_float8

    return {m.weight for root in modules for m in root.modules() if is_float8(m)}


def _gathered_shape(p: torch.Tensor) -> tuple[list[int], int]:
    """A parameter's shape on this rank once FSDP gathers it (TP's and EP's shards stay
    shards: FSDP gathers an expert's weights over the data-parallel ranks that hold it), and
    the ranks FSDP shards it over."""
    if not isinstance(p, DTensor):
        return list(p.shape), 1
    shape, names = list(p.shape), p.device_mesh.mesh_dim_names or ()
    fsdp = 1
    for mesh_dim, placement in enumerate(p.placements):
        if not (placement.is_shard() or hasattr(placement, "split_factor")):  # _StridedShard too
            continue
        if mesh_dim < len(names) and names[mesh_dim] in ("tp", "ep"):
            dim = placement.dim  # type: ignore[attr-defined]
            shape[dim] = math.ceil(shape[dim] / p.device_mesh.size(mesh_dim))
        else:
            fsdp *= p.device_mesh.size(mesh_dim)
    return shape, fsdp


def _full_local(p: torch.Tensor) -> int:
    """A parameter's elements on this rank once FSDP gathers it (`_gathered_shape`)."""
    return math.prod(_gathered_shape(p)[0])


def _fsdp_sent(p: torch.Tensor) -> int:
    """Elements a rank sends when FSDP gathers `p`: its shard (dim 0 padded to a multiple of
    the group, as FSDP2 pads it) to each other rank of the group."""
    shape, ranks = _gathered_shape(p)
    if ranks == 1 or not shape:
        return 0
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:]) * (ranks - 1)


class _FlashSaves(torch.autograd.Function):
    """Attention as FlashAttention keeps it on a GPU: q, k, v, the output and the float32
    log-sum-exp of each query (the CPU's kernels keep the s x s scores instead)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # never run
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@contextlib.contextmanager
def _flash_attention() -> Any:
    """SDPA counted as the GPU's flash kernel keeps it, for the trace's length."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda q, k, v, **_: _FlashSaves.apply(q, k, v)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def traced_activations(config: Config, layers: int) -> int:
    """Bytes autograd keeps for one micro-batch of the model cut to `layers` blocks, at this
    layout's local widths (embedding, head and loss included)."""
    m, p, t = config.model, config.parallel, config.train
    tp, cp, ep = p.tp, p.cp, p.ep
    moe = m.moe
    if moe is not None:  # this rank's experts; a dense layer first only where it has one
        experts = max(moe.experts // ep, moe.top_k)  # routed over them all (no groups)
        moe = replace(
            moe,
            experts=experts,
            first_dense_layers=min(moe.first_dense_layers, 1),
            groups=1,
            topk_groups=1,
        )
    local = replace(
        m,
        n_layers=layers,
        n_heads=m.n_heads // tp,
        n_kv_heads=m.n_heads // tp if m.mla is not None else max(m.n_kv_heads // tp, 1),
        head_dim=m.head_size if m.mla is None else None,
        ffn_hidden=m.ffn_hidden // tp,
        vocab_size=math.ceil(m.vocab_size / tp) if p.loss_parallel else m.vocab_size,
        moe=replace(moe, first_dense_layers=min(moe.first_dense_layers, layers - 1))
        if moe
        else None,
    )
    seq = config.data.seq_length // cp
    with torch.device("meta"):
        model = Transformer(local)
    if p.activation_checkpointing != "none":
        from hp_runtime.parallel.ac import apply_ac

        apply_ac(model, p.activation_checkpointing, p.ac_every)
    model.train()
    seen: set[int] = set()
    total = residual = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total, residual
        if id(tensor) not in seen:  # a tensor saved twice is kept once
            seen.add(id(tensor))
            nbytes = tensor.numel() * tensor.element_size()
            total += nbytes
            if tp > 1 and tensor.dim() >= 2 and tensor.shape[-1] == m.dim:
                residual += nbytes  # sequence parallel keeps a tp-th of the residual stream
        return tensor

    tokens = torch.zeros(t.micro_batch_size, seq, dtype=torch.long, device="meta")
    mixed = config.train.mixed_precision != "fp32"
    autocast: Any = contextlib.nullcontext()
    if mixed and p.dp_cp_size > 1:  # FSDP computes in its policy's bf16: the weights' dtype
        model.to(torch.bfloat16)
    elif mixed:  # one replica: autocast over fp32 weights, as train/setup.py `precision`
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    depth = local.mtp_depth  # multi-token prediction: its modules run too
    predict = torch.zeros(*tokens.shape, depth, dtype=torch.long, device="meta")
    mtp = {"mtp_tokens": predict, "mtp_labels": predict} if depth else {}
    with autocast, _flash_attention(), torch.autograd.graph.saved_tensors_hooks(pack, _same_x):
        model(tokens, labels=tokens, loss_chunk_tokens=t.loss_chunk_tokens, **mtp)
    return total - residual + residual // tp


def _same_x(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class Activations:
    """One micro-batch's saved bytes: a block's, the head and loss's, the input ids'."""

    block: int
    head: int
    tokens: int

    @classmethod
    def trace(cls, config: Config) -> Activations:
        one, two = traced_activations(config, 1), traced_activations(config, 2)
        block = two - one
        tokens = config.train.micro_batch_size * (config.data.seq_length // config.parallel.cp) * 8
        return cls(block, one - block - tokens, tokens)

    def stage(self, layers: int, first: bool, last: bool) -> int:
        return layers * self.block + (self.head if last else 0) + (self.tokens if first else 0)


def _stages(config: Config, dims: ParallelDims) -> list[tuple[int, int]]:
    """(pipeline rank, blocks it holds) of each pipeline rank."""
    p = config.parallel
    if dims.pp == 1:
        return [(0, config.model.n_layers)]
    sizes = layers_per_stage(config.model.n_layers, dims.pp * p.pp_virtual_stages, None)
    return [
        (r, sum(sizes[s] for s in range(r, dims.pp * p.pp_virtual_stages, dims.pp)))
        for r in range(dims.pp)
    ]


def rank_type(
    config: Config, dims: ParallelDims, world: int, rank: int, traced: Activations
) -> RankType:
    """One rank's shards, built over a fake process group of `world` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hp_runtime.parallel.assemble import shard_stages

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        p = config.parallel
        param_dtype = torch.bfloat16 if config.train.mixed_precision != "fp32" else None
        float8 = config.train.float8
        stages, mesh, _ = shard_stages(config.model, dims, "cpu", p, param_dtype, float8)
        modules = [module for _, module in stages]
        state = _state_bytes(modules, config.optim, float8 is not None)
        stage = mesh["pp"].get_local_rank() if dims.pp > 1 else 0  # type: ignore[index]
    finally:
        dist.destroy_process_group()
    layers = sum(len(module.layers) for module in modules)
    # the multi-token prediction modules' activations are the traced head's (`traced_activations`)
    blocks = sum(int(key) < config.model.n_layers for m in modules for key in m.layers)
    first = stage == 0  # the last stage's embedding (for its prediction modules) embeds no input
    last = any(module.output is not None for module in modules)
    activation = traced.stage(blocks, first, last)
    micro = batch_plan(config).accumulation
    in_flight = micro if p.pp_schedule == "gpipe" else min(micro, dims.pp - stage)
    compute = 2 if param_dtype is not None else 4
    gathered = 0
    if dims.dp_cp_size > 1:  # a block gathered, the next prefetched, and one's gradients
        gathered = state.block * (2 * compute + 4)
        if float8 is not None and float8.fsdp_all_gather:  # the converted gathered in float8
            gathered -= state.block_float8 * 2 * (compute - 1)
    peak = state.params + state.grads + state.optim + in_flight * activation + gathered
    sent, step, flops = state.muon
    peak = max(peak, state.params + state.grads + state.optim + step)  # the optimizer's step
    return RankType([rank], stage, layers, state.params, state.grads, state.optim, activation,
                    in_flight, gathered, peak, state.float8_params, state.sent, sent, step,
                    flops)  # fmt: skip


def representatives(config: Config, dims: ParallelDims, world: int) -> list[int]:
    """The first and last rank of each distinct pipeline stage (first, last, and one of each
    size of the middle ones): every other rank is one of them, shard for shard."""
    per_stage = world // dims.pp
    stages = _stages(config, dims)
    kinds: dict[tuple[int, bool, bool], int] = {}
    for stage, layers in stages:
        kinds.setdefault((layers, stage == 0, stage == dims.pp - 1), stage)
    ranks = []
    for stage in sorted(kinds.values()):
        ranks += [stage * per_stage, (stage + 1) * per_stage - 1]
    return sorted(set(ranks))


def plan(config: Config, world: int, gpu: str | None = None) -> dict[str, Any]:
    """The plan's report: per rank type its bytes (the stable fields `param_bytes`,
    `grad_bytes`, `optim_bytes`, `activation_bytes`, `peak_bytes`), the communication a rank
    sends per step per dimension, and with `gpu` the roofline's step time and MFU."""
    if world < 1:
        raise ConfigError(f"--world {world}: give the number of ranks, at least 1")
    device = GPUS.get(gpu) if gpu else None
    if gpu and device is None:
        raise ConfigError(f"--gpu {gpu}: choose one of {', '.join(GPUS)}")
    p = config.parallel
    dims = ParallelDims(
        dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep
    )
    try:
        dims.validate(world, config.model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    types: list[RankType] = []
    traced = Activations.trace(config)
    for rank in representatives(config, dims, world):
        kind = rank_type(config, dims, world, rank, traced)
        same = next((t for t in types if _same(t, kind)), None)
        if same is not None:
            same.ranks += kind.ranks
        else:
            types.append(kind)
    comm = communication(config, dims, types)
    report: dict[str, Any] = {
        "world": world,
        "layout": {
            k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
        },
        "micro_batches": batch_plan(config).accumulation,
        "rank_types": [t.json() for t in types],
        "communication_bytes": comm,
        "gpu": None,
    }
    if device is not None:
        report["gpu"] = {"name": device.name, "memory_bytes": int(device.memory_gib * GIB)}
        flops = max(t.muon_flops for t in types)
        report |= roofline(config, dims, world, comm, device, flops)
        for t in report["rank_types"]:
            t["fits"] = t["peak_bytes"] <= device.memory_gib * GIB
    return report


def _same(a: RankType, b: RankType) -> bool:
    keys = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "peak_bytes")
    return a.stage == b.stage and all(getattr(a, k) == getattr(b, k) for k in keys)


def communication(config: Config, dims: ParallelDims, types: list[RankType]) -> dict[str, int]:
    """Bytes a rank sends in a step, per dimension (ring algorithms: (n-1)/n of the data)."""
    m, t = config.model, config.train
    micro = batch_plan(config).accumulation
    compute = 2 if config.train.mixed_precision != "fp32" else 4
    shard = max(tt.param_bytes for tt in types) // 4  # the largest rank's parameter elements
    seq = config.data.seq_length // dims.cp
    activation = t.micro_batch_size * seq * m.dim * compute  # one residual-stream tensor
    layers = max(tt.layers for tt in types)
    out: dict[str, int] = {}
    f = dims.dp_shard * dims.cp
    if f > 1:  # per micro-batch: gather forward and backward, reduce-scatter the gradients
        sent = max(tt.fsdp_sent_elements for tt in types)
        out["fsdp"] = int(micro * sent * (2 * compute + 4))
        float8 = config.train.float8
        if float8 is not None and float8.fsdp_all_gather:  # those gathered a byte an element
            converted = max(tt.float8_param_bytes for tt in types) // 4
            out["fsdp"] -= int(micro * converted * (f - 1) * 2 * (compute - 1))
    if dims.dp_replicate > 1:
        r = dims.dp_replicate
        out["dp_replicate"] = int(2 * (r - 1) / r * shard * 4)
    if dims.tp > 1:  # sequence parallel: 2 gathers + 2 reduce-scatters a block, each way
        out["tp"] = int(micro * layers * 8 * activation * (dims.tp - 1) / dims.tp)
    if dims.cp > 1:  # ring attention: k and v around the ring, and their gradients back
        kv = t.micro_batch_size * seq * m.n_kv_heads * m.head_size * compute // max(dims.tp, 1)
        out["cp"] = int(micro * layers * 4 * kv * (dims.cp - 1))
    if dims.pp > 1:  # activations forward, their gradients back, a micro-batch each
        out["pp"] = int(micro * 2 * activation // dims.tp)
    if dims.ep > 1 and m.moe is not None:
        routed = t.micro_batch_size * seq * m.moe.top_k * m.dim * compute
        moe_layers = sum(m.is_moe_layer(i) for i in range(m.total_layers)) // dims.pp
        out["ep"] = int(micro * moe_layers * 4 * routed * (dims.ep - 1) / dims.ep)
    muon = max(tt.muon_sent_bytes for tt in types)
    if muon:  # once a step, in the optimizer's step: gathers to the owners, scatters back
        out["muon"] = muon
    return out


def _stride(dims: ParallelDims, name: str) -> int:
    order = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's, outermost first
    inner = order[order.index(name) + 1 :]
    return math.prod(getattr(dims, n) for n in inner)


def roofline(
    config: Config,
    dims: ParallelDims,
    world: int,
    comm: dict[str, int],
    gpu: Gpu,
    muon_flops: int = 0,
) -> dict[str, Any]:
    """Step time and MFU: compute at the peak, each dimension at its link, what overlaps;
    Muon's iterations (`muon_flops`, a rank's) are compute of the step, not model FLOPs."""
    m = config.model
    gbs = batch_plan(config).global_batch_size
    seq = config.data.seq_length
    flops = m.flops_per_token(seq) * gbs * seq / world  # a rank's share of the step
    p = config.parallel
    recompute = {"none": 0.0, "full": 1 / 3, "selective": 1 / (3 * p.ac_every)}
    # checkpointed blocks run their forward again (a third of a step's FLOPs): not model FLOPs
    compute_s = flops * (1 + recompute[p.activation_checkpointing]) / (gpu.bf16_tflops * 1e12)
    model_s = flops / (gpu.bf16_tflops * 1e12)
    seconds = {}
    for name, nbytes in comm.items():
        size = {"fsdp": dims.dp_shard * dims.cp, "dp_replicate": dims.dp_replicate}.get(
            name, getattr(dims, name, 1)
        )
        if name == "muon":  # over the ranks that shard a matrix: dp_shard x cp x tp
            inside = dims.dp_shard * dims.cp * dims.tp <= gpu.per_node
        else:
            stride = _stride(dims, "dp_shard" if name == "fsdp" else name) if name != "ep" else 1
            inside = size * stride <= gpu.per_node
        seconds[name] = nbytes / ((gpu.intra_gbps if inside else gpu.inter_gbps) * 1e9)
    overlapped = sum(seconds.get(n, 0.0) for n in ("fsdp", "dp_replicate", "cp"))
    exposed = sum(seconds.get(n, 0.0) for n in ("tp", "ep", "pp", "muon"))
    compute_s += muon_flops / (gpu.bf16_tflops * 1e12)
    bubble = (dims.pp - 1) / (batch_plan(config).accumulation * config.parallel.pp_virtual_stages)
    step = max(compute_s, overlapped) + exposed + bubble * compute_s
    return {
        "step_time_s": step,
        "compute_s": compute_s,
        "communication_s": seconds,
        "pipeline_bubble": bubble if dims.pp > 1 else 0.0,
        "tokens_per_s_per_device": gbs * seq / world / step,
        "mfu": model_s / step,
    }


def table(report: dict[str, Any]) -> str:
    layout = " x ".join(f"{k} {v}" for k, v in report["layout"].items() if v > 1) or "one rank"
    lines = [f"hp-train plan: {report['world']} ranks, {layout}, "
             f"{report['micro_batches']} micro-batches a step"]  # fmt: skip
    lines.append("ranks | stage | layers | params | grads | optimizer | activations x held | "
                 "peak (GiB)" + (" | fits" if report["gpu"] else ""))  # fmt: skip
    for t in report["rank_types"]:
        shown = ", ".join(map(str, t["ranks"][:4])) + (" ..." if len(t["ranks"]) > 4 else "")
        fits = (" | yes" if t["fits"] else " | NO") if report["gpu"] else ""
        lines.append(
            f"{shown} | {t['stage']} | {t['layers']} | {t['param_bytes'] / GIB:.2f} | "
            f"{t['grad_bytes'] / GIB:.2f} | {t['optim_bytes'] / GIB:.2f} | "
            f"{t['activation_bytes'] / GIB:.2f} x {t['in_flight']} | "
            f"{t['peak_bytes'] / GIB:.2f}{fits}"
        )
    comm = ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in report["communication_bytes"].items())
    lines.append(f"sent a step per rank: {comm or 'nothing'}")
    if report["gpu"]:
        lines.append(
            f"on {report['gpu']['name']}: step {report['step_time_s']:.3f} s (compute "
            f"{report['compute_s']:.3f} s), {report['tokens_per_s_per_device']:,.0f} tokens/s "
            f"a GPU, MFU {report['mfu']:.1%} (a roofline: an upper bound)"
        )
    else:
        lines.append("no time estimate: give --gpu (" + ", ".join(GPUS) + ")")
    return "\n".join(lines)
