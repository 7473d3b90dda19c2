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
@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_sample_index_equals_build_sample_idx(seed, extra, drop_last, chunk, monkeypatch):
    if chunk is not None:  # samples and empty documents across the chunks' edges
        monkeypatch.setattr(index, "CHUNK", chunk)
    rng = np.random.default_rng(seed)
    sizes = _sizes(rng, int(rng.integers(5, 400)))
    epochs = int(rng.integers(1, 4))
    documents = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
    rng.shuffle(documents)
    tokens_per_epoch = int(sizes.sum())
    seq_length = int(rng.choice([2, 3, 7, 64, 257, 1000]))
    if epochs * tokens_per_epoch - extra < seq_length:
        pytest.skip("corpus shorter than one sample")
    arguments = (sizes, documents, seq_length, epochs, tokens_per_epoch, drop_last, extra)
    try:
        theirs = helpers.build_sample_idx(*arguments)
    except AssertionError:
        # megatron's wrapper asserts offsets >= 0, which its own C++ breaks when a kept
        # partial sample ends on an empty last document (offset -1): the variant it chose.
        theirs = helpers.build_sample_idx_int32(*arguments)
    ours = index.build_sample_index(*arguments)
    assert ours.dtype == theirs.dtype == np.int32
    np.testing.assert_array_equal(ours, theirs)
    if chunk is None:  # the transcription used past int32 below is megatron's C++ too
        np.testing.assert_array_equal(_build_sample_idx_in_python(*arguments), theirs)


