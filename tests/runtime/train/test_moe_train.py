"""hp-train on a MoE model, one process, against a plain loop written here: the model's forward,
the Switch auxiliary loss and DeepSeek-V3's bias step as the papers state them, torch's AdamW
and gradient clipping, on the same samples. The logged MoE figures and the MFU's active
parameters are checked against counts made here; a stopped and resumed run continues the
balancing bias bit for bit."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.train import FAST, records

STEPS, MICRO, GLOBAL, SEQ, LR = 5, 2, 4, 16, 1e-2
MOE = {"experts": 4, "top_k": 2, "expert_ffn_hidden": 32}
BIAS = {**MOE, "router": "sigmoid", "load_balance": "bias", "bias_update_rate": 0.05,
        "shared_experts": 1, "route_scale": 2.0, "first_dense_layers": 1}  # fmt: skip
# A spike guard that skips every step whose loss or gradient norm rose: those move neither
# the weights nor the bias.
SKIPPING = ["train.spike_action=skip", "train.spike_window=1", "train.spike_sigma=0.001"]
CASES = {  # name: (model.moe, n_layers, more overrides)
    "aux_loss": ({**MOE, "router": "softmax", "aux_loss_coef": 0.1}, 2, []),
    "bias": (BIAS, 3, []),
    "bias-skipping": (BIAS, 3, SKIPPING),
}


def _inline(table: dict[str, Any]) -> str:
    text = {k: f'"{v}"' if isinstance(v, str) else repr(v) for k, v in table.items()}
    return "{" + ", ".join(f"{k} = {v}" for k, v in text.items()) + "}"


def _overrides(case: str, run_dir: Any) -> list[str]:
    moe, layers, more = CASES[case]
    return [
        *more,
        "data.type=dummy", f"data.seq_length={SEQ}", "data.split=90,10,0",
        f"model.moe={_inline(moe)}", f"model.n_layers={layers}",
        f"train.steps={STEPS}", f"train.micro_batch_size={MICRO}",
        f"train.global_batch_size={GLOBAL}", "train.max_norm=1.0",
        # validations between the steps: their tokens must count in no step's figures or bias
        "train.eval_interval=2", "train.eval_iters=1",
        f"optim.lr={LR}", "optim.decay_style=constant", "optim.weight_decay=0",
        "metrics.peak_tflops=1", f"train.run_dir={run_dir}",
    ]  # fmt: skip


def _train(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """Train in a warm rank through the library; the losses and the final balancing biases."""
    import io

    from hp_runtime.parallel import canonical_name
    from hp_runtime.train import load_config, train
    from hp_runtime.train.launch import start
    from hp_runtime.train.setup import setup

    config = load_config(None, [*FAST, *overrides])
    runtime = start("cpu", 1)
    log = io.StringIO()
    run = setup(config, runtime, log)
    result = train(config, runtime, log, run=run)
    biases = {
        canonical_name(name): buffer.detach().numpy().copy()
        for module in run.state.modules
        for name, buffer in module.named_buffers()
        if name.endswith("expert_bias")
    }
    return {
        "losses": [result.losses[s] for s in sorted(result.losses)],
        "grad_norms": [result.grad_norms[s] for s in sorted(result.grad_norms)],
        "skipped": list(result.skipped),
        "biases": biases,
        "log": log.getvalue(),
    }


def _reference(case: str, skipped: list[int]) -> dict[str, Any]:
    """The same run as a plain loop, without an update at the steps `skipped`: per step the
    losses, gradient norms, each MoE layer's max / mean tokens per expert and mean auxiliary
    loss, and the final biases."""
    from hp_data.registry import DatasetConfig, build_dataset
    from hp_runtime.model import Transformer, preset
    from hp_runtime.model.config import MoEConfig
    from hp_runtime.parallel.init import init_weights

    table, layers, _ = CASES[case]
    moe = MoEConfig(**table)
    config = preset("tiny", moe=moe, n_layers=layers)
    model = Transformer(config)
    init_weights(model, seed=0)  # train.seed's initial weights
    routed: dict[int, list[Any]] = {}  # layer -> this forward's (weights, experts, scores)
    routers = {}
    for name, module in model.named_modules():
        if name.endswith("feed_forward.router"):
            layer = int(name.split(".")[1])
            routers[layer] = module
            module.register_forward_hook(
                lambda _, __, out, layer=layer: routed.setdefault(layer, []).append(out)
            )
        if name.endswith("feed_forward") and hasattr(module, "aux_scale"):
            module.aux_scale.zero_()  # the auxiliary loss enters below, written out
    samples = build_dataset(
        DatasetConfig(type="dummy", seq_length=SEQ, vocab_size=config.vocab_size, split="90,10,0"),
        "train",
        STEPS * GLOBAL,
    )
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    micro_batches = GLOBAL // MICRO
    out: dict[str, list[Any]] = {"losses": [], "grad_norms": [], "ratios": [], "aux": []}
    for step in range(STEPS):
        loss_sum, tokens = 0.0, GLOBAL * SEQ  # dummy samples: every token has a loss
        load = {layer: torch.zeros(moe.experts) for layer in routers}
        aux: dict[int, list[float]] = {layer: [] for layer in routers}
        for j in range(micro_batches):
            first = step * GLOBAL + j * MICRO
            rows = [samples[i] for i in range(first, first + MICRO)]
            inputs = torch.tensor(np.stack([r["tokens"] for r in rows]))
            labels = torch.tensor(np.stack([r["labels"] for r in rows]))
            routed.clear()
            token_losses = model(inputs, labels=labels)
            loss = token_losses.sum() / tokens
            loss_sum += float(loss.detach())
            for layer, [(_, experts, scores)] in routed.items():
                counts = torch.bincount(experts.reshape(-1), minlength=moe.experts)
                load[layer] += counts
                if moe.load_balance == "aux_loss":  # E * sum_e f_e * P_e (Switch)
                    share = counts.float() / (scores.shape[0] * moe.top_k)
                    value = moe.experts * (share * scores.mean(dim=0)).sum()
                    aux[layer].append(float(value.detach()))
                    loss = loss + moe.aux_loss_coef * value / micro_batches
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step + 1 not in skipped:
            opt.step()
        opt.zero_grad()
        if moe.load_balance == "bias" and step + 1 not in skipped:  # DeepSeek-V3's step
            with torch.no_grad():
                for layer, router in routers.items():
                    step_ = moe.bias_update_rate * torch.sign(load[layer].mean() - load[layer])
                    router.expert_bias += step_
        out["losses"].append(loss_sum)
        out["grad_norms"].append(float(norm))
        out["ratios"].append([float(load[k].max() / load[k].mean()) for k in sorted(load)])
        if moe.load_balance == "aux_loss":
            out["aux"].append(np.mean([np.mean(aux[k]) for k in sorted(aux)]))
    out["biases"] = {
        f"layers.{k}.feed_forward.router.expert_bias": r.expert_bias.numpy()
        for k, r in routers.items()
    }
    out["config"] = config
    return out


def _check_drawn(run: Any, logged: list[dict[str, Any]]) -> None:
    """TensorBoard holds the records' MoE scalars (each layer's under its index in the
    model), and metrics.png has the MoE row: 3 rows of 350 pixels, not 2."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = {
        "moe_aux_loss": [r["moe_aux_loss"] for r in logged],
        "moe_load_max_over_mean_worst": [r["moe_load_max_over_mean_worst"] for r in logged],
        "moe_load_max_over_mean/layer_0": [r["moe_load_max_over_mean"][0] for r in logged],
        "moe_load_max_over_mean/layer_1": [r["moe_load_max_over_mean"][1] for r in logged],
    }
    for tag, values in tags.items():
        scalars = events.Scalars(tag)
        assert [e.step for e in scalars] == [r["step"] for r in logged]
        np.testing.assert_allclose([e.value for e in scalars], values, rtol=1e-6)
    png = (run / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[20:24], "big") == 3 * 350


