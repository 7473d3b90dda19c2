"""Float8 linears (`train.float8`, torchao's emulation on CPU): each recipe trains under every
parallel layout as it does on one process, and only the linears the rule names are converted.

The one-process reference runs each rank's share of the batch as its own micro-batch
(`accumulate`): float8 scales activations by their own amax, so a layout and its reference
agree only when they cast the same rows together.

FSDP 2 is compared in fp32 and is exact. Under TP the partial sums of a row-wise linear are
added in another order than on one process, and torchao's emulated matmul adds in fp32
whatever the masters' dtype: in fp32 that moves some value across a float8 rounding boundary
within a few steps and the runs part by ~1e-3, which says nothing about the layout. So TP
layouts run with float64 masters, and where the data-parallel shards also split the rows
(FSDP 2 x TP 2) with scales rounded to powers of two (the rowwise recipes' own choice), which
makes the dequantised products exact: measured, tensorwise FSDP 2 x TP 2 with unrounded scales
parts from one process by 3e-4 at step 10, with rounded ones by 6e-11 and grad norms equal.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hp_runtime.model import ModelConfig
from hp_runtime.parallel import assemble
from hp_runtime.parallel.mesh import ParallelDims
from hp_runtime.parallel.options import Float8
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.runtime.parity import train

pytest.importorskip("torchao")

# tiny's ffn_hidden (172) is not a multiple of 16: the feed-forward would stay unconverted.
MODEL = {"ffn_hidden": 128}
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
# name: (world size, ParallelDims, float64 masters, float8 scales rounded to powers of two)
LAYOUTS = {
    "fsdp2": (2, {"dp_shard": 2}, False, None),
    "tp2": (2, {"tp": 2}, True, None),
    "fsdp2xtp2": (4, {"dp_shard": 2, "tp": 2}, True, True),
}
# Tensorwise only: name: (world, dims, float64, pipeline options, fsdp_all_gather)
TENSORWISE = {
    "fsdp2-all-gather": (2, {"dp_shard": 2}, False, {}, True),
    "hsdp2x2": (4, {"dp_replicate": 2, "dp_shard": 2}, False, {}, False),
    "pp2-1f1b": (2, {"pp": 2}, False, {"schedule": "1f1b"}, False),
    "fsdp2-ac-full": (2, {"dp_shard": 2}, False, {"ac": "full"}, False),
}

_single: dict[str, dict] = {}


def single(float8: dict | None, accumulate: int, float64: bool = False) -> dict:
    """One process's run, with each step's batch in `accumulate` micro-batches."""
    pipeline = {"accumulate": accumulate, "float64": float64}
    if float8 is not None:
        pipeline["float8"] = float8
    key = json.dumps(pipeline, sort_keys=True)
    if key not in _single:
        _single[key] = run_ranks(train, 1, None, "sgd", MODEL, pipeline)[0]
    return _single[key]


def _compare(results: list[dict], reference: dict, rtol: float = 1e-5) -> None:
    for result in results:
        for key in ("losses", "norms"):
            np.testing.assert_allclose(result[key], reference[key], rtol=rtol, err_msg=key)
        for name, got in result["params"].items():
            np.testing.assert_allclose(got, reference["params"][name], atol=1e-5, err_msg=name)


def test_float8_changes_the_numerics():
    """The comparisons below are of float8 runs: converted linears round, fp32 ones do not."""
    fp32 = single(None, 2)  # the runs the layouts below compare with, cached
    float8 = single({"recipe": "tensorwise"}, 2)
    assert fp32["losses"][0] != float8["losses"][0]
    np.testing.assert_allclose(float8["losses"], fp32["losses"], rtol=5e-2)


def test_only_the_rules_linears_round():
    """Each linear's output, as the assembled model computes it, against `F.linear` of its
    input and weight in fp32: equal exactly for the head (kept in high precision: a mutation
    converting it fails here), different for every other linear (converted). (A MoE router
    multiplies by its gate's weight in fp32 itself, `model/moe.py`, whatever the gate is.)"""
    config = ModelConfig(ffn_hidden=128)
    cpu = torch.device("cpu")
    model = assemble(config, ParallelDims(), cpu, seed=0, float8=Float8()).modules[0]
    exact: dict[str, bool] = {}

    def record(name):
        def hook(module, args, out):
            exact[name] = torch.equal(out, F.linear(args[0], module.weight, module.bias))

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(record(name))
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (2, 16)))
    assert {name for name, same in exact.items() if same} == {"output"}
    assert len(exact) == 2 * 7 + 1  # every linear was called: 2 blocks of 7, the head


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_matches_one_process(recipe, layout):
    world, dims, float64, power_of_2 = LAYOUTS[layout]
    float8 = {"recipe": recipe, "round_scales_to_power_of_2": power_of_2}
    got = run_ranks(train, world, dims, "sgd", MODEL, {"float8": float8, "float64": float64})
    _compare(got, single(float8, dims.get("dp_shard", 1), float64))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(TENSORWISE))
