"""What the builder writes, the reader returns: every dtype, every access path."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hp_data import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from hp_data.format import DTYPE_CODES

from tests.helpers.corpus import random_corpus, write_with_hp


@pytest.mark.parametrize("dtype", list(DTYPE_CODES.values()), ids=str)
@pytest.mark.parametrize("per_item", [True, False])
@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_every_dtype(tmp_path, dtype, per_item, mmap):
    corpus = random_corpus(7, dtype)
    prefix = write_with_hp(str(tmp_path / "ds"), corpus, per_item=per_item)
    ds = IndexedDataset(prefix, mmap=mmap)
    assert ds.dtype == dtype
    assert len(ds) == len(corpus.sequences)
    assert ds.num_documents == len(corpus.documents)
    assert ds.num_tokens == sum(len(s) for s in corpus.sequences)
    for i, expected in enumerate(corpus.sequences):
        np.testing.assert_array_equal(ds[i], expected)
        assert ds[i].dtype == dtype
    for d in range(ds.num_documents):
        np.testing.assert_array_equal(ds.get_document(d), corpus.document_tokens(d))
    everything = ds[:]
    assert len(everything) == len(corpus.sequences)
    for got, expected in zip(everything, corpus.sequences, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_reads_are_zero_copy_views_when_mmapped(tmp_path):
    prefix = write_with_hp(str(tmp_path / "ds"), random_corpus(3, np.int32))
    ds = IndexedDataset(prefix)
    longest = int(np.argmax(ds.sequence_lengths))
    tokens = ds[longest]
    assert not tokens.flags.owndata
    assert not tokens.flags.writeable
    # Two reads of the same sequence share the mapped memory.
    assert np.shares_memory(tokens, ds.get(longest, 1))
    copied = IndexedDataset(prefix, mmap=False)[longest]
    assert copied.flags.owndata


def test_negative_indices_slices_and_get(tmp_path):
    corpus = random_corpus(5, np.uint16)
    ds = IndexedDataset(write_with_hp(str(tmp_path / "ds"), corpus))
    sequences = corpus.sequences
    np.testing.assert_array_equal(ds[-1], sequences[-1])
    np.testing.assert_array_equal(ds.get_document(-1), corpus.document_tokens(-1))
    assert ds[3:3] == []
    for got, expected in zip(ds[2:7], sequences[2:7], strict=True):
        np.testing.assert_array_equal(got, expected)
    longest = int(np.argmax(ds.sequence_lengths))
    np.testing.assert_array_equal(ds.get(longest, 2, 5), sequences[longest][2:7])
    np.testing.assert_array_equal(ds.get(longest, 4), sequences[longest][4:])
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds.get(longest, 1, int(ds.sequence_lengths[longest]))
    with pytest.raises(IndexError):
        ds.get_document(ds.num_documents)
    with pytest.raises(ValueError, match="contiguous"):
        ds[::2]
    with pytest.raises(TypeError):
        ds["0"]


def test_pickles_for_dataloader_workers(tmp_path):
    corpus = random_corpus(8, np.uint16)
    ds = IndexedDataset(write_with_hp(str(tmp_path / "ds"), corpus))
    clone = pickle.loads(pickle.dumps(ds))
    for i in range(len(ds)):
        np.testing.assert_array_equal(clone[i], ds[i])


def test_multimodal_modes_round_trip(tmp_path):
    corpus = random_corpus(4, np.int32)
    ds = IndexedDataset(
        write_with_hp(str(tmp_path / "ds"), corpus, multimodal=True), multimodal=True
    )
    np.testing.assert_array_equal(ds.sequence_modes, corpus.flat_modes)
    tokens, mode = ds[0]
    assert mode == corpus.flat_modes[0]
    # A text-only reader opens a multimodal file and ignores the modes, as megatron-core does.
    plain = IndexedDataset(ds.path_prefix)
    assert plain.sequence_modes is None
    np.testing.assert_array_equal(plain[0], tokens)


def test_empty_dataset(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "empty", np.uint16):
        pass
    ds = IndexedDataset(tmp_path / "empty")
    assert (len(ds), ds.num_documents, ds.num_tokens) == (0, 0, 0)
    assert ds[:] == []


@pytest.mark.parametrize(
    ("vocab_size", "expected"),
    [
        (0, np.uint16),
        (8192, np.uint16),
        (65535, np.uint16),
        (65536, np.uint16),
        (65537, np.int32),
        (128256, np.int32),
    ],
)
def test_optimal_dtype(vocab_size, expected):
    assert optimal_dtype(vocab_size) == expected
