"""Blends built from a --data-path spec equal megatron-core's BlendedMegatronDatasetBuilder."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hp_data import HpDataError
from hp_data.blend import BlendableDataset, build_datasets, parse_blend, sizes_per_dataset
from hp_data.gpt import GPTDataset, GPTDatasetConfig

from tests.helpers.corpus import random_corpus, write_with_hp
from tests.helpers.megatron import build_megatron

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core.datasets.gpt_dataset")


def _megatron(sizes, seq_length, seed, split=None, blend=None, blend_per_split=None):
    return build_megatron(
        sizes, seq_length, seed, split=split, blend=blend, blend_per_split=blend_per_split
    )


@pytest.fixture
def corpora(tmp_path):
    return [
        write_with_hp(str(tmp_path / f"c{i}"), random_corpus(10 + i, np.uint16, 150, 80))
        for i in range(3)
    ]


def _check(ours, theirs):
    assert len(ours) == len(theirs)
    np.testing.assert_array_equal(ours.dataset_index, theirs.dataset_index)
    np.testing.assert_array_equal(ours.dataset_sample_index, theirs.dataset_sample_index)
    for mine, reference in zip(ours.datasets, theirs.datasets, strict=True):
        assert len(mine) == len(reference)
        np.testing.assert_array_equal(mine.shuffle_index, reference.shuffle_index)
    for j in range(0, len(ours), 7):
        item, reference = ours[j], theirs[j]
        assert item["dataset_id"] == int(reference["dataset_id"])
        np.testing.assert_array_equal(item["tokens"], reference["tokens"].numpy())


@pytest.mark.parametrize("weights", [(0.3, 0.7, None), (1, 1, 1), (0.001, 0.5, 0.499)])
def test_weighted_blend_equals_megatrons(tmp_path, corpora, weights):
    used = [(w, p) for w, p in zip(weights, corpora, strict=False) if w is not None]
    flat = [str(x) for pair in used for x in pair]
    sizes = [700, 60, 20]
    theirs = _megatron(
        sizes, 16, 7, split="90,8,2", blend=([p for _, p in used], [float(w) for w, _ in used])
    )
    config = GPTDatasetConfig(seq_length=16, seed=7, split="90,8,2", cache_dir=str(tmp_path / "h"))
    ours = build_datasets(" ".join(flat), config, sizes)
    for mine, reference in zip(ours, theirs, strict=True):
        _check(mine, reference)


def test_per_split_blends_equal_megatrons(tmp_path, corpora):
    per_split = [([corpora[0], corpora[1]], [0.4, 0.6]), None, ([corpora[2]], None)]
    theirs = _megatron([300, None, None], 16, 3, blend_per_split=per_split)
    config = GPTDatasetConfig(seq_length=16, seed=3, cache_dir=str(tmp_path / "h"))
    ours = build_datasets(
        None,
        config,
        [300, None, None],
        blend_per_split=[[(0.4, corpora[0]), (0.6, corpora[1])], None, corpora[2]],
    )
    assert ours[1] is None and theirs[1] is None
    _check(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[2].shuffle_index, theirs[2].shuffle_index)


def test_spec_forms_agree():
    expected = (["/a", "/b"], [0.3, 0.7])
    assert parse_blend("0.3 /a 0.7 /b") == expected
    assert parse_blend(["0.3", "/a", "0.7", "/b"]) == expected
    assert parse_blend([(0.3, "/a"), (0.7, "/b")]) == expected
    assert parse_blend("/only") == (["/only"], None)
    for bad, message in [
        ("0.3 /a 0.7", "weight/prefix pairs"),
        ("x /a y /b", "not a weight"),
        ("0 /a 1 /b", "must be positive"),
        ("", "empty"),
    ]:
        with pytest.raises(HpDataError, match=message):
            parse_blend(bad)


def test_targets_and_surplus():
    assert sizes_per_dataset([0.3, 0.7], 1000) == [300, 700]
    assert sizes_per_dataset([0.3, 0.7], 1000, 0.005) == [302, 704]  # ceil(300*1.005)=302 etc.
    assert sizes_per_dataset([1 / 3] * 3, 10) == [4, 4, 4]


def test_oversampling_is_an_error_unless_wrapping_is_asked(tmp_path, corpora):
    config = GPTDatasetConfig(seq_length=16, seed=1, split="1,0,0", cache_dir=str(tmp_path / "h"))
    small = GPTDataset(corpora[0], "train", None, config)  # one epoch only
    big = GPTDataset(corpora[1], "train", 5000, config)
    with pytest.raises(
        HpDataError,
        match=rf"asks {corpora[0]} for \d+ samples but it has "
        rf"{len(small)}; raise its num_samples",
    ):
        BlendableDataset([small, big], [0.5, 0.5], 4 * len(small), "train", str(tmp_path / "h"))
    with pytest.warns(UserWarning, match="wraps around"):
        wrapped = BlendableDataset(
            [small, big], [0.5, 0.5], 4 * len(small), "train", str(tmp_path / "h"), allow_wrap=True
        )
    ids = [j for j in range(len(wrapped)) if wrapped.dataset_index[j] == 0]
    last = wrapped[ids[-1]]
    first = small[int(wrapped.dataset_sample_index[ids[-1]]) % len(small)]
    np.testing.assert_array_equal(last["tokens"], first["tokens"])
