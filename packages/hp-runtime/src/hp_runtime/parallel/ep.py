"""Expert parallelism: each MoE layer's experts sharded over the `ep` ranks, tokens sent to them.

The `ep` ranks of a group are data-parallel ranks (carved out of dp_shard, `mesh.py`): each
routes its own tokens, and holds `experts / ep` of every MoE layer's experts (its stacked
weights' rows, Shard(0) over the "ep" dim of the expert mesh). `Experts.kernel` is wrapped to
dispatch and combine around the local computation:

1. the tokens per expert go to every rank (an all_to_all of the counts), so each rank knows
   how many rows it sends to and receives from each other rank;
2. the rows, grouped by expert (so by owning rank), go to their experts' ranks in one
   `all_to_all_single` with those variable splits: a rank receives them as
   [source rank][local expert], and regroups them to [local expert][source rank];
3. the wrapped kernel runs on the local experts' weights; its outputs are put back in the
   order they arrived in and go back to their ranks in the reverse `all_to_all_single`.

Nothing is padded or dropped, so the result is one process's. The rows' two exchanges are
differentiable: the backward sends the gradients back the same way, and the expert weights'
gradients sum over every rank's tokens (FSDP then averages them like the dense ones,
`fsdp.py`).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hp_runtime.model.moe import ExpertKernel, Experts

EXPERT_PARAMS = ("w1", "w2", "w3")  # `Experts`' stacked weights, experts along dim 0


class ExpertDispatch:
    """`Experts.kernel` under expert parallelism: the wrapped kernel on this rank's experts and
    the rows every rank of `mesh` (the 1-D "ep" mesh) routed to them."""

    def __init__(self, kernel: ExpertKernel, mesh: DeviceMesh) -> None:
        self.kernel, self.mesh, self.size = kernel, mesh, mesh.size()

    def regroup(self, received: torch.Tensor, rows: int) -> torch.Tensor:
        """The order that sorts `rows` received rows from [source rank][local expert] to
        [local expert][source rank] (stable: a source's rows keep their order), from the
        counts `received` (ep, local experts). On the device: no host sync."""
        local = received.shape[1]
        expert = torch.arange(received.numel(), device=received.device) % local
        segments = expert.repeat_interleave(received.reshape(-1), output_size=rows)
        return segments.argsort(stable=True)

    def __call__(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        w1: DTensor,
        w2: DTensor,
        w3: DTensor,
    ) -> torch.Tensor:
        weights = [w.to_local() for w in (w1, w2, w3)]  # DTensors: `apply_ep` made them
        size, local = self.size, weights[0].shape[0]
        # received[s, l]: the rows rank s sends this rank's expert l.
        received = funcol.all_to_all_single(counts, None, None, self.mesh).view(size, local)
        # all_to_all_single takes its splits as Python ints: this is the one host sync of the
        # dispatch (torchtitan's too); sent and received splits in one read.
        splits = torch.cat((counts.view(size, local).sum(1), received.sum(1))).tolist()
        send, recv = splits[:size], splits[size:]
        rows = funcol.all_to_all_single_autograd(x, recv, send, self.mesh)
        order = self.regroup(received, sum(recv))
        out = self.kernel(rows[order], received.sum(0), *weights)
        back = torch.empty_like(out).index_copy_(0, order, out)  # [source rank][local expert]
        return funcol.all_to_all_single_autograd(back, send, recv, self.mesh)


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard the experts of every MoE layer of `model` (a Transformer or a pipeline stage of
    one, on meta, after TP) over `mesh`, the 1-D "ep" dim of the expert mesh, and wrap their
    kernels to dispatch tokens to the ranks that own them."""
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        for name in EXPERT_PARAMS:
            param = getattr(module, name)  # experts % ep: ParallelDims.validate
            sharded = distribute_tensor(param.data, mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        module.kernel = ExpertDispatch(module.kernel, mesh)
