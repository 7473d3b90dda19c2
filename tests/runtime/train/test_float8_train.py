"""`train.float8` through hp-train: bad tables refused in one line; the scales of the float8
all-gather kept fresh after every step; a float8 run resumes without float8 and the other way
round (the checkpoint holds the fp32 masters only); the float8 loss curve follows fp32's."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.helpers.train import FAST, corpus_overrides, hp_train_here, records, train_ranks

pytest.importorskip("torchao")

# tiny with a feed-forward float8 can take (its own 172 is not a multiple of 16)
BASE = [
    *FAST, "data.type=dummy", "data.seq_length=32", "model.ffn_hidden=128",
    "train.micro_batch_size=2", "train.global_batch_size=4", "optim.lr=1e-2",
    "optim.warmup_steps=0", "optim.decay_style=constant", "train.eval_interval=0",
    "checkpoint.interval=3",
]  # fmt: skip
TENSORWISE = "train.float8.recipe=tensorwise"

BAD = {
    "unknown recipe": (["train.float8.recipe=fp4"], "train.float8.recipe"),
    "recipe of another type": (["train.float8.recipe=8"], "train.float8.recipe"),
    "not a table": (["train.float8=3"], "train.float8"),
    "unknown field": (["train.float8.scaling=dynamic"], "train.float8.scaling"),
    "all-gather not a bool": (["train.float8.fsdp_all_gather=1"], "train.float8.fsdp_all_gather"),
    "all-gather without FSDP": (["train.float8.fsdp_all_gather=true"], "parallel.dp_shard"),
    "all-gather rowwise": (
        ["train.float8.recipe=rowwise", "train.float8.fsdp_all_gather=true", "parallel.dp_shard=2"],
        "train.float8.fsdp_all_gather",
    ),
    "all-gather power-of-2": (
        [
            "train.float8.fsdp_all_gather=true",
            "train.float8.round_scales_to_power_of_2=true",
            "parallel.dp_shard=2",
        ],
        "train.float8.round_scales_to_power_of_2",
    ),
    "power-of-2 not a bool": (
        ["train.float8.round_scales_to_power_of_2=yes"],
        "train.float8.round_scales_to_power_of_2",
    ),
    "mxfp8 unrounded": (
        ["train.float8.recipe=mxfp8", "train.float8.round_scales_to_power_of_2=false"],
        "train.float8.round_scales_to_power_of_2",
    ),
    "mxfp8 under TP": (["train.float8.recipe=mxfp8", "parallel.tp=2"], "parallel.tp"),
    "skip matching nothing": (['train.float8.skip=["wq", "attention.wz"]'], "'attention.wz'"),
    "skip not a list": (["train.float8.skip=wo"], "train.float8.skip"),
    "skip of numbers": (["train.float8.skip=[1]"], "train.float8.skip"),
    "tokens not a multiple of 16": (
        [
            "train.float8.recipe=rowwise",
            "data.seq_length=24",
            "train.micro_batch_size=1",
            "train.global_batch_size=1",
        ],
        "train.micro_batch_size x data.seq_length",
    ),
    "mxfp8 tokens not a multiple of 32": (
        [
            "train.float8.recipe=mxfp8",
            "data.seq_length=48",
            "train.micro_batch_size=1",
            "train.global_batch_size=1",
        ],
        "must be a multiple of 32",
    ),
    "all-gather with shared experts under TP": (
        [
            "train.float8.fsdp_all_gather=true",
            "model.preset=moe-tiny",
            "parallel.tp=2",
            "model.moe.shared_experts=1",
            "parallel.dp_shard=2",
        ],
        "model.moe.shared_experts",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_float8_table_is_refused_in_one_line(case, tmp_path):
    overrides, named = BAD[case]
    run = tmp_path / "run"
    done = hp_train_here(*BASE, "train.steps=1", f"train.run_dir={run}", *overrides)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hp-train: error: "), done.stderr
    assert named in lines[0] and "Traceback" not in done.stderr
    assert not run.exists()  # refused before the run directory is made


def _run(run_dir, *overrides: str) -> list[tuple[float, float]]:
    done = hp_train_here(*BASE, f"train.run_dir={run_dir}", *overrides)
    assert done.returncode == 0, done.stderr
    return [(r["loss"], r["grad_norm"]) for r in records(run_dir)]


@pytest.mark.parametrize(
    "before, after", [(True, True), (True, False), (False, True)],
    ids=["float8-float8", "float8-fp32", "fp32-float8"],
)  # fmt: skip
def test_a_float8_run_resumes_with_or_without_float8(tmp_path, before, after):
    """Stopped at step 3 and resumed to 6: float8 throughout resumes bit-exactly (torchao's
    dynamic scales keep no state); switched on or off at the resume, the first 3 steps are
    the first run's and the next 3 are close to the uninterrupted run's but not equal to
    them (float8's rounding came or went), so the switch took effect."""
    keys = {True: [TENSORWISE], False: []}
    whole = _run(tmp_path / "whole", "train.steps=6", *keys[before])
    run = tmp_path / "run"
    first = _run(run, "train.steps=3", *keys[before])
    resumed = _run(run, "train.steps=6", *keys[after])
    assert len(resumed) == 6 and resumed[:3] == first == whole[:3]
    if before == after:
        assert resumed == whole
    else:
        assert resumed[3:] != whole[3:]
        np.testing.assert_allclose(resumed[3:], whole[3:], rtol=5e-2)


@pytest.mark.slow
def test_the_all_gathers_scales_follow_each_step():
    """FSDP 2 gathering the weights in float8 trains as gathering them in fp32 and casting
    after: the all-gather's scales are recomputed from each step's new weights
    (`Assembly.weights_changed`); stale ones would cast with the last step's amax."""
    layout = [*BASE, "train.steps=5", "checkpoint.interval=0", "parallel.dp_shard=2", TENSORWISE]
    runs = [
        train_ranks(2, [*layout, f"train.float8.fsdp_all_gather={gather}"])[0]
        for gather in ("true", "false")
    ]
    assert runs[0]["losses"] == runs[1]["losses"]
    assert runs[0]["grad_norms"] == runs[1]["grad_norms"]


@pytest.mark.slow
def test_the_float8_curve_follows_fp32s(example_corpus, example_tokenizer, tmp_path):
    """100 steps of examples/train_tiny.toml's model and optimizer on the example corpus
    (its feed-forward 128 wide, so that float8 converts it): float8's loss within 2% of
    fp32's at every logged step, and still learning."""
    tiny = [
        *corpus_overrides(example_corpus, example_tokenizer, tmp_path / "cache"),
        "data.seq_length=128", "model.max_seq_len=128", "train.micro_batch_size=8",
        "train.global_batch_size=16", "optim.lr=1e-2", "optim.min_lr=1e-3",
        "optim.warmup_steps=20", "optim.decay_style=cosine", "train.steps=100",
        "train.eval_interval=0", "checkpoint.interval=0", "metrics.log_interval=10",
        "model.ffn_hidden=128",
    ]  # fmt: skip
    curves = []
    for float8 in ([], [TENSORWISE]):
        run = tmp_path / f"run{len(curves)}"
        done = hp_train_here(*FAST, *tiny, f"train.run_dir={run}", *float8)
        assert done.returncode == 0, done.stderr
        curves.append(np.array([r["loss"] for r in records(run)]))
    fp32, float8 = curves
    assert len(fp32) == 10 and fp32[-1] < fp32[0] - 1.0
    assert not np.array_equal(fp32, float8)
    np.testing.assert_allclose(float8, fp32, rtol=2e-2)


def test_without_torchao_the_table_is_refused_in_one_line(monkeypatch, tmp_path):
    """torchao is an extra: a machine without it says which one to install."""
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # an import of it fails
    run = tmp_path / "run"
    done = hp_train_here(*BASE, "train.steps=1", f"train.run_dir={run}", TENSORWISE)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "hp-train: error: train.float8 needs torchao: pip install 'hp-runtime[float8]'"
    )
    assert not run.exists()


