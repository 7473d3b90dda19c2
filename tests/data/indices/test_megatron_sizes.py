"""build-index takes a Megatron user's sizes (--train-iters, --global-batch-size, ...) and, for
a weighted blend without a count, one epoch of the dataset its weight uses up first."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hp_data.blend import build_datasets, megatron_sample_counts, split_sample_counts
from hp_data.cli import main
from hp_data.errors import ArgumentError, HpDataError
from hp_data.gpt import GPTDatasetConfig

from tests.helpers.corpus import random_corpus, write_with_hp
from tests.helpers.megatron import build_megatron


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("sizes")
    out = []
    for seed in (3, 4):
        corpus = random_corpus(seed, max_documents=60, max_length=200)
        write_with_hp(str(root / f"d{seed}"), corpus)
        out.append(str(root / f"d{seed}"))
    return out


def test_megatron_sizes_by_hand():
    # Megatron-LM's training.py: train = iters x batch; valid = (iters // interval + 1) x
    # eval iters x batch; test = eval iters x batch; --train-samples sets iters = samples // batch.
    assert megatron_sample_counts(None, 2000, 8, 10, 500) == [16000, 400, 80]
    assert megatron_sample_counts(1003, None, 10, 5, 40) == [1003, 150, 50]
    assert megatron_sample_counts(None, 0, 4) == [0, 400, 400]
    # An eval interval of 0: no validation during training (hp-train's train.eval_interval).
    assert megatron_sample_counts(None, 2000, 8, 10, 0) == [16000, 0, 80]


def test_the_python_api_sizes_the_splits_as_build_index_does():
    # Megatron's sizes, by hand as above; Megatron's eval defaults are 100 iters every 1000.
    sizes = dict(train_iters=2000, global_batch_size=8, eval_iters=10, eval_interval=500)
    assert split_sample_counts(**sizes) == [16000, 400, 80]
    # 1003 samples of batch 10: 100 iterations, one evaluation of 100 x 10, a test of 100 x 10.
    assert split_sample_counts(train_samples=1003, global_batch_size=10) == [1003, 1000, 1000]
    # Counts as given, a missing one (None) being one epoch.
    assert split_sample_counts([5]) == [5, None, None]
    assert split_sample_counts([5, 0, 2]) == [5, 0, 2]
    assert split_sample_counts() == [None, None, None]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(num_samples=[5], train_iters=1, global_batch_size=1), "give one of --num-samples"),
        (dict(train_samples=5, train_iters=1, global_batch_size=1), "give one of --num-samples"),
        (dict(train_iters=10), "--train-samples and --train-iters need --global-batch-size"),
        (dict(num_samples=[5], global_batch_size=8), "--global-batch-size sizes the splits only"),
        (dict(eval_iters=5), "--eval-iters sizes the splits only with --train-iters"),
        (dict(eval_interval=0), "--eval-interval sizes the splits only with --train-iters"),
    ],
)
def test_the_python_api_refuses_sizes_that_one_would_ignore(sizes, message):
    with pytest.raises(ArgumentError, match=message) as raised:
        split_sample_counts(**sizes)
    assert isinstance(raised.value, HpDataError)  # a Python caller catches it as any other


def test_build_index_with_eval_interval_0_asks_no_valid_samples(tmp_path, prefixes):
    args = ["build-index", "--data-path", prefixes[0], "--seq-length", "16", "--seed", "7"]
    args += ["--split", "80,15,5", "--data-cache-path", str(tmp_path / "hp")]
    args += ["--train-iters", "40", "--global-batch-size", "4", "--eval-iters", "2"]
    result = CliRunner().invoke(main, [*args, "--eval-interval", "0", "--json"])
    assert result.exit_code == 0, result.output
    splits = json.loads(result.stdout)["splits"]
    # Megatron's sizes with no validation: train iters x batch, none, eval iters x batch; and
    # the datasets megatron-core builds for those counts.
    megatron = build_megatron(
        [160, 0, 2 * 4], 16, 7, blend=([prefixes[0]], None), split="80,15,5",
        cache=str(tmp_path / "m"),
    )  # fmt: skip
    for name, dataset in zip(("train", "valid", "test"), megatron, strict=True):
        assert splits[name]["samples"] == len(dataset), name
    # megatron-core indexes one epoch for any count up to one: the count asked is recorded.
    (described,) = [f for f in splits["valid"]["files"] if f.endswith("description.json")]
    with open(described) as stream:
        assert json.load(stream)["num_samples"] == 0


def test_build_index_with_megatrons_flags_equals_megatron(tmp_path, prefixes):
    args = ["build-index", "--data-path", prefixes[0], "--seq-length", "16", "--seed", "7"]
    args += ["--split", "80,15,5"]
    args += ["--data-cache-path", str(tmp_path / "hp"), "--train-iters", "40"]
    args += ["--global-batch-size", "4", "--eval-iters", "2", "--eval-interval", "10", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    splits = json.loads(result.stdout)["splits"]
    sizes = [160, (40 // 10 + 1) * 2 * 4, 2 * 4]
    megatron = build_megatron(
        sizes, 16, 7, blend=([prefixes[0]], None), split="80,15,5", cache=str(tmp_path / "m")
    )
    for name, dataset in zip(("train", "valid", "test"), megatron, strict=True):
        assert splits[name]["samples"] == len(dataset), name


def test_a_weighted_blend_without_a_count_takes_the_epoch_its_weight_uses_up_first(
    tmp_path, prefixes
):
    weights = [0.25, 0.75]
    config = GPTDatasetConfig(seq_length=16, seed=1, split="1,0,0", cache_dir=str(tmp_path))
    spec = f"{weights[0]} {prefixes[0]} {weights[1]} {prefixes[1]}"
    train = build_datasets(spec, config)[0]
    # One epoch of each, as megatron-core counts it (num_samples None).
    epochs = [
        len(build_megatron([None, None, None], 16, 1, blend=([p], None), split="1,0,0")[0])
        for p in prefixes
    ]
    expected = min(int(epoch / weight) for epoch, weight in zip(epochs, weights, strict=True))
    assert len(train) == expected
    # No dataset is drawn past its one epoch by much (megatron's 0.5% surplus aside).
    drawn = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert all(d <= np.ceil(e * 1.005) for d, e in zip(drawn, epochs, strict=True))
