"""Merging equals building in one go; inputs by prefix, glob or directory; dtypes must agree."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hp_data import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, merge_datasets
from hp_data.format import expand_prefixes

from tests.helpers.corpus import Corpus, random_corpus, write_with_hp


def _bytes(prefix) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.mark.parametrize("multimodal", [False, True])
def test_merge_equals_building_in_one_go(tmp_path, multimodal):
    parts = [random_corpus(seed, np.int32) for seed in (1, 2, 3)]
    prefixes = [
        write_with_hp(str(tmp_path / f"part{i}"), c, multimodal) for i, c in enumerate(parts)
    ]
    whole = Corpus(
        np.dtype(np.int32),
        [d for c in parts for d in c.documents],
        [m for c in parts for m in c.modes],
    )
    write_with_hp(str(tmp_path / "whole"), whole, multimodal)
    merge_datasets(str(tmp_path / "merged"), prefixes, multimodal=multimodal)
    assert _bytes(tmp_path / "merged") == _bytes(tmp_path / "whole")


def test_inputs_by_glob_and_directory_keep_a_stable_order(tmp_path):
    shards = tmp_path / "shards"
    for i in (2, 0, 1):
        write_with_hp(str(shards / f"shard{i}"), random_corpus(i, np.uint16))
    expected = [str(shards / f"shard{i}") for i in range(3)]
    assert expand_prefixes([str(shards)]) == expected
    assert expand_prefixes([str(shards / "shard*.bin")]) == expected
    assert expand_prefixes([expected[2], str(shards / "*.idx")]) == [expected[2], *expected[:2]]
    with pytest.raises(IndexedDatasetError, match="matches no files"):
        expand_prefixes([str(tmp_path / "nothing*")])
    with pytest.raises(IndexedDatasetError, match="holds no .idx files"):
        expand_prefixes([str(tmp_path)])


def test_mixed_dtypes_are_refused_before_writing(tmp_path):
    a = write_with_hp(str(tmp_path / "a"), random_corpus(1, np.uint16))
    b = write_with_hp(str(tmp_path / "b"), random_corpus(2, np.int32))
    with pytest.raises(IndexedDatasetError, match=r"different dtypes \(.*a.idx is uint16, .*int32"):
        merge_datasets(str(tmp_path / "out"), [a, b])
    inputs = ["a.bin", "a.hp.json", "a.idx", "b.bin", "b.hp.json", "b.idx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == inputs


def test_output_may_not_be_an_input(tmp_path):
    a = write_with_hp(str(tmp_path / "a"), random_corpus(1, np.uint16))
    with pytest.raises(IndexedDatasetError, match="output prefix is also an input"):
        merge_datasets(a + ".idx", [a])


def test_merge_memory_is_bounded(tmp_path):
    """Merging streams: two 200k-sequence inputs do not make 400k Python objects."""
    for name in ("a", "b"):
        with IndexedDatasetBuilder(tmp_path / name, np.uint16) as builder:
            builder.add_documents(np.ones(400_000, np.uint16), np.full(200_000, 2))
    tracemalloc.start()
    merge_datasets(str(tmp_path / "ab"), [str(tmp_path / "a"), str(tmp_path / "b")])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 24 << 20, f"peak traced memory {peak / 1e6:.1f} MB"
    merged = IndexedDataset(tmp_path / "ab")
    assert (len(merged), merged.num_documents, merged.num_tokens) == (400_000, 400_000, 800_000)
