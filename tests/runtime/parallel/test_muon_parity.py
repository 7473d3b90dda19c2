"""Muon on every layout equals one process: FSDP 2, TP 2, FSDP 2 x TP 2, PP 2, CP 2 and a MoE
model at EP 2, ten steps within 1e-5 (the iteration in float32: in bfloat16 another layout's
order of sums, one float32 step, grows past that, as it does for torch's own Muon).
Orthogonalising each rank's shard instead of the whole matrix fails the same comparison. One
step of the sharded optimizer equals one process's to the bit, in bfloat16, for each kind of
placement."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.runtime.parallel import test_ep, test_parity
from tests.runtime.parallel.test_ep import SOFTMAX_BIAS
from tests.runtime.parallel.test_parity import _compare_params
from tests.runtime.parity import train

PP = {"schedule": "1f1b", "microbatches": 2}
LAYOUTS = {  # name: (world size, ParallelDims, model overrides, pipeline options)
    "fsdp2": (2, {"dp_shard": 2}, {}, None),
    "tp2": (2, {"tp": 2}, {}, None),
    "fsdp2xtp2": (4, {"dp_shard": 2, "tp": 2}, {}, None),
    "pp2": (2, {"pp": 2}, {}, PP),
    "ep2": (2, {"dp_shard": 2, "ep": 2}, {"moe": SOFTMAX_BIAS}, None),
    "cp2": (2, {"cp": 2}, {}, None),  # FSDP over dp_shard x cp: a flattened mesh dim
}


def _compare(results: list[dict], reference: dict) -> None:
    """Losses and gradient norms within 1e-5 (relative) at every step; the final weights
    within 1e-4 (AdamW's update of a near-zero gradient of the head, g / sqrt(v), moves an
    element by 1e-5 for a float32 step of its gradient)."""
    for result in results:
        for key in ("losses", "norms"):
            assert result[key] == pytest.approx(reference[key], rel=1e-5), key
    _compare_params(results, reference, 1e-4)


def single(overrides: dict) -> dict:
    """One process's run (cached), a MoE model's as the expert-parallel tests run it."""
    if "moe" in overrides:
        moe = overrides["moe"]
        return test_ep.single("muon", moe, test_ep.micro_batches(moe, {}, None))
    return test_parity.single("muon", overrides)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_layout_matches_one_process(layout):
    world, dims, overrides, pipeline = LAYOUTS[layout]
    results = run_ranks(train, world, dims, "muon", overrides, pipeline)
    _compare(results, single(overrides))


def test_orthogonalising_each_shard_is_caught():
    """The negative control: each rank's shard orthogonalised alone is another optimizer."""
    world, dims, overrides, _ = LAYOUTS["fsdp2"]
    results = run_ranks(train, world, dims, "muon", overrides, {"per_shard": True})
    with pytest.raises(AssertionError):
        _compare(results, single(overrides))


def _placements() -> dict[str, tuple[tuple[int, ...], list]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {  # name: (mesh shape, placements)
        "fsdp4": ((4,), [Shard(0)]),
        "tp4-rowwise": ((4,), [Shard(1)]),
        "fsdp2xtp2-colwise": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
        "fsdp2xtp2-rowwise": ((2, 2), [Shard(0), Shard(1)]),
        "hsdp2x2": ((2, 2), [Replicate(), Shard(0)]),
        "tp2-replicated": ((2, 2), [Shard(1), Replicate()]),
    }


# Whole matrices (uneven splits, tall and wide) and a stack of experts, more than the ranks
# (two windows of owners).
SHAPES = [(10, 7), (6, 12), (13, 5), (8, 8), (4, 6, 10), (3, 9)]


def _step_bits(rank: int, world: int, name: str) -> list[bool]:
    """Three steps of hp's Muon on shards against one process on whole tensors: equal bits."""
    from hp_runtime.train.config.schema import Muon as Settings
    from hp_runtime.train.muon import Muon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    shape, placements = _placements()[name]
    mesh = init_device_mesh("cpu", shape)
    generator = torch.Generator().manual_seed(5)
    full = [torch.randn(s, generator=generator) for s in SHAPES]
    grads = [[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(3)]
    settings = Settings(lr=0.05, weight_decay=0.1, adjust_lr="match_rms_adamw")

    def distribute(t: torch.Tensor) -> torch.Tensor:
        if name != "fsdp2xtp2-colwise":
            return distribute_tensor(t, mesh, placements)

        # FSDP's shard of TP's shard, as fully_shard makes it over a column-wise linear
        def chunk(x: torch.Tensor, i: int) -> torch.Tensor:  # torch.chunk's, empty past its end
            pieces = x.chunk(2)
            return pieces[i] if i < len(pieces) else x[:0]

        local = chunk(chunk(t, mesh.get_local_rank(1)), mesh.get_local_rank(0))
        return DTensor.from_local(local, mesh, placements, shape=t.shape, stride=t.stride())

    whole = [torch.nn.Parameter(t.clone()) for t in full]
    sharded = [torch.nn.Parameter(distribute(t)) for t in full]
    one, many = Muon(whole, settings), Muon(sharded, settings)
    for step in grads:
        for p, q, g in zip(whole, sharded, step, strict=True):
            p.grad, q.grad = g.clone(), distribute(g)
        one.step()
        many.step()
    return [
        torch.equal(p.detach(), q.full_tensor().detach())
        for p, q in zip(whole, sharded, strict=True)
    ]


@pytest.mark.parametrize("name", list(_placements()))
def test_a_sharded_step_equals_one_process_to_the_bit(name):
    """bfloat16, torch's dtype: the gather, the owners and the scatter change no bit."""
    for equal in run_ranks(_step_bits, 4, name):
        assert equal == [True] * len(SHAPES)
