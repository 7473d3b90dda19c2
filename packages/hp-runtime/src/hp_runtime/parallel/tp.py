"""Tensor parallel with sequence parallel, as one plan (Megatron-style column/row split).

Activations between blocks are sharded along the sequence (Shard(1)); each attention and
feed-forward input is gathered, the q/k/v and w1/w3 projections split by columns, wo and w2
by rows (reduce-scattered back to sequence shards). The output head gathers the sequence and
returns replicated logits (or, with loss_parallel, vocabulary-sharded ones).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tp(model: nn.Module, mesh: DeviceMesh, loss_parallel: bool = False) -> None:
    """Shard `model` (a hp_runtime Transformer or a pipeline stage of one) over `mesh`."""
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
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, mesh, plan)  # type: ignore[arg-type]
    # parallelize_module replaces the two parameters of a tied embedding: tie them again.
    if hasattr(model, "tie_weights"):
        model.tie_weights()
