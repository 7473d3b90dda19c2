"""`train.batch_ramp` (Megatron's `--rampup-batch-size START INCR SAMPLES`) against
megatron-core's own `RampupBatchsizeNumMicroBatchesCalculator`: each step's global batch and
the samples consumed before it; a ramped run against a plain loop written here on the
calculator's batches (the loss of a small step is normalised over its own tokens, the learning
rate follows the steps); a resume mid-ramp bit-identical to the run without the interruption;
FSDP 2 equal to one process during the ramp; a changed ramp refused on resume while it would
change which samples a step trains on; throughput counted on each step's own batch; bad values
one line each."""

from __future__ import annotations

import shutil
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hp_runtime.train.batch import batch_plan
from hp_runtime.train.checkpoint_format import CheckpointError
from hp_runtime.train.compat import check_ramp
from hp_runtime.train.config import load_config, to_toml
from hp_runtime.train.errors import ConfigError
from hp_runtime.train.launch import Runtime
from hp_runtime.train.setup import checked_plan

from tests.helpers.distributed import run_ranks
from tests.helpers.megatron import ramp_calculator
from tests.helpers.train import FAST, hp_train_here, records, train_ranks

Calculator = ramp_calculator()


def megatron_steps(
    ramp: tuple[int, int, int], gbs: int, micro: int, dp: int, steps: int
) -> list[tuple[int, int, int]]:
    """(global batch, micro-batches per rank, samples consumed before) of steps 1..`steps`, as
    Megatron's training loop asks the calculator: updated with the consumed samples before
    each step."""
    calculator = Calculator(gbs, micro, dp, False, 0, *ramp)
    consumed, out = 0, []
    for _ in range(steps):
        calculator.update(consumed, consistency_check=True)
        size = calculator.get_current_global_batch_size()
        out.append((size, calculator.get(), consumed))
        consumed += size
    return out


def _plan(ramp: tuple[int, int, int] | None, gbs: int, micro: int = 1, dp: int = 1) -> Any:
    value = "none" if ramp is None else str(list(ramp))
    config = load_config(
        None,
        [
            "data.type=dummy", "data.seq_length=16", "train.steps=1",
            f"train.micro_batch_size={micro}", f"train.global_batch_size={gbs}",
            f"parallel.dp_shard={dp}", f"train.batch_ramp={value}",
        ],
    )  # fmt: skip
    return batch_plan(config)


# (start, increment, samples), global batch, micro-batch, data-parallel size: even ramps,
# uneven ones (increments of fractional samples, levels jumped over in one step), Megatron's
# GPT-3 ramp, and one whose float arithmetic differs from exact division: (1, 1, 27) up to 14
# reaches c = 27 consumed, where int(27 / (27 / 13)) is 12, not 13.
RAMPS = [
    ((2, 2, 12), 8, 1, 1),
    ((2, 2, 8), 32, 1, 2),
    ((1, 1, 27), 14, 1, 1),
    ((3, 5, 1000), 53, 1, 1),
    ((4, 4, 100), 64, 2, 2),
    ((16, 16, 5_859_375), 1536, 1, 16),
]


@pytest.mark.parametrize(("ramp", "gbs", "micro", "dp"), RAMPS)
def test_each_step_is_megatron_cores(ramp, gbs, micro, dp):
    plan = _plan(ramp, gbs, micro, dp)
    steps = plan.full_from + 3
    want = megatron_steps(ramp, gbs, micro, dp, steps)
    assert want[-1][0] == gbs and want[plan.full_from - 2][0] < gbs  # ramped, then full
    got = [
        (plan.global_batch_at(s), plan.accumulation_at(s), plan.samples_after(s - 1))
        for s in range(1, steps + 1)
    ]
    assert got == want
    consumed = [before for _, _, before in want] + [want[-1][2] + want[-1][0]]
    np.testing.assert_array_equal(plan.cumulative_samples(steps), consumed)
    # far past the ramp: arithmetic, as Megatron counts it (the full batch every step)
    far = 10**9
    assert plan.samples_after(far) == consumed[-1] + (far - steps) * gbs