def _active_flops(config: Any) -> tuple[int, int, int]:
    """(parameters, active parameters, training FLOPs per token), from the model's shapes: a
    token uses top_k of each MoE layer's experts; FLOPs are 6 x the active parameters beside
    the input embedding plus attention's 12 x layers x dim x seq."""
    from hp_runtime.model import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    moe = config.moe
    total = active = 0
    for name, param in model.named_parameters():
        total += param.numel()
        share = moe.top_k / moe.experts if ".experts.w" in name else 1
        active += int(param.numel() * share)
    embedding = config.vocab_size * config.dim
    flops = 6 * (active - embedding) + 12 * config.n_layers * config.dim * SEQ
    return total, active, flops


@pytest.mark.parametrize("case", list(CASES))
def test_a_moe_run_equals_a_plain_loop(tmp_path, case):
    run = tmp_path / "run"
    drawn = ["metrics.tensorboard=true", "metrics.plot=true"] if case == "aux_loss" else []
    got = run_ranks(_train, 1, [*_overrides(case, run), *drawn])[0]
    if case == "bias-skipping":
        assert 0 < len(got["skipped"]) < STEPS - 1, got["skipped"]
    else:
        assert not got["skipped"]
    want = _reference(case, got["skipped"])
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=1e-5, atol=0)
    logged = records(run)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    ratios = [r["moe_load_max_over_mean"] for r in logged]
    np.testing.assert_allclose(ratios, want["ratios"], rtol=1e-6)
    worst = [r["moe_load_max_over_mean_worst"] for r in logged]
    assert worst == [max(r) for r in ratios]
    if case == "aux_loss":
        np.testing.assert_allclose([r["moe_aux_loss"] for r in logged], want["aux"], rtol=1e-5)
        _check_drawn(run, logged)
    else:
        assert not any("moe_aux_loss" in r for r in logged)  # no auxiliary loss to report
        assert set(got["biases"]) == set(want["biases"])
        assert any(np.abs(bias).max() > 0 for bias in want["biases"].values())  # they moved
        for name, bias in want["biases"].items():
            np.testing.assert_allclose(got["biases"][name], bias, rtol=0, atol=1e-7)
    # the MFU counts the active parameters: the FLOPs per token it implies, at peak 1 TFLOP/s
    total, active, flops = _active_flops(want["config"])
    assert active < total
    for record in logged:
        implied = record["mfu"] * 1e12 / record["tokens_per_s_per_device"]
        assert math.isclose(implied, flops, rel_tol=1e-9), (implied, flops)
    assert f"hp-train: {total:,} parameters ({active:,} active a token) |" in got["log"]


