"""Expert parallelism trains a MoE model exactly like one process (CPU, gloo, real process
groups), and its checkpoints reshard across ep degrees.

Ten SGD steps with clipping, as `test_parity.py`: per-step losses and gradient norms within
1e-5 relative, final full parameters within 1e-5, and the router statistics (each step's
`Balance.finish_step` figures per MoE layer: mean auxiliary loss, max/mean load, tokens
routed) and the final balancing biases alike. The one-process run accumulates as many
micro-batches as the layout has in all (data-parallel ranks x pipeline micro-batches): the
auxiliary loss is a micro-batch's, so that is the run a layout must equal.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hp_runtime.model import Transformer, preset
from hp_runtime.model.config import MoEConfig
from hp_runtime.parallel import ParallelDims, init_weights
from hp_runtime.parallel.ac import apply_ac

from tests.helpers.distributed import run_ranks
from tests.runtime.parallel.test_parity import _compare
from tests.runtime.parity import BATCH, train

EXPERTS = 8
# The four router x balancing kinds: Mixtral/Qwen3-MoE's softmax with the auxiliary loss,
# the sigmoid with it behind a dense first layer, the softmax with the bias and a shared
# expert, and DeepSeek-V3's sigmoid with a shared expert, the bias and a route scale.
SOFTMAX_AUX = MoEConfig(experts=EXPERTS, top_k=2, expert_ffn_hidden=32)
SIGMOID_AUX = MoEConfig(
    experts=EXPERTS,
    top_k=3,
    expert_ffn_hidden=32,
    router="sigmoid",
    first_dense_layers=1,
    aux_loss_coef=0.1,
)
SOFTMAX_BIAS = MoEConfig(
    experts=EXPERTS,
    top_k=2,
    expert_ffn_hidden=32,
    shared_experts=1,
    load_balance="bias",
    bias_update_rate=0.01,
)
SIGMOID_BIAS = MoEConfig(
    experts=EXPERTS,
    top_k=2,
    expert_ffn_hidden=32,
    shared_experts=1,
    router="sigmoid",
    route_scale=2.5,
    load_balance="bias",
    bias_update_rate=0.01,
)
PP = {"schedule": "1f1b", "microbatches": 2}
# name: (world size, ParallelDims, MoE, pipeline options). The sigmoid with the bias runs at
# ep 2 and ep 4 in the checkpoint tests below.
LAYOUTS = {
    # full AC: the dispatch runs again in the recompute, its collectives in the backward
    "ep2": (2, {"dp_shard": 2, "ep": 2}, SOFTMAX_AUX, {"ac": "full"}),
    # every router and balancing at the plainest layout (two ranks, cheap)
    "ep2-sigmoid-aux": (2, {"dp_shard": 2, "ep": 2}, SIGMOID_AUX, None),
    "ep2-softmax-bias": (2, {"dp_shard": 2, "ep": 2}, SOFTMAX_BIAS, None),
    "ep2-sigmoid-bias": (2, {"dp_shard": 2, "ep": 2}, SIGMOID_BIAS, None),
    "ep4": (4, {"dp_shard": 4, "ep": 4}, SOFTMAX_AUX, None),
    "dp_shard4xep2": (4, {"dp_shard": 4, "ep": 2}, SOFTMAX_AUX, None),
    "ep2xpp2": (4, {"dp_shard": 2, "ep": 2, "pp": 2}, SOFTMAX_AUX, PP),
    "ep2xpp2-sigmoid-aux": (4, {"dp_shard": 2, "ep": 2, "pp": 2}, SIGMOID_AUX, PP),
    "dp_shard2xep2xtp2": (4, {"dp_shard": 2, "ep": 2, "tp": 2}, SOFTMAX_BIAS, None),
    "hsdp2x2xep2": (4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, SOFTMAX_BIAS, None),
}

_single: dict[str, dict] = {}


def single(
    optimizer: str, moe: MoEConfig, accumulate: int, checkpoint: tuple | None = None
) -> dict:
    """One process's run of `accumulate` micro-batches a step (cached)."""
    key = json.dumps([optimizer, repr(moe), accumulate, checkpoint])
    if key not in _single:
        options = {"accumulate": accumulate, "checkpoint": checkpoint}
        _single[key] = train(0, 1, None, optimizer, {"moe": moe}, options)
    return _single[key]


