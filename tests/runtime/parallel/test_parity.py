"""Every parallel layout trains exactly like one process (CPU, gloo, real process groups).

Ten optimizer steps with gradient-norm clipping on the same data from the same seed: per-step
losses and gradient norms within 1e-5 relative and final full parameters within 1e-5 with SGD;
losses within 1e-3 with AdamW for one layout of each kind (the optimizer acts on local shards
the same way in every layout, and CI's time is better spent on the strict SGD comparison).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.distributed import run_ranks
from tests.runtime.parity import MAX_NORM, train

TIED = {"tie_embeddings": True}
# name: (world size, ParallelDims, model overrides, pipeline options)
LAYOUTS = {
    "fsdp2": (2, {"dp_shard": 2}, {}, None),
    "hsdp2x2": (4, {"dp_replicate": 2, "dp_shard": 2}, {}, None),
    "tp2": (2, {"tp": 2}, {}, None),
    "tp2-tied": (2, {"tp": 2}, TIED, None),
    # per-head q and k norms (Qwen3): each rank's heads give part of their weights' gradient
    "tp2-qk-norm": (2, {"tp": 2}, {"qk_norm": True}, None),
    "tp2-loss-parallel": (2, {"tp": 2}, {}, {"loss_parallel": True}),
    "fsdp2-tied": (2, {"dp_shard": 2}, TIED, None),
    "fsdp2xtp2": (4, {"dp_shard": 2, "tp": 2}, {}, None),
    "fsdp2-ac-full": (2, {"dp_shard": 2}, {}, {"ac": "full"}),
    "tp2-ac-selective": (2, {"tp": 2}, {"n_layers": 4}, {"ac": "selective"}),
    "fsdp2-compile": (2, {"dp_shard": 2}, {}, {"compile": True}),
    "pp2-gpipe": (2, {"pp": 2}, {}, {"schedule": "gpipe"}),
    "pp2-1f1b": (2, {"pp": 2}, {}, {"schedule": "1f1b"}),
    "pp2-interleaved": (
        2,
        {"pp": 2},
        {"n_layers": 4},
        {"schedule": "interleaved1f1b", "virtual_stages": 2},
    ),
    "pp2-tied": (2, {"pp": 2}, TIED, {"schedule": "1f1b"}),
    "fsdp2xpp2-tied": (4, {"dp_shard": 2, "pp": 2}, TIED, {"schedule": "1f1b"}),
    "tp2xpp2-tied": (4, {"tp": 2, "pp": 2}, TIED, {"schedule": "gpipe"}),
    "cp2": (2, {"cp": 2}, {}, None),
    "cp4": (4, {"cp": 4}, {}, None),
    "fsdp2xcp2": (4, {"dp_shard": 2, "cp": 2}, {}, None),
    "cp2xtp2": (4, {"cp": 2, "tp": 2}, {}, None),
    "cp2xpp2-tied": (4, {"cp": 2, "pp": 2}, TIED, {"schedule": "1f1b"}),
}

# Packed documents, masked: through a pipeline the position ids travel with the activations,
# under context parallelism they stay whole on every rank.
# name: (world size, ParallelDims, model overrides, pipeline options, documents)
DOCUMENT_LAYOUTS = {
    "pp2-1f1b-mask": (2, {"pp": 2}, {}, {"schedule": "1f1b"}, "mask"),
    "pp3-gpipe-mask": (3, {"pp": 3}, {"n_layers": 3}, {"schedule": "gpipe"}, "mask"),
    "pp2-interleaved-mask": (
        2,
        {"pp": 2},
        {"n_layers": 4},
        {"schedule": "interleaved1f1b", "virtual_stages": 2},
        "mask",
    ),
    "pp3-1f1b-tied-reset": (
        3,
        {"pp": 3},
        {"n_layers": 3, **TIED},
        {"schedule": "1f1b", "microbatches": 4},
        "reset",
    ),
    "fsdp2xpp2-tied-mask": (4, {"dp_shard": 2, "pp": 2}, TIED, {"schedule": "1f1b"}, "mask"),
    "tp2xpp2-mask": (4, {"tp": 2, "pp": 2}, {}, {"schedule": "gpipe"}, "mask"),
    "cp2-mask": (2, {"cp": 2}, {}, None, "mask"),
    "cp4-mask": (4, {"cp": 4}, {}, None, "mask"),
    "fsdp2xcp2-tied-mask": (4, {"dp_shard": 2, "cp": 2}, TIED, None, "mask"),
    "cp2xtp2-mask": (4, {"cp": 2, "tp": 2}, {}, None, "mask"),
    "cp2xpp2-mask": (4, {"cp": 2, "pp": 2}, {}, {"schedule": "gpipe"}, "mask"),
}

ADAMW = {"hsdp2x2", "fsdp2xtp2", "pp2-tied", "tp2-loss-parallel", "cp2"}

_single: dict[str, dict] = {}


def single(optimizer: str, overrides: dict, documents: str | None = None) -> dict:
    key = json.dumps([optimizer, overrides, documents], sort_keys=True)
    if key not in _single:
        _single[key] = train(0, 1, None, optimizer, overrides, None, documents)
    return _single[key]


def _compare_params(results: list[dict], reference: dict, atol: float) -> None:
    seen = set()
    for result in results:
        for name, got in result["params"].items():
            want_name = name if name in reference["params"] else "tok_embeddings.weight"
            np.testing.assert_allclose(
                got, reference["params"][want_name], atol=atol, rtol=0, err_msg=name
            )
            seen.add(want_name)
    assert seen == set(reference["params"]), "some parameters were on no rank"


def _compare(results: list[dict], reference: dict, rtol: float, atol: float | None) -> None:
    for result in results:
        for key in ("losses", "norms") if atol is not None else ("losses",):
            for step, (got, want) in enumerate(zip(result[key], reference[key], strict=True)):
                assert got == pytest.approx(want, rel=rtol), f"{key} step {step}: {got} vs {want}"
    if atol is not None:
        _compare_params(results, reference, atol)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout):
    world, dims, overrides, pipeline = LAYOUTS[layout]
    sgd = run_ranks(train, world, dims, "sgd", overrides, pipeline)
    _compare(sgd, single("sgd", overrides), 1e-5, 1e-5)
    if layout in ADAMW:
        adamw = run_ranks(train, world, dims, "adamw", overrides, pipeline)
        _compare(adamw, single("adamw", overrides), 1e-3, None)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(DOCUMENT_LAYOUTS))
def test_layout_with_documents_matches_one_process(layout):
    world, dims, overrides, pipeline, documents = DOCUMENT_LAYOUTS[layout]
    sgd = run_ranks(train, world, dims, "sgd", overrides, pipeline, documents)
    _compare(sgd, single("sgd", overrides, documents), 1e-5, 1e-5)


def test_documents_change_the_run():
    """The comparison above tells the position ids and the masks apart, so a pipeline that
    lost either on the way would fail it."""
    plain, reset, mask = (single("sgd", {}, documents) for documents in (None, "reset", "mask"))
    for a, b in ((plain, reset), (reset, mask)):
        with pytest.raises(AssertionError):
            _compare([a], b, 1e-5, 1e-5)


@pytest.mark.slow
def test_unsynced_tied_gradients_are_caught():
    """The negative control: without the tied-gradient sum the pipeline run must differ."""
    world, dims, overrides, pipeline = LAYOUTS["pp2-tied"]
    broken = run_ranks(train, world, dims, "sgd", overrides, {**pipeline, "sync_tied": False})
    with pytest.raises(AssertionError):
        _compare(broken, single("sgd", overrides), 1e-5, 1e-5)


def test_clipping_is_exercised():
    norms = single("sgd", {})["norms"]
    assert max(norms) > MAX_NORM  # so the parity runs compare clipped updates