def _build_sample_idx_in_python(sizes, documents, seq_length, epochs, tokens, drop_last, extra):
    """megatron-core's C++ `build_sample_idx`, line for line, on Python ints (no overflow)."""
    if drop_last:
        count = (epochs * tokens - extra) // seq_length
    else:
        count = int(np.ceil(np.float32(epochs * tokens - extra) / np.float32(seq_length)))
    rows = [(0, 0)]
    position = offset = 0
    while len(rows) <= count:
        remaining = seq_length + extra
        while remaining != 0:
            length = int(sizes[documents[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            else:
                if position == len(documents) - 1:
                    offset = int(sizes[documents[position]]) - extra
                    break
                position += 1
                offset = 0
        rows.append((position, offset))
    return np.array(rows, dtype=np.int64)


@pytest.mark.parametrize("extra", [0, 1])
def test_sample_index_past_int32_is_int64_with_the_same_numbers(extra):
    # Sequences longer than int32 can hold (megatron's C++ takes int32 sizes): offsets past
    # 2^31 must be exact, in int64.
    sizes = np.array([3 * 2**31 + 5, 0, 7, 2**31 + 1, 12], dtype=np.int64)
    documents = np.array([3, 0, 1, 4, 2, 0], dtype=np.int32)
    tokens = int(sizes[documents].sum()) // 2  # two epochs' worth in `documents`
    arguments = (sizes, documents, 2**30 + 3, 2, tokens, True, extra)
    ours = index.build_sample_index(*arguments)
    assert ours.dtype == np.int64 and ours[:, 1].max() > 2**31
    np.testing.assert_array_equal(ours, _build_sample_idx_in_python(*arguments))


def _megatrons_sample_index_dtype(length: int, max_size: int, monkeypatch) -> np.dtype:
    """Which of its C++ variants megatron's `build_sample_idx` calls for a document index of
    `length` and sizes up to `max_size` (the arrays are broadcast: no memory, no work)."""
    chosen = []

    def variant(dtype):
        def build(*args):
            chosen.append(np.dtype(dtype))
            return np.zeros((1, 2), dtype)

        return build

    monkeypatch.setattr(helpers, "build_sample_idx_int32", variant(np.int32))
    monkeypatch.setattr(helpers, "build_sample_idx_int64", variant(np.int64))
    sizes_dtype = np.int32 if max_size <= np.iinfo(np.int32).max else np.int64
    sizes = np.broadcast_to(np.array(max_size, sizes_dtype), (3,))
    documents = np.broadcast_to(np.int32(0), (length,))
    helpers.build_sample_idx(sizes, documents, 8, 1, 100)
    return chosen[0]


@pytest.mark.parametrize("length", [1, 2**31 - 1, 2**31, 2**33])
@pytest.mark.parametrize("max_size", [5, 2**31 - 1, 2**31])
def test_sample_index_dtype_is_megatrons_choice(length, max_size, monkeypatch):
    expected = _megatrons_sample_index_dtype(length, max_size, monkeypatch)
    sizes = np.array([max_size], np.int32 if max_size < 2**31 else np.int64)
    assert index.sample_index_dtype(length, index._max_size(sizes)) == expected


@pytest.mark.parametrize("total", [0, 10, 2**32 - 3, 2**32 - 2, 2**32 - 1, 2**40])
def test_shuffle_index_dtype_is_megatrons_choice(total, monkeypatch):
    # megatron's _build_shuffle_index, its numpy.arange recorded instead of run.
    made = []

    class Numpy:
        def __getattr__(self, name):
            return getattr(np, name)

        def arange(self, start, stop, step, dtype):
            made.append(np.dtype(dtype))
            return np.zeros(1, dtype)

    monkeypatch.setattr(gpt, "numpy", Numpy())
    gpt._build_shuffle_index(total, total, np.random.RandomState(0))
    assert index.shuffle_index_dtype(total) == made[0]


def test_document_ids_past_int32_are_kept_in_int64():
    # megatron-core casts the document index to int32 (wrapping such ids); hp widens instead.
    for documents, dtype in (([0, 2**31 - 1], np.int32), ([0, 2**31], np.int64)):
        built = index.build_document_index(
            np.array(documents, np.int64), 3, np.random.RandomState(0), False
        )
        assert built.dtype == dtype
        assert sorted(built.tolist()) == sorted(documents * 3)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("epochs", [1, 2, 5])
@pytest.mark.parametrize("separate", [False, True])
def test_document_and_shuffle_indices_equal_megatrons(seed, epochs, separate):
    documents = np.arange(3, 3 + int(np.random.default_rng(seed).integers(1, 500)), dtype=np.int32)
    theirs_rng, ours_rng = np.random.RandomState(seed), np.random.RandomState(seed)
    theirs = gpt._build_document_index(documents, epochs, theirs_rng, separate)
    ours = index.build_document_index(documents, epochs, ours_rng, separate)
    assert ours.dtype == theirs.dtype == np.int32
    np.testing.assert_array_equal(ours, theirs)
    # The same ids given as a range (how GPTDataset passes a split) give the same index.
    as_range = index.build_document_index(
        range(3, 3 + len(documents)), epochs, np.random.RandomState(seed), separate
    )
    assert as_range.dtype == np.int32
    np.testing.assert_array_equal(as_range, theirs)
    total = 7 * len(documents)
    cut = total if not separate else total - len(documents)
    ours_shuffle = index.build_shuffle_index(cut, total, ours_rng)
    theirs_shuffle = gpt._build_shuffle_index(cut, total, theirs_rng)
    assert ours_shuffle.dtype == theirs_shuffle.dtype == np.uint32
    np.testing.assert_array_equal(ours_shuffle, theirs_shuffle)


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
@pytest.mark.parametrize("size", [0, 1, 2, 4_999, 200_003])  # plain Python, then numba
def test_blending_indices_equal_build_blending_indices(weights, size):
    if isinstance(weights, str):
        rng = np.random.default_rng(len(weights))
        raw = rng.random(int(weights[6:])) ** 3 + 1e-4
        weights = (raw / raw.sum()).tolist()
    theirs_dataset = np.zeros(size, dtype=np.int16)
    theirs_sample = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        theirs_dataset, theirs_sample, np.array(weights), len(weights), size, False
    )
    ours_dataset, ours_sample = index.build_blending_indices(weights, size)
    assert ours_dataset.dtype == theirs_dataset.dtype
    assert ours_sample.dtype == theirs_sample.dtype
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
