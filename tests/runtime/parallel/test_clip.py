"""Gradient clipping fit for GPUs: one collective per placement group, not one per parameter,
and a norm equal to one process's."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hp_runtime.model import preset
from hp_runtime.parallel import ParallelDims, assemble
from hp_runtime.parallel.clip import clip_grad_norm, sum_of_squares

from tests.helpers.distributed import run_ranks


def _norm_and_collectives(rank: int, world: int, dims: dict[str, int]) -> tuple[float, int, int]:
    from torch.distributed.tensor.debug import CommDebugMode

    config = preset("tiny")
    assembly = assemble(config, ParallelDims(**dims), torch.device("cpu"), seed=3)
    tokens = torch.randint(
        0, config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0)
    )
    local = tokens.chunk(assembly.dp_size)[assembly.dp_rank]
    logits = assembly.model(local[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), local[:, 1:].flatten()).backward()
    with CommDebugMode() as comm:
        norm = clip_grad_norm(assembly.parameters, max_norm=1e9)
    return float(norm), comm.get_total_counts(), len(assembly.parameters)


def test_one_collective_per_placement_group_and_the_single_process_norm():
    reference, _, _ = _norm_and_collectives(0, 1, {})
    for dims, world in (({"dp_shard": 2}, 2), ({"tp": 2}, 2)):
        for norm, collectives, params in run_ranks(_norm_and_collectives, world, dims):
            assert abs(norm - reference) <= 1e-5 * reference, (dims, norm, reference)
            # FSDP: every gradient Shard(0) on one mesh, one reduction. TP: a few placement
            # groups (column, row, replicated norms, embedding), still far fewer than the
            # parameters (one full_tensor() each before).
            assert collectives <= 4 < params, (dims, collectives, params)


def test_sum_of_squares_is_the_exact_float64_sum_over_pieces():
    """Tensors longer than one piece, a remainder, a transposed view and an empty one: equal
    to the correctly rounded sum of the squares (each float32 square is exact in float64)."""
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3 * 65536 + 17, generator=generator) * 1e-3,
        torch.randn(300, 70, generator=generator).t(),
        torch.randn(5, generator=generator) * 1e3,
        torch.zeros(0),
    ]
    exact = math.fsum(x * x for t in tensors for x in t.double().flatten().tolist())
    assert abs(float(sum_of_squares(tensors)) - exact) <= 1e-12 * exact
    float32 = float(torch.stack(torch._foreach_norm(tensors, 2)).double().square().sum())
    assert abs(float32 - exact) > 1e-12 * exact  # the check can tell float32 from float64
