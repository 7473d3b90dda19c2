"""Muon on every layout equals one process: FSDP 2, TP 2, FSDP 2 x TP 2, PP 2 and a MoE model
at EP 2, ten steps within 1e-5 (the iteration in float32: in bfloat16 another layout's order
of sums, one float32 step, grows past that, as it does for torch's own Muon). Orthogonalising
each rank's shard instead of the whole matrix fails the same comparison. One step of the
sharded optimizer equals one process's to the bit, in bfloat16, for each kind of placement."""

from __future__ import annotations

import pytest

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
