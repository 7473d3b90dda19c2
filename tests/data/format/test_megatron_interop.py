"""hp's files are byte-identical to megatron-core's, and both readers agree on either's files."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from hp_data import IndexedDataset

from tests.helpers.corpus import random_corpus, write_with_hp, write_with_megatron

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")

CASES = [
    (seed, dtype, multimodal)
    for seed in range(4)
    for dtype in (np.uint16, np.int32)
    for multimodal in (False, True)
] + [(9, np.uint8, False), (10, np.int64, False), (11, np.float32, False), (12, np.int16, False)]


def _bytes(prefix: str) -> tuple[bytes, bytes]:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


@pytest.mark.parametrize(("seed", "dtype", "multimodal"), CASES)
def test_hp_writes_the_same_bytes_as_megatron(tmp_path, seed, dtype, multimodal):
    corpus = random_corpus(seed, dtype)
    # The seeded corpora must exercise the edge cases the format has to get right.
    if seed == 0:
        assert any(len(d) == 0 for d in corpus.documents)
        assert any(len(s) == 0 for s in corpus.sequences)
        assert any(len(d) > 1 for d in corpus.documents)
    theirs = write_with_megatron(str(tmp_path / "megatron"), corpus, multimodal)
    by_item = write_with_hp(str(tmp_path / "hp_item"), corpus, multimodal, per_item=True)
    by_doc = write_with_hp(str(tmp_path / "hp_doc"), corpus, multimodal, per_item=False)
    assert _bytes(by_item) == _bytes(theirs)
    assert _bytes(by_doc) == _bytes(theirs)


@pytest.mark.parametrize(("seed", "dtype", "multimodal"), CASES)
@pytest.mark.parametrize("mmap", [True, False])
def test_hp_reads_what_megatron_reads(tmp_path, seed, dtype, multimodal, mmap):
    corpus = random_corpus(seed, dtype)
    prefix = write_with_megatron(str(tmp_path / "megatron"), corpus, multimodal)
    theirs = indexed.IndexedDataset(prefix, multimodal=multimodal, mmap=mmap)
    ours = IndexedDataset(prefix, multimodal=multimodal, mmap=mmap)

    assert len(ours) == len(theirs) == len(corpus.sequences)
    assert ours.dtype == theirs.index.dtype
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    if multimodal:
        np.testing.assert_array_equal(ours.sequence_modes, theirs.index.sequence_modes)
        np.testing.assert_array_equal(ours.sequence_modes, corpus.flat_modes)
    for i, expected in enumerate(corpus.sequences):
        mine, reference = ours[i], theirs[i]
        if multimodal:
            assert mine[1] == reference[1]
            mine, reference = mine[0], reference[0]
        np.testing.assert_array_equal(mine, reference)
        np.testing.assert_array_equal(mine, expected)
        assert mine.dtype == reference.dtype
        if len(expected) > 2:
            mine, reference = ours.get(i, 1, 2), theirs.get(i, 1, 2)
            if multimodal:
                assert mine[1] == reference[1]
                mine, reference = mine[0], reference[0]
            np.testing.assert_array_equal(mine, reference)
            np.testing.assert_array_equal(mine, expected[1:3])
    if len(ours) > 3:
        mine, reference = ours[1:4], theirs[1:4]
        if multimodal:
            np.testing.assert_array_equal(mine[1], reference[1])
            mine, reference = mine[0], reference[0]
        assert len(mine) == len(reference) == 3
        for a, b in zip(mine, reference, strict=True):
            np.testing.assert_array_equal(a, b)
    for d in range(len(corpus.documents)):
        np.testing.assert_array_equal(ours.get_document(d), corpus.document_tokens(d))


def test_megatron_reads_what_hp_writes(tmp_path):
    corpus = random_corpus(21, np.int32)
    prefix = write_with_hp(str(tmp_path / "hp"), corpus, multimodal=True)
    theirs = indexed.IndexedDataset(prefix, multimodal=True)
    assert len(theirs) == len(corpus.sequences)
    for i, expected in enumerate(corpus.sequences):
        tokens, mode = theirs[i]
        np.testing.assert_array_equal(tokens, expected)
        assert mode == corpus.flat_modes[i]
