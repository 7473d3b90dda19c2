"""Tensor parallel with sequence parallel, as one plan (Megatron-style column/row split).

Activations between blocks are sharded along the sequence (Shard(1)); each attention and
feed-forward input is gathered, the q/k/v and w1/w3 projections split by columns, wo and w2
by rows (reduce-scattered back to sequence shards). The output head gathers the sequence and
returns replicated logits (or, with loss_parallel, vocabulary-sharded ones).

A multi-token prediction module's norms and its projection of [embedding; hidden state] act
per token: replicated, on the sequence shards (as the norms), its block split as any other.

A MoE layer's feed-forward runs whole on every tp rank: its input gathered from the sequence
shards, the router, shared and routed experts replicated (each tp rank routes every token
alike; expert parallelism, not TP, splits the experts), and its output split back into the
sequence shards (a split, no sum; its backward gathers the identical gradients).

The per-head q and k norms (`qk_norm`) act on each rank's heads: their weights are replicated
DTensors over inputs sharded by head (SequenceParallel along dim 2), so that their gradients,
each rank's part from its own heads, are summed over the tp group.

Latent attention (`model/mla.py`) splits its heads the same way: the query projection
(`wq`, or `wq_b` after the replicated `wq_a` and `q_norm`) and `wkv_b` by columns, `wo` by
rows; `wkv_a` and `kv_norm`, whose latent every head reads, run whole on each rank on the
gathered sequence. Their gradients must be whole too: the latent's arrive summed over the
ranks' heads through `wkv_b`'s input, but the rotated key `wkv_a` also makes is shared by
every head and used on each rank by its own heads only, so its gradient columns are summed
over the tp group where `wkv_a`'s output meets autograd (`_SumRopeGrad`).

With `reduce_dtype` (float32 under bf16 parameters) the row-wise projections keep their
partial products in that dtype: the local matmul writes fp32, the partial sums are
reduce-scattered in fp32 and rounded to bf16 once, after the sum, instead of rounding every
rank's partial and then the sum. torch's `RowwiseParallel` has no such option.

Under float8's tensorwise recipe the converted linears take torchao's float8 styles: their
inputs are cast to float8 before the all-gather (once for q, k and v, once for w1 and w3),
their output gradients before the reduce-scatter, which halves TP's activation traffic. The
rowwise recipes keep torch's styles (torchao's float8 styles assume one scale a tensor), and so
does gloo, which has no float8 dtype: there the linear casts after the gather, with the same
scale (the amax of the whole gathered tensor either way).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hp_runtime.model.llama import MTPLayer
from hp_runtime.model.mla import LatentAttention
from hp_runtime.model.moe import MoE, compute_dtype
from hp_runtime.parallel.float8 import is_float8

# The linears split by rows (their input's last dimension), whose partial sums are reduced:
# the plan's `rowwise` ones below.
ROW_WISE = ("attention.wo", "feed_forward.w2")


class _PartialProduct(torch.autograd.Function):
    """`x @ w.T` in the compute dtype (bf16 under autocast or bf16 parameters) with the
    result kept in `out_dtype`; the backward runs in the compute dtype as usual."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        compute = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc, wc = x.to(compute), w.to(compute)
            ctx.save_for_backward(xc, wc)
            ctx.dtypes = (x.dtype, w.dtype, compute)
            flat = xc.reshape(-1, xc.shape[-1])
            if flat.is_cuda and compute in (torch.bfloat16, torch.float16):
                out = torch.mm(flat, wc.t(), out_dtype=out_dtype)  # fp32 accumulator kept
            else:
                out = flat.to(out_dtype) @ wc.to(out_dtype).t()  # exact products of bf16 values
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        xc, wc = ctx.saved_tensors
        x_dtype, w_dtype, compute = ctx.dtypes
        g = grad.to(compute)
        grad_x = (g @ wc).to(x_dtype)
        grad_w = g.reshape(-1, g.shape[-1]).t() @ xc.reshape(-1, xc.shape[-1])
        return grad_x, grad_w.to(w_dtype), None


