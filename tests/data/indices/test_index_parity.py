"""hp's index functions equal megatron-core's, element for element."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hp_data import index

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    helpers = pytest.importorskip("megatron.core.datasets.helpers")
    gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    config = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_config")


def _sizes(rng: np.random.Generator, count: int, high: int = 300) -> np.ndarray:
    sizes = rng.integers(0, high, count).astype(np.int32)
    sizes[rng.random(count) < 0.1] = 0  # zero-length sequences
    return sizes


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_index_equals_build_sample_idx(seed, extra, drop_last):
    rng = np.random.default_rng(seed)
    sizes = _sizes(rng, int(rng.integers(5, 400)))
    epochs = int(rng.integers(1, 4))
    documents = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
    rng.shuffle(documents)
    tokens_per_epoch = int(sizes.sum())
    seq_length = int(rng.choice([2, 3, 7, 64, 257, 1000]))
    if epochs * tokens_per_epoch - extra < seq_length:
        pytest.skip("corpus shorter than one sample")
    # The C++ function itself: megatron's wrapper asserts offsets >= 0, which its own C++
    # breaks when a kept partial sample ends on an empty last document (offset -1).
    theirs = helpers.build_sample_idx_int64(
        sizes, documents, seq_length, epochs, tokens_per_epoch, drop_last, extra
    )
    ours = index.build_sample_index(
        sizes, documents, seq_length, epochs, tokens_per_epoch, drop_last, extra
    )
    assert ours.dtype == np.int64
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("epochs", [1, 2, 5])
@pytest.mark.parametrize("separate", [False, True])
def test_document_and_shuffle_indices_equal_megatrons(seed, epochs, separate):
    documents = np.arange(3, 3 + int(np.random.default_rng(seed).integers(1, 500)), dtype=np.int32)
    theirs_rng, ours_rng = np.random.RandomState(seed), np.random.RandomState(seed)
    theirs = gpt._build_document_index(documents, epochs, theirs_rng, separate)
    ours = index.build_document_index(documents, epochs, ours_rng, separate)
    assert ours.dtype == np.int64
    np.testing.assert_array_equal(ours, theirs)
    total = 7 * len(documents)
    cut = total if not separate else total - len(documents)
    np.testing.assert_array_equal(
        index.build_shuffle_index(cut, total, ours_rng),
        gpt._build_shuffle_index(cut, total, theirs_rng),
    )


WEIGHT_CASES = [
    [0.5, 0.5],
    [0.3, 0.7],
    [0.001, 0.999],
    [0.999, 0.001],
    [1 / 3, 1 / 3, 1 / 3],
    [0.2, 0.2, 0.2, 0.2, 0.2],
    [0.1, 0.0001, 0.8999],
]


@pytest.mark.parametrize("weights", WEIGHT_CASES + ["random3", "random50", "random300"])
def test_blending_indices_equal_build_blending_indices(weights):
    if isinstance(weights, str):
        rng = np.random.default_rng(len(weights))
        raw = rng.random(int(weights[6:])) ** 3 + 1e-4
        weights = (raw / raw.sum()).tolist()
    size = 200_003
    theirs_dataset = np.zeros(size, dtype=np.int16)
    theirs_sample = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        theirs_dataset, theirs_sample, np.array(weights), len(weights), size, False
    )
    ours_dataset, ours_sample = index.build_blending_indices(weights, size)
    np.testing.assert_array_equal(ours_dataset, theirs_dataset)
    np.testing.assert_array_equal(ours_sample, theirs_sample)
    # Per-dataset sample ids run 0, 1, 2, ...
    for k in range(len(weights)):
        picked = ours_sample[ours_dataset == k]
        np.testing.assert_array_equal(picked, np.arange(len(picked)))


@pytest.mark.parametrize(
    "split", ["969,30,1", "99,1,0", "1,0,0", "100", "0.8 0.1 0.1", "0,1,0", "2,2,2", "98,2"]
)
def test_split_parsing_and_ranges(split):
    vector = config.parse_and_normalize_split(split)
    assert index.parse_split(split) == vector
    matrix = config.convert_split_vector_to_split_matrix(vector)
    for n in (0, 1, 7, 1000, 12345):
        expected = [
            None if m is None else (round(m[0] * float(n)), round(m[1] * float(n))) for m in matrix
        ]
        assert index.split_ranges(n, vector) == expected


@pytest.mark.parametrize("tokens", [1, 17, 1000, 4097])
@pytest.mark.parametrize("samples", [None, 0, 1, 5, 999])
@pytest.mark.parametrize("extra", [0, 1])
def test_num_epochs_matches_megatrons_loop(tokens, samples, extra):
    seq = 64
    epochs, have = 1, tokens
    if samples is not None:
        while have < samples * seq + extra:
            epochs += 1
            have += tokens
    assert index.num_epochs_for(tokens, samples, seq, extra) == epochs


def test_bad_splits_are_refused():
    for bad in ("0,0,0", "1,2,3,4", "-1,2"):
        with pytest.raises(index.IndexBuildError, match="split"):
            index.parse_split(bad if bad != "-1,2" else [-1.0, 2.0])