def test_tensorwise_layout_matches_one_process(layout):
    world, dims, float64, options, all_gather = TENSORWISE[layout]
    float8 = {"recipe": "tensorwise", "fsdp_all_gather": all_gather}
    pipeline = {**options, "float8": float8, "float64": float64}
    got = run_ranks(train, world, dims, "sgd", MODEL, pipeline)
    data_parallel = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1)
    accumulate = 2 if "pp" in dims else data_parallel  # a pipeline's micro-batches
    _compare(got, single({"recipe": "tensorwise"}, accumulate, float64))


@pytest.mark.slow
def test_float8_all_gather_under_tp_matches_the_plain_gather():
    """FSDP 2 x TP 2: gathering the weights in float8 with the precomputed scales trains as
    gathering them in fp32 and casting after (same layout, so the same order of sums)."""
    dims, pipeline = {"dp_shard": 2, "tp": 2}, {"float64": True}
    runs = [
        run_ranks(train, 4, dims, "sgd", MODEL, {**pipeline, "float8": float8})
        for float8 in ({"recipe": "tensorwise", "fsdp_all_gather": g} for g in (True, False))
    ]
    _compare(runs[0], runs[1][0])


@pytest.mark.slow
def test_mxfp8_under_fsdp_matches_one_process():
    """MXFP8 (a scale per 32 values, Blackwell's format; emulated here) under FSDP 2. Under TP
    the config refuses it (`checks.py`)."""
    float8 = {"recipe": "mxfp8"}
    got = run_ranks(train, 2, {"dp_shard": 2}, "sgd", MODEL, {"float8": float8})
    _compare(got, single(float8, 2))


@pytest.mark.slow
def test_float8_under_compile_stays_float8():
    """FSDP 2 with per-block compile: inductor compiles torchao's casts too, and rounds them
    otherwise than eager emulation does (measured: losses 5e-5 from eager over 10 steps), so
    the compiled run is held to eager float8 within 1e-3, and must be nearer it than fp32."""
    float8 = {"recipe": "tensorwise"}
    got = run_ranks(train, 2, {"dp_shard": 2}, "sgd", MODEL, {"float8": float8, "compile": True})
    eager, fp32 = single(float8, 2)["losses"], single(None, 2)["losses"]
    for result in got:
        np.testing.assert_allclose(result["losses"], eager, rtol=1e-3)
        to_eager = np.abs(np.subtract(result["losses"], eager)).max()
        assert to_eager < np.abs(np.subtract(result["losses"], fp32)).max() / 10


def test_the_shape_rule_is_the_recipes():
    """A feed-forward 48 wide converts under the float8 recipes (multiples of 16) and stays in
    high precision under mxfp8 (blocks of 32), and under TP 2 (a shard 24 wide)."""
    from hp_runtime.model import Transformer
    from hp_runtime.parallel.float8 import high_precision

    with torch.device("meta"):
        model = Transformer(ModelConfig(ffn_hidden=48))
    ffn = {f"layers.{i}.feed_forward.w{j}" for i in range(2) for j in (1, 2, 3)}
    assert not ffn & set(high_precision(model, Float8(recipe="rowwise")))
    for kept in (high_precision(model, Float8(recipe="mxfp8")), high_precision(model, Float8(), 2)):
        assert ffn <= set(kept) and "layers.0.attention.wq" not in kept


def test_under_tp_a_moe_layers_shared_experts_count_whole():
    """Under TP 2 a MoE layer is whole on each rank: its shared experts (48 wide) convert,
    where a dense feed-forward of that width, split in two, stays in high precision."""
    from hp_runtime.model import Transformer
    from hp_runtime.model.config import MoEConfig
    from hp_runtime.parallel.float8 import high_precision

    moe = MoEConfig(experts=4, top_k=2, expert_ffn_hidden=48, shared_experts=1,
                    first_dense_layers=1)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(ModelConfig(ffn_hidden=48, moe=moe))
    kept = high_precision(model, Float8(), 2)
    assert {"layers.0.feed_forward.w1", "layers.0.feed_forward.w2"} <= set(kept)
    assert not {n for n in kept if ".shared." in n}
    assert "layers.1.feed_forward.router.gate" in kept