def test_a_stopped_run_resumes_the_bias_bit_for_bit(tmp_path):
    whole = _overrides("bias", tmp_path / "whole")
    straight = run_ranks(_train, 1, [*whole, "train.steps=6", "checkpoint.interval=3"])[0]
    stopped = _overrides("bias", tmp_path / "stopped")
    run_ranks(_train, 1, [*stopped, "train.steps=3", "checkpoint.interval=3"])
    resumed = run_ranks(_train, 1, [*stopped, "train.steps=6", "checkpoint.interval=3"])[0]
    assert "resumed from" in resumed["log"]
    assert resumed["losses"] == straight["losses"][3:]  # bit for bit
    logged = [
        (r["step"], r["loss"], r["moe_load_max_over_mean"]) for r in records(tmp_path / "stopped")
    ]
    assert logged == [
        (r["step"], r["loss"], r["moe_load_max_over_mean"]) for r in records(tmp_path / "whole")
    ]
    assert any(np.abs(bias).max() > 0 for bias in straight["biases"].values())
    for name, bias in straight["biases"].items():
        assert np.array_equal(resumed["biases"][name], bias), name


@pytest.mark.parametrize(
    ("saved", "now", "message"),
    [
        ({}, MOE, "model.moe = {experts = 4, top_k = 2, expert_ffn_hidden = 32, "),
        (MOE, {}, 'model.moe = "none", but CKPT was trained with {experts = 4, top_k = 2, '),
        (MOE, {**MOE, "top_k": 1}, "model.moe = {experts = 4, top_k = 1, "),
        (MOE, {**MOE, "router": "sigmoid"}, "but CKPT was trained with {experts = 4, top_k = 2"),
        (MOE, {**MOE, "aux_loss_coef": 0.5, "bias_update_rate": 0.1}, None),  # the rates
        (MOE, {**MOE, "groups": 2, "topk_groups": 1}, "groups = 2, topk_groups = 1}"),
        (MOE, MOE, None),
    ],
)
def test_a_checkpoint_resumes_only_its_moe_model(saved, now, message):
    from hp_runtime.train.checkpoint_format import CheckpointError
    from hp_runtime.train.compat import check_model
    from hp_runtime.train.config import load_config, to_toml

    def config(moe: dict[str, Any]) -> Any:
        table = [f"model.moe={_inline(moe)}"] if moe else []
        return load_config(None, ["data.type=dummy", "data.seq_length=16", "train.steps=1", *table])

    meta = {"config": to_toml(config(saved))}
    if message is None:
        check_model("CKPT", meta, config(now).model)
        return
    with pytest.raises(CheckpointError) as info:
        check_model("CKPT", meta, config(now).model)
    assert message in str(info.value) and "set model.moe = " in str(info.value)


def test_a_checkpoint_from_before_the_group_fields_resumes():
    """A checkpoint written by an hp before `model.moe.groups` and `topk_groups` routed over
    every expert: it resumes with their defaults (which do that), and not with groups."""
    from hp_runtime.train.checkpoint_format import CheckpointError
    from hp_runtime.train.compat import check_model
    from hp_runtime.train.config import load_config, to_toml

    def config(moe: dict[str, Any]) -> Any:
        table = f"model.moe={_inline(moe)}"
        return load_config(None, ["data.type=dummy", "data.seq_length=16", "train.steps=1", table])

    text = to_toml(config(MOE))
    old = text.replace(", groups = 1, topk_groups = 1", "")
    assert old != text
    check_model("CKPT", {"config": old}, config(MOE).model)
    with pytest.raises(CheckpointError, match="groups = 2"):
        check_model("CKPT", {"config": old}, config({**MOE, "groups": 2}).model)
