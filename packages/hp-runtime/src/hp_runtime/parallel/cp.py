"""Context parallelism: each sample's sequence split over the `cp` ranks, attention over all of it.

The sequence is cut into 2N chunks and rank r keeps chunks r and 2N-1-r (Megatron's and
torchtitan's load balance: under the causal mask an early chunk attends few keys and a late one
many, so every rank's pair costs the same). Every layer but attention works per token and runs
on the local rows as it is. Attention gathers the keys and values of the whole sequence over
the cp group and calls the local kernel with the global rows of its queries (`Layout.rows`,
which also rotate q and k by their global positions): Llama 3's all-gathered K/V, under which a
query sees every key the mask allows, so document masking needs nothing more. The gather's
backward reduce-scatters the keys' and values' gradients back to the ranks that hold them.

A micro-batch keeps its tokens, labels and loss mask at the local rows; its position ids stay
whole (the model numbers documents over the whole sequence) and its `rows` travel with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_runtime.model.attention import Layout

# a micro-batch's per-row tensors, (b, s) each (the multi-token prediction's (b, s, depth))
SHARDED = ("tokens", "labels", "loss_mask", "mtp_tokens", "mtp_labels")

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Layout], torch.Tensor]


def chunk_rows(
    seq_len: int, rank: int, size: int, device: torch.device | None = None
) -> torch.Tensor:
    """The global rows that rank `rank` of `size` keeps of a `seq_len` sequence: chunks
    `rank` and `2 size - 1 - rank` of `2 size` equal chunks, in that order."""
    if seq_len % (2 * size):
        raise ValueError(
            f"a sequence of {seq_len} does not divide into 2 x cp = {2 * size} equal chunks"
        )
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat((first, first + (2 * size - 1 - 2 * rank) * chunk))


class ContextParallel:
    """The plan on one rank: which rows it keeps, and the gather of the whole sequence over
    `mesh` (the 1-D "cp" mesh). Index tensors are made once per length and device."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.rank = mesh.get_local_rank()
        self.size = mesh.size()
        self._rows: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._order: dict[tuple[int, torch.device], torch.Tensor] = {}

    def rows(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(seq_len / cp,) this rank's global rows, a LongTensor on `device`."""
        key = (seq_len, device)
        if key not in self._rows:
            self._rows[key] = chunk_rows(seq_len, self.rank, self.size, device)
        return self._rows[key]

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's share of a micro-batch: `SHARDED` at its rows, the rest whole, and the
        rows themselves as `rows`."""
        rows = self.rows(batch["tokens"].shape[1], batch["tokens"].device)
        kept = {k: v.index_select(1, rows) if k in SHARDED else v for k, v in batch.items()}
        return {**kept, "rows": rows}

    def _global_order(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Where each global row lies in the ranks' rows laid end to end."""
        key = (seq_len, device)
        if key not in self._order:
            every = [chunk_rows(seq_len, r, self.size, device) for r in range(self.size)]
            self._order[key] = torch.cat(every).argsort()
        return self._order[key]

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence, in global row order, from every rank's rows of `x` along `dim`
        (differentiable: the backward sums each row's gradient onto the rank that holds it)."""
        local = x.movedim(dim, 0).contiguous()
        gathered = funcol.all_gather_single(local, 0, self.mesh)  # ranks' rows end to end
        order = self._global_order(gathered.shape[0], x.device)
        return gathered.index_select(0, order).movedim(0, dim)


class GatheredKV:
    """`Attention.kernel` under context parallelism: the wrapped kernel on the local queries
    and the keys and values of the whole sequence (k and v come with their own heads, so a
    grouped-query head is gathered once)."""

    def __init__(self, kernel: Kernel, plan: ContextParallel) -> None:
        self.kernel, self.plan = kernel, plan

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout
    ) -> torch.Tensor:
        if layout.rows is None:
            raise ValueError("context parallelism: call the model with the rows it holds (rows=)")
        whole = self.plan.gather(torch.stack((k, v)), dim=3)  # (2, b, kv heads, s, head dim)
        return self.kernel(q, whole[0], whole[1], layout)


def apply_cp(model: nn.Module, plan: ContextParallel) -> None:
    """Wrap the attention kernel of every block of `model` (a Transformer or a pipeline stage
    of one, after TP and before activation checkpointing)."""
    for block in model.layers.values():
        block.attention.kernel = GatheredKV(block.attention.kernel, plan)
