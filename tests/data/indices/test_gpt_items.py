"""GPTDataset items: document boundaries (cu_seqlens), padding and batch reads."""

from __future__ import annotations

import numpy as np
from hp_data import IndexedDatasetBuilder
from hp_data.gpt import GPTDataset, GPTDatasetConfig


def _labelled_corpus(prefix: str, lengths: list[int]) -> None:
    """Sequence j holds only the value j + 1, so a document boundary is where the value changes."""
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for j, length in enumerate(lengths):
            builder.add_item(np.full(length, j + 1))
            builder.end_document()


def test_cu_seqlens_are_the_document_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(0, 40, 300)]
    _labelled_corpus(str(tmp_path / "c"), lengths)
    dataset = GPTDataset(
        str(tmp_path / "c"),
        "train",
        500,
        GPTDatasetConfig(
            seq_length=32,
            seed=2,
            split="1,0,0",
            return_cu_seqlens=True,
            cache_dir=str(tmp_path / "cache"),
        ),
    )
    for i in range(len(dataset)):
        item = dataset[i]
        tokens = item["tokens"]
        changes = np.flatnonzero(tokens[1:] != tokens[:-1]) + 1
        expected = np.concatenate(([0], changes, [len(tokens)]))
        np.testing.assert_array_equal(item["cu_seqlens"], expected)
        assert item["cu_seqlens"].dtype == np.int32


def test_padding_of_the_kept_partial_validation_sample(tmp_path):
    _labelled_corpus(str(tmp_path / "c"), [10] * 20)
    config = GPTDatasetConfig(
        seq_length=16,
        split="0,1,0",
        cache_dir=str(tmp_path / "cache"),
        drop_last_partial_validation_sequence=False,
    )
    dataset = GPTDataset(str(tmp_path / "c"), "valid", None, config)
    # 200 tokens, 16 per sample plus one: 12 full samples and a padded 13th.
    assert len(dataset) == 13
    padded = [dataset[i] for i in range(len(dataset)) if dataset[i]["loss_mask"].min() == 0]
    assert len(padded) == 1
    item = padded[0]
    real = int(item["loss_mask"].sum())
    assert real == 200 - 12 * 16 - 1  # the last window's tokens that have a next token
    assert (item["tokens"][real + 1 :] == 0).all() and (item["labels"][real:] == 0).all()


def test_get_batch_stacks_items(tmp_path):
    _labelled_corpus(str(tmp_path / "c"), [25] * 40)
    dataset = GPTDataset(
        str(tmp_path / "c"),
        "train",
        50,
        GPTDatasetConfig(
            seq_length=16, split="1,0,0", return_cu_seqlens=True, cache_dir=str(tmp_path / "k")
        ),
    )
    batch = dataset.get_batch([3, 0, 7])
    assert batch["tokens"].shape == batch["labels"].shape == (3, 16)
    for row, index in enumerate([3, 0, 7]):
        item = dataset[index]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            np.testing.assert_array_equal(batch[key][row], item[key])
        np.testing.assert_array_equal(batch["cu_seqlens"][row], item["cu_seqlens"])


def test_int32_offsets_read_the_right_tokens_past_2_gib(tmp_path):
    # Sample indices are int32 now: an offset taken straight from one must not overflow when
    # the reader turns it into bytes (2^30 uint16 tokens = 2^31 bytes). The .bin is sparse.
    from hp_data import IndexedDataset
    from hp_data.format.header import pack_header

    prefix = str(tmp_path / "big")
    lengths = np.array([2**30 + 8, 4], dtype=np.int32)
    with open(prefix + ".idx", "wb") as out:
        out.write(pack_header(np.dtype(np.uint16), 2, 3))
        out.write(lengths.tobytes())
        out.write(np.array([0, (2**30 + 8) * 2], dtype=np.int64).tobytes())
        out.write(np.array([0, 1, 2], dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as out:
        out.truncate(int(lengths.sum(dtype=np.int64)) * 2)
        out.seek(2**31)
        out.write(np.array([7, 8, 9], dtype=np.uint16).tobytes())
    dataset = IndexedDataset(prefix)
    tokens = dataset.get(np.int32(0), np.int32(2**30), np.int32(3))
    assert tokens.tolist() == [7, 8, 9]
    assert dataset.get(0, np.int32(2**30 + 1)).tolist() == [8, 9, 0, 0, 0, 0, 0]