def test_a_ramp_reaches_megatrons_float_boundaries():
    """The (1, 1, 27) ramp meets a consumed count where Megatron's float rule and exact
    division disagree, so that test_each_step_is_megatron_cores holds hp to the float rule."""
    seen = [before for _, _, before in megatron_steps((1, 1, 27), 14, 1, 1, 20)]
    assert any(int(c / (27 / 13)) != c * 13 // 27 for c in seen if c <= 27)


def test_the_state_counts_each_steps_own_samples():
    """`TrainState.advance` and `samples_of` (the spike guard's and the NaN stop's sample
    range) through and past the ramp, against the calculator's consumed samples."""
    from hp_runtime.train.guard import SpikeGuard
    from hp_runtime.train.state import TrainState

    plan = _plan((2, 2, 12), 8)
    state = TrainState([], None, plan, SpikeGuard("off", 1, 1.0))
    want = megatron_steps((2, 2, 12), 8, 1, 1, 8)
    for size, _, before in want:
        state.advance()
        assert state.consumed_samples == before + size
    for step, (size, _, before) in enumerate(want, 1):
        assert state.samples_of(step) == (before, before + size)


# --- the run --------------------------------------------------------------------------------

SEQ, MICRO, GLOBAL, STEPS, LR, WARMUP = 16, 1, 8, 6, 0.5, 2
RAMP = (2, 2, 12)  # batches 2, 2, 4, 6, then 8 from step 5
RUN = [
    "data.type=dummy", f"data.seq_length={SEQ}", f"train.steps={STEPS}",
    f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL}",
    f"train.batch_ramp={list(RAMP)}", "train.max_norm=1.0", "optim.name=sgd", f"optim.lr={LR}",
    "optim.weight_decay=0", f"optim.warmup_steps={WARMUP}", "optim.decay_style=constant",
    "checkpoint.interval=3",
]  # fmt: skip