class RowwiseParallelReduced(RowwiseParallel):
    """`RowwiseParallel` for an `nn.Linear` whose partial sums are reduced in `reduce_dtype`
    and cast back to the compute dtype after the reduction."""

    def __init__(self, *, reduce_dtype: torch.dtype, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.reduce_dtype = reduce_dtype

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        reduce_dtype, layouts = self.reduce_dtype, self.output_layouts

        def forward(self: nn.Module, x: DTensor) -> DTensor:
            local = _PartialProduct.apply(x.to_local(), self.weight.to_local(), reduce_dtype)
            compute = compute_dtype(x.to_local())
            partial = DTensor.from_local(local, x.device_mesh, [Partial()], run_check=False)
            return partial.redistribute(placements=layouts).to(compute)

        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
        return module


class _SumRopeGrad(torch.autograd.Function):
    """Identity forward; the backward sums columns `start:` of the gradient (the rotated key's,
    used by each rank's own heads) over the tp group, leaving the latent's (summed already)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        rope = grad[..., ctx.start :].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        return torch.cat((grad[..., : ctx.start], rope), dim=-1), None, None


def _attention_plan(attention: nn.Module, styles: _Styles) -> dict[str, object]:
    """Grouped-query attention's heads split (see above); the per-head q and k norms on each
    rank's heads (dim 2)."""
    plan: dict[str, object] = {
        "attention": styles.prepare(
            attention,
            ("wq", "wk", "wv"),
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "attention.wq": styles.colwise(attention.wq),
        "attention.wk": styles.colwise(attention.wk),
        "attention.wv": styles.colwise(attention.wv),
        "attention.wo": styles.rowwise(attention.wo),
    }
    if attention.q_norm is not None:
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _latent_attention_plan(
    attention: LatentAttention, styles: _Styles, mesh: DeviceMesh
) -> dict[str, object]:
    """MLA's heads split (see above); the input gathered and handed on as a plain tensor, which
    the replicated `wq_a` and `wkv_a` take."""
    group, start = mesh.get_group(), attention.kv_rank
    attention.wkv_a.register_forward_hook(
        lambda _module, _args, out: _SumRopeGrad.apply(out, start, group)
    )
    query = "wq" if attention.wq is not None else "wq_b"
    return {
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        f"attention.{query}": styles.colwise(attention.get_submodule(query)),
        "attention.wkv_b": styles.colwise(attention.wkv_b),
        "attention.wo": styles.rowwise(attention.wo),
    }


class _Styles:
    """Each linear's TP style: torchao's float8 ones for the linears converted to the
    tensorwise recipe (when `float8_tensorwise`), else torch's (`RowwiseParallelReduced` for
    the row-wise ones under `reduce_dtype`)."""

    def __init__(self, float8_tensorwise: bool, reduce_dtype: torch.dtype | None) -> None:
        self.float8_tensorwise, self.reduce_dtype = float8_tensorwise, reduce_dtype

    def float8(self, *linears: nn.Module) -> bool:
        return self.float8_tensorwise and all(is_float8(linear) for linear in linears)

    def colwise(self, linear: nn.Module) -> ColwiseParallel:
        if self.float8(linear):
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

            return Float8ColwiseParallel()
        return ColwiseParallel()

    def rowwise(self, linear: nn.Module) -> RowwiseParallel:
        if self.float8(linear):
            from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

            return Float8RowwiseParallel(output_layouts=Shard(1))
        if self.reduce_dtype is None:
            return RowwiseParallel(output_layouts=Shard(1))
        return RowwiseParallelReduced(output_layouts=Shard(1), reduce_dtype=self.reduce_dtype)

    def prepare(self, module: nn.Module, linears: tuple[str, ...], **layouts: object) -> object:
        """The input gathered for `linears`: in float8 when all of them are."""
        if self.float8(*(module.get_submodule(name) for name in linears)):
            from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

            return PrepareFloat8ModuleInput(**layouts, fwd_config_submodule_fqn=linears[0])
        return PrepareModuleInput(**layouts)


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    loss_parallel: bool = False,
    reduce_dtype: torch.dtype | None = None,
    float8_tensorwise: bool = False,
) -> None:
    """Shard `model` (a hp_runtime Transformer or a pipeline stage of one) over `mesh`;
    `reduce_dtype` reduces the row-wise projections' partial sums in that dtype;
    `float8_tensorwise`: the linears converted to float8's tensorwise recipe move float8."""
    styles = _Styles(float8_tensorwise, reduce_dtype)
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, mesh, top)  # type: ignore[arg-type]
    for block in model.layers.values():
        ffn: dict[str, object] = {}
        if not isinstance(block.feed_forward, MoE):
            dense = block.feed_forward
            ffn = {
                "feed_forward": styles.prepare(
                    dense,
                    ("w1", "w3"),
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                ),
                "feed_forward.w1": styles.colwise(dense.w1),
                "feed_forward.w2": styles.rowwise(dense.w2),
                "feed_forward.w3": styles.colwise(dense.w3),
            }
        else:  # whole on every tp rank (see above)
            ffn = {
                "feed_forward": PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=(Replicate(),),
                    desired_output_layouts=(Shard(1),),
                )
            }
        attention = block.attention
        if isinstance(attention, LatentAttention):
            heads = _latent_attention_plan(attention, styles, mesh)
        else:
            heads = _attention_plan(attention, styles)
        plan = {
            "attention_norm": SequenceParallel(),
            **heads,
            "ffn_norm": SequenceParallel(),
            **ffn,
        }
        if isinstance(block, MTPLayer):  # per token, replicated, on the sequence shards
            plan |= {
                "enorm": SequenceParallel(),
                "hnorm": SequenceParallel(),
                "eh_proj": SequenceParallel(use_local_output=True),  # the residual: local
                "head_norm": SequenceParallel(),
            }
        parallelize_module(block, mesh, plan)  # type: ignore[arg-type]
    # parallelize_module replaces the two parameters of a tied embedding: tie them again.
    if hasattr(model, "tie_weights"):
        model.tie_weights()
