"""How a run's batches and sample counts are planned (Megatron's arithmetic)."""

from __future__ import annotations

import pytest
from hp_runtime.train.config import ConfigError, load_config
from hp_runtime.train.data import batch_plan, sample_counts


def _config(*overrides: str):
    return load_config(None, ["data.type=dummy", "data.seq_length=16", *overrides])


def test_megatron_sample_counts():
    config = _config(
        "train.steps=100",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "parallel.dp_shard=2",
        "train.eval_interval=10",
        "train.eval_iters=5",
    )
    plan = batch_plan(config)
    assert (plan.global_batch_size, plan.dp_size, plan.accumulation) == (8, 2, 2)
    # Megatron: train_iters * gbs; eval_iters * gbs * (train_iters // eval_interval + 1)
    assert sample_counts(config, plan) == (800, 5 * 8 * 11)
    assert sample_counts(_config("train.steps=7"), batch_plan(_config("train.steps=7"))) == (7, 0)


def test_default_global_batch_is_one_micro_batch_per_rank():
    plan = batch_plan(_config("train.steps=1", "train.micro_batch_size=3", "parallel.dp_shard=4"))
    assert (plan.global_batch_size, plan.accumulation) == (12, 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.global_batch_size=10", "train.micro_batch_size=4"],
            "train.global_batch_size=10 is not a multiple of train.micro_batch_size x "
            "data-parallel size = 4 x 1 = 4",
        ),
        (
            ["train.global_batch_size=12", "parallel.pp=2", "parallel.pp_microbatches=5"],
            "parallel.pp_microbatches=5 does not divide the 12 micro-batches per step",
        ),
    ],
)
def test_batches_that_do_not_fit(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        batch_plan(_config("train.steps=1", *overrides))
