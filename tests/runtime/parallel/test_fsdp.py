"""`fsdp_reshard_after_forward`: "never" keeps each block's gathered parameters from forward
to backward, "always" frees them; both compute the same loss and gradients."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from hp_runtime.model import preset
from hp_runtime.parallel import ParallelDims, ParallelOptions, assemble

from tests.helpers.distributed import run_ranks


def _forward_backward(rank: int, world: int) -> dict[str, tuple[bool, float, np.ndarray]]:
    from torch.distributed.tensor import DTensor

    config = preset("tiny")
    tokens = torch.randint(
        0, config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0)
    )
    local = tokens.chunk(world)[rank]
    out = {}
    for policy in ("always", "never"):
        options = ParallelOptions(fsdp_reshard_after_forward=policy)
        assembly = assemble(
            config, ParallelDims(dp_shard=world), torch.device("cpu"), seed=3, options=options
        )
        logits = assembly.model(local[:, :-1])
        # Between forward and backward: the first block's weight as FSDP left it.
        sharded = isinstance(assembly.model.layers["0"].attention.wq.weight, DTensor)
        loss = F.cross_entropy(logits.flatten(0, 1), local[:, 1:].flatten())
        loss.backward()
        grads = [p.grad.to_local().reshape(-1) for p in assembly.parameters]
        out[policy] = (sharded, float(loss), torch.cat(grads).numpy().copy())
    return out


def test_never_keeps_the_gathered_blocks_and_computes_the_same():
    for rank in run_ranks(_forward_backward, 2):
        assert rank["always"][0] and not rank["never"][0]  # freed after forward, and kept
        assert rank["always"][1] == rank["never"][1]
        np.testing.assert_array_equal(rank["always"][2], rank["never"][2])