def test_validation_samples_are_counted_at_the_full_batch():
    """Training needs the ramped steps' samples; validation, `eval_iters` full global batches
    for each of `steps // eval_interval + 1` validations (Megatron's count)."""
    from hp_runtime.train.data import sample_counts

    config = load_config(None, [*RUN, "train.eval_interval=3", "train.eval_iters=2"])
    train, valid = sample_counts(config, batch_plan(config))
    assert train == 2 + 2 + 4 + 6 + 8 + 8
    assert valid == 2 * GLOBAL * (STEPS // 3 + 1)


@pytest.fixture(scope="module")
def ramped(tmp_path_factory) -> dict[str, Any]:
    """The ramped run on one process (checkpoints at steps 3, mid-ramp, and 6)."""
    run = tmp_path_factory.mktemp("ramped") / "run"
    result = train_ranks(1, [*RUN, f"train.run_dir={run}"])[0]
    return {**result, "run": run}


def _reference(steps: list[tuple[int, int, int]]) -> dict[str, list[float]]:
    """The run as a plain loop: each step trains the samples [consumed, consumed + batch) that
    the calculator gives, its loss the mean over that step's tokens (dummy samples: every
    token counts), SGD at the warmup's rate of the step, the gradient clipped to norm 1."""
    from hp_data.registry import DatasetConfig, build_dataset
    from hp_runtime.model import Transformer, preset
    from hp_runtime.parallel.init import init_weights

    config = preset("tiny")
    model = Transformer(config)
    init_weights(model, seed=0)  # train.seed's initial weights
    total = steps[-1][2] + steps[-1][0]
    samples = build_dataset(
        DatasetConfig(type="dummy", seq_length=SEQ, vocab_size=config.vocab_size), "train", total
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, list[float]] = {"losses": [], "grad_norms": [], "lrs": []}
    for step, (size, _, first) in enumerate(steps, 1):
        lr = LR * min(step / WARMUP, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for start in range(first, first + size, MICRO):
            rows = [samples[i] for i in range(start, start + MICRO)]
            inputs = torch.tensor(np.stack([r["tokens"] for r in rows]))
            labels = torch.tensor(np.stack([r["labels"] for r in rows]))
            loss = model(inputs, labels=labels).sum() / (size * SEQ)
            loss.backward()
            loss_sum += float(loss.detach())
        out["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss_sum)
        out["lrs"].append(lr)
    return out


def test_a_ramped_run_equals_a_plain_loop_on_megatrons_batches(ramped):
    steps = megatron_steps(RAMP, GLOBAL, MICRO, 1, STEPS)
    assert [size for size, _, _ in steps] == [2, 2, 4, 6, 8, 8]
    want = _reference(steps)
    np.testing.assert_allclose(ramped["losses"], want["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(ramped["grad_norms"], want["grad_norms"], rtol=1e-5, atol=0)
    logged = records(ramped["run"])
    assert [r["global_batch_size"] for r in logged] == [size for size, _, _ in steps]
    assert [r["consumed_samples"] for r in logged] == [before + size for size, _, before in steps]
    np.testing.assert_allclose([r["lr"] for r in logged], want["lrs"], rtol=1e-12)
    assert "ramped from 2 by 2 over 12 samples (full from step 5)" in ramped["log"]
    end = records(ramped["run"], "end")[0]
    assert end["consumed_samples"] == 30


def test_fsdp_during_the_ramp_equals_one_process(ramped, tmp_path):
    """Steps 1-5: the ramp and the first full step (no checkpoints: they cost time here)."""
    layout = ["parallel.dp_shard=2", "train.steps=5", "checkpoint.interval=0"]
    two = train_ranks(2, [*RUN, *layout, f"train.run_dir={tmp_path}"])
    for rank in two:
        np.testing.assert_allclose(rank["losses"], ramped["losses"][:5], rtol=1e-5, atol=0)
        np.testing.assert_allclose(rank["grad_norms"], ramped["grad_norms"][:5], rtol=1e-5, atol=0)


def _mid_ramp(ramped: dict[str, Any], run_dir: Path) -> Path:
    """A run directory holding only the ramped run's checkpoint of step 3 (inside the ramp)."""
    source = ramped["run"] / "checkpoints" / "step-0000003"
    shutil.copytree(source, run_dir / "checkpoints" / source.name)
    return run_dir


def test_a_resume_mid_ramp_is_bit_identical(ramped, tmp_path):
    run = _mid_ramp(ramped, tmp_path / "run")
    resumed = train_ranks(1, [*RUN, f"train.run_dir={run}"])[0]
    assert "resumed from" in resumed["log"] and "at step 3" in resumed["log"]
    assert resumed["losses"] == ramped["losses"][3:]
    assert resumed["grad_norms"] == ramped["grad_norms"][3:]
    assert [r["global_batch_size"] for r in records(run)] == [6, 8, 8]


def test_a_resume_mid_ramp_refuses_a_removed_ramp(ramped, tmp_path):
    run = _mid_ramp(ramped, tmp_path / "run")
    done = hp_train_here(*FAST, *RUN, "train.batch_ramp=none", f"train.run_dir={run}")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "train.batch_ramp changed from [2, 2, 12] to none" in lines[0]
    assert "step 3 is inside a ramp" in lines[0] and "keep train.batch_ramp" in lines[0]
    assert (run / "checkpoints" / "step-0000003").is_dir()  # nothing of the run touched


def _meta(ramp: tuple[int, int, int] | None, step: int) -> dict[str, Any]:
    """A checkpoint's meta fields that the ramp rule reads, of a run with `ramp`."""
    value = "none" if ramp is None else str(list(ramp))
    config = load_config(None, [*RUN, f"train.batch_ramp={value}"])
    return {
        "config": to_toml(config),
        "step": step,
        "consumed_samples": batch_plan(config).samples_after(step),
    }


@pytest.mark.parametrize(
    ("saved", "now", "step", "refusal"),
    [
        (RAMP, RAMP, 3, None),  # the same ramp: resumes anywhere
        (RAMP, None, 4, None),  # removed once every later step is full (the data suffices)
        (RAMP, (4, 4, 8), 4, None),  # changed past both ends, counting more samples
        (RAMP, None, 3, "step 3 is inside a ramp (smaller batches until step 4)"),
        (None, RAMP, 1, "step 1 is inside a ramp"),
        (RAMP, (2, 2, 20), 4, "is inside a ramp (smaller batches until step 7)"),
        (None, RAMP, 6, "counts 30 samples up to step 6, fewer than the 48 trained"),
    ],
)
def test_a_changed_ramp_resumes_only_past_both_ends(saved, now, step, refusal):
    value = "none" if now is None else str(list(now))
    plan = batch_plan(load_config(None, [*RUN, f"train.batch_ramp={value}"]))
    meta = _meta(saved, step)
    if refusal is None:
        check_ramp(meta, "ckpt", plan)
        return
    with pytest.raises(CheckpointError) as caught:
        check_ramp(meta, "ckpt", plan)
    assert refusal in str(caught.value) and "train.batch_ramp" in str(caught.value)
    assert not caught.value.fallback  # a refusal, not damage: no older checkpoint is tried


def test_a_checkpoint_written_before_the_key_resumes_without_a_ramp():
    meta = _meta(None, 2)
    meta["config"] = "\n".join(
        line for line in meta["config"].splitlines() if "batch_ramp" not in line
    )
    check_ramp(meta, "ckpt", batch_plan(load_config(None, [*RUN, "train.batch_ramp=none"])))


def _throughput(rank: int, world: int, run_dir: str) -> list[dict[str, Any]]:
    """MetricsLog's records of steps 1, 3 and 6 of the RAMP plan, one second apart."""
    import io

    from hp_runtime.train import metrics

    plan = batch_plan(load_config(None, RUN))
    clock = [0.0]
    real, metrics.time = metrics.time, types.SimpleNamespace(perf_counter=lambda: clock[0])
    try:
        throughput = metrics.Throughput(plan, SEQ, 1, 1000, 1.0)
        cpu = torch.device("cpu")
        log = metrics.MetricsLog(run_dir, True, cpu, STEPS, throughput, False, io.StringIO())
        log.mark(0)
        out = []
        for step in (1, 3, 6):
            clock[0] += 1.0
            out.append(log.train(step, 1.0, 1.0, LR, plan.samples_after(step), 0.0))
        log.close()
        return out
    finally:
        metrics.time = real


def test_throughput_counts_each_steps_own_batch(tmp_path):
    got = run_ranks(_throughput, 1, str(tmp_path))[0]
    sizes = [size for size, _, _ in megatron_steps(RAMP, GLOBAL, MICRO, 1, STEPS)]
    samples = [sizes[0], sizes[1] + sizes[2], sum(sizes[3:6])]  # steps 1, 2-3, 4-6: a second each
    assert [r["tokens_per_s"] for r in got] == [n * SEQ for n in samples]
    assert [r["mfu"] for r in got] == [n * SEQ * 1000 / 1e12 for n in samples]
    assert [r["global_batch_size"] for r in got] == [sizes[0], sizes[2], sizes[5]]
    # the time left: the samples left at the rate of the interval
    assert got[0]["eta_s"] == pytest.approx((sum(sizes) - sizes[0]) / sizes[0])


# --- bad values -----------------------------------------------------------------------------

BASE = ["data.type=dummy", "data.seq_length=16", "train.steps=4", "train.global_batch_size=8"]
BAD = [
    ("3", [], "train.batch_ramp: expected a table {start, increment, samples} or a list"),
    ('"2 2 12"', [], "or a list [start, increment, samples] or none, got '2 2 12'"),
    ("[2, 2]", [], "got [2, 2] (list)"),
    ("[2, 2, 12, 1]", [], "got [2, 2, 12, 1] (list)"),
    ("[2.0, 2, 12]", [], "train.batch_ramp.start: expected an integer, got 2.0"),
    ("[true, 2, 12]", [], "train.batch_ramp.start: expected an integer, got True"),
    ("[0, 2, 12]", [], "train.batch_ramp.start: must be from 1 to"),
    ("[-2, 2, 12]", [], "train.batch_ramp.start: must be from 1 to"),
    ("[2, 0, 12]", [], "train.batch_ramp.increment: must be from 1 to"),
    ("[2, 2, -1]", [], "train.batch_ramp.samples: must be from 0 to 2**62, got -1"),
    ("[2, 2, 0]", [], "train.batch_ramp.samples: ramps over no samples; leave train.batch_ramp"),
    ("{start = 2, increment = 2, sample = 12}", [], "did you mean train.batch_ramp.samples?"),
    ("{start = 2, increment = 2}", [], "train.batch_ramp.samples: required"),
    ("[8, 2, 12]", [], "start must be less than train.global_batch_size=8"),
    ("[10, 2, 12]", [], "start must be less than train.global_batch_size=8"),
    ("[2, 4, 12]", [], "increment does not divide train.global_batch_size - start = 6"),
    ("[3, 5, 12]", ["parallel.dp_shard=2"], "must be a multiple of train.micro_batch_size x"),
    ("[2, 3, 12]", ["train.micro_batch_size=2"], "make start and increment multiples of 2"),
    ("[2, 2, 12]", ["parallel.pp=2"], "with parallel.pp=2 is not supported"),
]


@pytest.mark.parametrize(("value", "more", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_ramps_are_one_line(value, more, message):
    with pytest.raises(ConfigError) as caught:
        config = load_config(None, [*BASE, *more, f"train.batch_ramp={value}"])
        world = config.parallel.world_size
        checked_plan(config, Runtime(0, world, 0, world, torch.device("cpu")))
    text = str(caught.value)
    assert message in text and "train.batch_ramp" in text and "\n" not in text, text


def test_a_field_override_updates_the_ramp_or_makes_one_checked_whole():
    """`train.batch_ramp.samples=24` over a ramp (written as a list) changes that field alone;
    with no ramp yet, the one field is a ramp missing the others."""
    ramp = load_config(None, [*BASE, "train.batch_ramp=[2, 2, 12]", "train.batch_ramp.samples=24"])
    ramp = ramp.train.batch_ramp
    assert (ramp.start, ramp.increment, ramp.samples) == (2, 2, 24)
    with pytest.raises(ConfigError, match=r"^train.batch_ramp.increment: required"):
        load_config(None, [*BASE, "train.batch_ramp.start=2"])


def test_the_cli_refuses_a_bad_ramp_in_one_line(tmp_path):
    done = hp_train_here(*FAST, *BASE, "train.batch_ramp=[2,4,12]", f"train.run_dir={tmp_path}")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.batch_ramp = [2, 4, 12]: increment" in lines[0], lines