def micro_batches(moe: MoEConfig, dims: dict[str, int], pipeline: dict | None) -> int:
    """The micro-batches of a step over all data-parallel ranks: the one-process run that
    computes a layout's auxiliary losses. Without one any split gives the same run: one."""
    if moe.load_balance != "aux_loss":
        return BATCH
    ranks = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1)
    return ranks * (pipeline or {}).get("microbatches", 1)


def _compare_moe(results: list[dict], reference: dict, steps: int = 10) -> None:
    """Losses, norms, parameters (as `test_parity`), the router statistics and the biases."""
    _compare(results, reference, 1e-5, 1e-5)
    want = reference["balance"][-steps:]
    for result in results:
        assert len(result["balance"]) == steps
        for step, (got, expected) in enumerate(zip(result["balance"], want, strict=True)):
            assert set(got) <= set(expected)
            for layer, row in got.items():
                np.testing.assert_allclose(
                    row, expected[layer], rtol=1e-5, err_msg=f"step {step}, layer {layer}"
                )
        for layer, bias in result["bias"].items():
            np.testing.assert_allclose(bias, reference["bias"][layer], atol=1e-6, rtol=0)
    # every MoE layer was on some rank
    assert set().union(*(r["bias"] for r in results)) == set(reference["bias"])


def _check_sharded(
    results: list[dict], reference: dict, dims: dict[str, int], moe: MoEConfig
) -> None:
    """What the comparison relies on: the experts were split, the routing uneven (the ranks
    exchanged different numbers of rows) and a bias, where used, moved (and chose)."""
    held = {rows for result in results for rows in result["local_experts"].values()}
    assert held == {EXPERTS // dims.get("dp_shard", 1)}  # ep x dp_shard_mod_ep rows apart
    loads = [row[1] for step in reference["balance"] for row in step.values()]
    assert max(loads) > 1.2
    if moe.load_balance == "bias":
        assert all(np.any(bias != 0) for bias in reference["bias"].values())


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layout_matches_one_process(layout):
    world, dims, moe, pipeline = LAYOUTS[layout]
    results = run_ranks(train, world, dims, "sgd", {"moe": moe}, pipeline)
    reference = single("sgd", moe, micro_batches(moe, dims, pipeline))
    _compare_moe(results, reference)
    _check_sharded(results, reference, dims, moe)


@pytest.mark.parametrize(
    ("dims", "moe", "key", "named"),
    [
        ({"dp_shard": 2, "ep": 0}, SOFTMAX_AUX, "parallel.ep", "parallel.ep=0 must be at least 1"),
        ({"dp_shard": 2, "ep": 4}, SOFTMAX_AUX, "parallel.ep",
         "parallel.ep=4 does not divide parallel.dp_shard=2"),
        ({"dp_shard": 3, "ep": 3}, SOFTMAX_AUX, "model.moe.experts",
         "model.moe.experts=8 is not divisible by parallel.ep=3"),
        ({"dp_shard": 2, "ep": 2}, None, "parallel.ep",
         "parallel.ep=2 needs a MoE model: set model.moe"),
        ({"dp_shard": 2, "ep": 2, "cp": 2}, SOFTMAX_AUX, "parallel.cp",
         "model.moe with parallel.cp=2 is not supported yet"),
    ],
)  # fmt: skip
def test_a_layout_expert_parallelism_cannot_run_is_refused(dims, moe, key, named):
    """The rules are `expert_problems`'s, keyed as the config spells them; `validate` raises
    the first (the config's check its own error, `test_config.py`)."""
    layout = ParallelDims(**dims)
    world = layout.world_size
    assert layout.expert_problems(preset("tiny", moe=moe))[0].key == key
    with pytest.raises(ValueError, match=named):
        layout.validate(world, preset("tiny", moe=moe))


def test_the_balancing_bias_starts_even_under_activation_checkpointing():
    """`init_weights` fills the buffers that are state by canonical name: the activation
    checkpointing wrapper is in the names `named_buffers` gives, not in the state dict's."""
    config = preset("tiny", moe=SOFTMAX_BIAS)
    with torch.device("meta"):
        model = Transformer(config)
    apply_ac(model)
    model.to_empty(device="cpu")
    biases = [b for name, b in model.named_buffers() if name.endswith("expert_bias")]
    assert len(biases) == config.n_layers
    for bias in biases:
        bias.fill_(float("nan"))  # what `to_empty` may leave
    init_weights(model, seed=0)
    for bias in biases:
        assert torch.equal(bias, torch.zeros(EXPERTS))


@pytest.mark.slow
def test_a_dispatch_that_mixes_up_the_experts_is_caught():
    """The negative control: the rows received from two ranks handed to the experts in
    their arrival order, not regrouped by expert, must fail the comparison."""
    world, dims, moe, _ = LAYOUTS["ep2"]
    broken = run_ranks(train, world, dims, "sgd", {"moe": moe}, {"regroup": False})
    with pytest.raises(AssertionError, match="losses step"):
        _compare_moe(broken, single("sgd", moe, micro_batches(moe, dims, None)))


# Balanced by the bias (checkpointed with the model), no auxiliary loss, so every layout
# computes the one-process run; SGD with momentum, so the optimizer state moves too.
SAVED_AT = 5


@pytest.fixture(scope="module")
def saved_on_one_process(tmp_path_factory) -> tuple[str, dict]:
    """A one-process run that saved a checkpoint after step `SAVED_AT`, and its results."""
    directory = str(tmp_path_factory.mktemp("ep-checkpoint") / "one")
    return directory, single("momentum", SIGMOID_BIAS, BATCH, ("save", directory, SAVED_AT))


def _resumed(reference: dict) -> dict:
    """What a run resumed after step `SAVED_AT` must report: the steps from there."""
    rest = {k: reference[k][SAVED_AT:] for k in ("losses", "norms", "balance")}
    return {**reference, **rest}


@pytest.mark.slow
def test_a_checkpoint_saved_at_ep2_loads_on_one_process(tmp_path, saved_on_one_process):
    _, reference = saved_on_one_process
    directory = str(tmp_path / "ep2")
    dims = {"dp_shard": 2, "ep": 2}
    options = {"checkpoint": ("save", directory, SAVED_AT)}
    saving = run_ranks(train, 2, dims, "momentum", {"moe": SIGMOID_BIAS}, options)
    _compare_moe(saving, reference)  # the sigmoid router with the bias at ep 2
    _check_sharded(saving, reference, dims, SIGMOID_BIAS)
    options = {"checkpoint": ("load", directory, SAVED_AT)}
    resumed = train(0, 1, None, "momentum", {"moe": SIGMOID_BIAS}, options)
    _compare_moe([resumed], _resumed(reference), steps=10 - SAVED_AT)


@pytest.mark.slow
def test_a_checkpoint_saved_on_one_process_loads_at_ep4(saved_on_one_process):
    directory, reference = saved_on_one_process
    options = {"checkpoint": ("load", directory, SAVED_AT)}
    resumed = run_ranks(
        train, 4, {"dp_shard": 4, "ep": 4}, "momentum", {"moe": SIGMOID_BIAS}, options
    )
    _compare_moe(resumed, _resumed(reference), steps=10 - SAVED_AT)