@pytest.mark.slow
def test_a_checkpoint_of_the_float8_all_gather_holds_plain_tensors(tmp_path):
    """FSDP 2 gathering in float8: torchao wraps each converted weight (and AdamW's moments
    made like it) in a tensor subclass of its own; the checkpoint holds the plain data, so it
    loads where torchao is not imported (a resume without float8, an export: names of its
    classes in the files would make torch's safe loading refuse them). Stopped at step 3 and
    resumed with the all-gather, the run is the uninterrupted one bit for bit, which needs
    the gather's scales recomputed after the load (`Setup.run`)."""
    run, whole = tmp_path / "run", tmp_path / "whole"
    layout = [*BASE, "parallel.dp_shard=2", TENSORWISE, "train.float8.fsdp_all_gather=true"]
    straight = train_ranks(2, [*layout, "train.steps=6", f"train.run_dir={whole}"])[0]
    train_ranks(2, [*layout, "train.steps=3", f"train.run_dir={run}"])
    shards = list((run / "checkpoints" / "step-0000003").glob("*.distcp"))
    assert len(shards) == 2
    assert not any(b"torchao" in shard.read_bytes() for shard in shards)
    resumed = train_ranks(2, [*layout, "train.steps=6", f"train.run_dir={run}"])[0]
    assert resumed["losses"] == straight["losses"][3:]
    assert resumed["grad_norms"] == straight["grad_norms"][3:]


def test_tp_reduce_dtype_is_refused_while_float8_converts_a_row_wise_linear():
    """Checked against the model on the machine (`check_float8_here`, as each rank does
    before building it): refused in one line naming the key while `wo` or `w2` converts."""
    from hp_runtime.train.config import load_config
    from hp_runtime.train.config.checks import check_float8_here
    from hp_runtime.train.errors import ConfigError

    layout = [*BASE, "train.steps=1", "parallel.tp=2", "parallel.tp_reduce_dtype=float32",
              TENSORWISE]  # fmt: skip
    for skip in ([], ["wo"], ["w2"]):
        config = load_config(None, [*layout, f"train.float8.skip={skip!r}".replace("'", '"')])
        with pytest.raises(ConfigError, match=r"^parallel.tp_reduce_dtype replaces") as info:
            check_float8_here(config, "cpu")
        assert "\n" not in str(info.value)
    skipped = load_config(None, [*layout, 'train.float8.skip=["wo", "w2"]'])
    check_float8_here(skipped, "cpu")


@pytest.mark.slow
def test_tp_reduce_dtype_trains_with_the_row_wise_linears_skipped():
    """`parallel.tp_reduce_dtype` replaces the row-wise linears' matmul: refused while float8
    converts them (BAD above), taken when `skip` keeps them, and then the run trains as the
    same run without the reduce dtype within fp32's reordering (its partial sums are fp32
    either way on CPU)."""
    layout = [*BASE, "train.steps=3", "checkpoint.interval=0", "parallel.tp=2", TENSORWISE,
              'train.float8.skip=["wo", "w2"]']  # fmt: skip
    runs = [
        train_ranks(2, [*layout, *extra])[0] for extra in ([], ["parallel.tp_reduce_dtype=float32"])
    ]
    np.testing.assert_allclose(runs[1]["losses"], runs[0]["losses"], rtol=1e-5)
