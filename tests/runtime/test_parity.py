"""Every parallel layout trains exactly like one process (CPU, gloo, real process groups)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.distributed import run_ranks
from tests.runtime.parity import train

LAYOUTS = {
    "fsdp2": (2, {"dp_shard": 2}, {}),
    "hsdp2x2": (4, {"dp_replicate": 2, "dp_shard": 2}, {}),
    "tp2": (2, {"tp": 2}, {}),
    "tp2-tied": (2, {"tp": 2}, {"tie_embeddings": True}),
    "fsdp2-tied": (2, {"dp_shard": 2}, {"tie_embeddings": True}),
    "fsdp2xtp2": (4, {"dp_shard": 2, "tp": 2}, {}),
}


@pytest.fixture(scope="module")
def single():
    return {
        (opt, tied): train(0, 1, None, opt, {"tie_embeddings": tied})
        for opt in ("sgd", "adamw")
        for tied in (False, True)
    }


def _compare(result, reference, loss_rtol, param_atol=None):
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert got == pytest.approx(want, rel=loss_rtol), f"step {step}: {got} vs {want}"
    if param_atol is not None:
        assert result["params"].keys() == reference["params"].keys()
        for name, want in reference["params"].items():
            np.testing.assert_allclose(
                result["params"][name], want, atol=param_atol, rtol=0, err_msg=name
            )


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, single):
    world, dims, overrides = LAYOUTS[layout]
    tied = overrides.get("tie_embeddings", False)
    sgd = run_ranks(train, world, dims, "sgd", overrides)
    for result in sgd:
        _compare(result, single["sgd", tied], 1e-5, 1e-5)
    adamw = run_ranks(train, world, dims, "adamw", overrides)
    _compare(adamw[0], single["adamw", tied], 1e-3)


def test_single_process_training_learns(single):
    losses = single["sgd", False]["losses"]
    assert losses[-1] < losses[0]
