"""The index cache: keyed by everything that shapes the indices, atomic, built once."""

from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hp_data import IndexedDatasetBuilder
from hp_data.cache import cache_key, load_or_build
from hp_data.gpt import GPTDataset, GPTDatasetConfig

from tests.helpers.corpus import random_corpus, write_with_hp


def _build_counted(directory: str, marker_dir: str) -> list[int]:
    def build():
        # Leave a trace per actual build, and take long enough for the others to queue.
        Path(marker_dir, f"built-{os.getpid()}").touch()
        import time

        time.sleep(0.3)
        return {"values": np.arange(1000, dtype=np.int64) * 3}

    arrays, _ = load_or_build(directory, {"what": "test"}, "Test", "train", ("values",), build)
    return arrays["values"].tolist()


def test_concurrent_builders_build_once_and_agree(tmp_path):
    cache, markers = tmp_path / "cache", tmp_path / "markers"
    markers.mkdir()
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        results = pool.starmap(_build_counted, [(str(cache), str(markers))] * 4)
    assert len(os.listdir(markers)) == 1
    assert all(r == list(range(0, 3000, 3)) for r in results)


def test_files_are_named_like_megatrons_and_described(tmp_path):
    arrays, report = load_or_build(
        str(tmp_path),
        {"seed": 1},
        "GPTDataset",
        "valid",
        ("document_index", "sample_index"),
        lambda: {"document_index": np.arange(3), "sample_index": np.zeros((2, 2), np.int64)},
    )
    key = cache_key({"seed": 1})
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert names == [
        f"{key}-GPTDataset-valid-description.json",
        f"{key}-GPTDataset-valid-document_index.npy",
        f"{key}-GPTDataset-valid-sample_index.npy",
    ]
    description = json.loads((tmp_path / names[0]).read_text())
    assert description["seed"] == 1 and description["split"] == "valid"
    assert isinstance(arrays["document_index"], np.memmap)  # loads are memory-mapped
    assert report["built_seconds"] is not None
    _, again = load_or_build(
        str(tmp_path),
        {"seed": 1},
        "GPTDataset",
        "valid",
        ("document_index", "sample_index"),
        lambda: pytest.fail("rebuilt"),
    )
    assert again["built_seconds"] is None


def test_half_written_sets_are_never_loaded(tmp_path):
    key = cache_key({"x": 1})
    # A crash after the arrays but before the description: the set must be rebuilt.
    np.save(tmp_path / f"{key}-T-train-values.npy", np.array([666]))
    arrays, report = load_or_build(
        str(tmp_path), {"x": 1}, "T", "train", ("values",), lambda: {"values": np.array([1, 2])}
    )
    assert arrays["values"].tolist() == [1, 2]
    assert report["built_seconds"] is not None


def test_unwritable_directory_falls_back_with_one_warning(tmp_path):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")
    with pytest.warns(UserWarning, match="not writable") as caught:
        arrays, report = load_or_build(
            str(blocked / "cache"),
            {"y": 2},
            "T",
            "train",
            ("values",),
            lambda: {"values": np.array([7])},
        )
    assert len(caught) == 1
    assert arrays["values"].tolist() == [7]
    assert all("hp-data-index-cache" in f for f in report["files"])


def test_a_regenerated_corpus_never_reuses_stale_indices(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_with_hp(prefix, random_corpus(1, np.uint16, max_documents=60))
    config = GPTDatasetConfig(seq_length=16, seed=1, split="1,0,0", cache_dir=str(tmp_path / "c"))
    first = GPTDataset(prefix, "train", None, config)
    key_first = first.cache_report["key"]
    # Same path, same number of sequences, one length changed: a new key, new indices.
    lengths = first.dataset.sequence_lengths.copy()
    source = first.dataset
    with IndexedDatasetBuilder(prefix + "-new", np.uint16) as builder:
        for i in range(len(source)):
            tokens = source[i] if i else np.concatenate([source[i], [1, 2, 3]])
            builder.add_item(tokens)
            builder.end_document()
    os.replace(prefix + "-new.bin", prefix + ".bin")
    os.replace(prefix + "-new.idx", prefix + ".idx")
    second = GPTDataset(prefix, "train", None, config)
    assert second.cache_report["key"] != key_first
    assert second.cache_report["built_seconds"] is not None
    assert len(second.dataset.sequence_lengths) == len(lengths)


def _shorter(array):
    return array[:-1]


def _narrower(array):
    return array.astype(np.int32)


def _wider(array):  # what an hp before the narrow dtypes wrote
    return array.astype(np.int64)


def _out_of_range(array):
    array = np.array(array)
    array[-1] = 10**9
    return array


@pytest.mark.parametrize("corrupt", [_shorter, _narrower, _wider, _out_of_range])
def test_cached_arrays_that_disagree_with_their_record_are_rebuilt(tmp_path, corrupt):
    prefix = str(tmp_path / "corpus")
    write_with_hp(prefix, random_corpus(2, np.uint16, max_documents=60))
    config = GPTDatasetConfig(seq_length=8, seed=3, split="1,0,0", cache_dir=str(tmp_path / "c"))
    first = GPTDataset(prefix, "train", None, config)
    expected = [first[i]["tokens"].tolist() for i in range(len(first))]
    # A partial overwrite leaves a file numpy loads but that no longer fits the others.
    path = next(f for f in first.cache_report["files"] if f.endswith("shuffle_index.npy"))
    np.save(path, corrupt(np.load(path)))
    with pytest.warns(UserWarning, match=r"shuffle_index.npy: .* recorded; rebuilding|out of"):
        second = GPTDataset(prefix, "train", None, config)
    assert second.cache_report["built_seconds"] is not None
    assert [second[i]["tokens"].tolist() for i in range(len(second))] == expected
    third = GPTDataset(prefix, "train", None, config)  # the rebuilt set loads cleanly
    assert third.cache_report["built_seconds"] is None


def test_a_set_written_before_the_narrow_dtypes_is_rebuilt_not_loaded(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_with_hp(prefix, random_corpus(3, np.uint16, max_documents=60))
    config = GPTDatasetConfig(seq_length=8, seed=3, split="1,0,0", cache_dir=str(tmp_path / "c"))
    new = GPTDataset(prefix, "train", None, config)
    names = ("document_index", "sample_index", "shuffle_index")
    values = {name: np.array(getattr(new, name)) for name in names}
    marker = next(f for f in new.cache_report["files"] if f.endswith("description.json"))
    recorded = json.loads(Path(marker).read_text())
    assert recorded["dtypes"] == {name: values[name].dtype.name for name in names}
    # The same set as an older hp wrote it, in a cache of its own: int64 arrays under the key
    # of a description without dtypes.
    old = {k: v for k, v in recorded.items() if k not in ("key", "class", "arrays", "dtypes")}
    old_key = cache_key(old)
    old_cache = tmp_path / "old"
    old_cache.mkdir()
    for name in names:
        np.save(old_cache / f"{old_key}-GPTDataset-train-{name}.npy", values[name].astype(np.int64))
    arrays = {n: {"shape": list(values[n].shape), "dtype": "int64"} for n in names}
    (old_cache / f"{old_key}-GPTDataset-train-description.json").write_text(
        json.dumps({"key": old_key, "class": "GPTDataset", **old, "arrays": arrays})
    )
    again = GPTDataset(prefix, "train", None, replace(config, cache_dir=str(old_cache)))
    assert again.cache_report["key"] != old_key
    assert again.cache_report["built_seconds"] is not None
    for name in names:
        assert getattr(again, name).dtype == values[name].dtype
        np.testing.assert_array_equal(getattr(again, name), values[name])
