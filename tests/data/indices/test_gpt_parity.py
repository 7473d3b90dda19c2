"""GPTDataset gives megatron-core's samples, in megatron-core's order, for every split."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hp_data import IndexedDataset, index
from hp_data.gpt import GPTDataset, GPTDatasetConfig

from tests.helpers.corpus import random_corpus, write_with_hp
from tests.helpers.megatron import Tokenizer, build_megatron

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core.datasets.gpt_dataset")


def _megatron(
    prefix,
    sizes,
    seq_length,
    seed,
    split,
    cache,
    extra=True,
    drop_last_valid=True,
    eod=0,
    eod_mask_loss=False,
    reset_position_ids=False,
):
    return build_megatron(
        sizes,
        seq_length,
        seed,
        blend=([prefix], None),
        split=split,
        cache=str(cache),
        eod=eod,
        add_extra_token_to_sequence=extra,
        drop_last_partial_validation_sequence=drop_last_valid,
        eod_mask_loss=eod_mask_loss,
        reset_position_ids=reset_position_ids,
    )


def _corpus(tmp_path, seed, dtype):
    corpus = random_corpus(seed, dtype, max_documents=120, max_length=90)
    return write_with_hp(str(tmp_path / "corpus"), corpus)


CASES = {
    # name: (sizes per split, split, seq_length, extra, drop_last_valid)
    "one epoch": ([None, None, None], "969,30,1", 32, True, True),
    "many epochs": ([3000, 40, 20], "90,8,2", 16, True, True),
    "no extra token": ([500, 30, 10], "90,8,2", 24, False, True),
    "valid keeps partial": ([None, None, None], "70,25,5", 19, True, False),
    "test only": ([None, None, 50], "0,0,1", 8, True, True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("seed", "dtype"), [(1, np.uint16), (2, np.int32)])
def test_indices_and_samples_equal_megatrons(tmp_path, case, seed, dtype):
    sizes, split, seq_length, extra, drop_last_valid = CASES[case]
    prefix = _corpus(tmp_path, seed, dtype)
    theirs = _megatron(
        prefix, sizes, seq_length, seed, split, tmp_path / "mcache", extra, drop_last_valid
    )
    config = GPTDatasetConfig(
        seq_length=seq_length,
        seed=seed,
        split=split,
        add_extra_token=extra,
        drop_last_partial_validation_sequence=drop_last_valid,
        cache_dir=str(tmp_path / "hcache"),
    )
    built = 0
    for i, name in enumerate(("train", "valid", "test")):
        if theirs[i] is None:
            continue
        ours = GPTDataset(prefix, name, sizes[i], config)
        built += 1
        np.testing.assert_array_equal(ours.document_index, theirs[i].document_index)
        np.testing.assert_array_equal(ours.sample_index, theirs[i].sample_index)
        np.testing.assert_array_equal(ours.shuffle_index, theirs[i].shuffle_index)
        assert len(ours) == len(theirs[i])
        for name in ("document_index", "sample_index", "shuffle_index"):
            assert getattr(ours, name).dtype == getattr(theirs[i], name).dtype, name
        for j in range(len(ours)):
            text, _ = theirs[i]._query_document_sample_shuffle_indices(j)
            mine, _ = ours.sample_tokens(j)
            np.testing.assert_array_equal(mine, text)
            item, reference = ours[j], theirs[i][j]
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                np.testing.assert_array_equal(item[key], reference[key].numpy(), err_msg=key)
    assert built >= 1


def _final_epoch_sizes(tmp_path, fraction):
    """A train sample count whose last epoch is `fraction` full."""
    prefix = _corpus(tmp_path, 5, np.uint16)
    ds = IndexedDataset(prefix)
    tokens = int(ds.sequence_lengths.sum())
    per_epoch = (tokens - 1) // 16
    return prefix, 2 * per_epoch + int(fraction * per_epoch)


@pytest.mark.parametrize("fraction", [0.5, 0.79, 0.8, 0.81, 0.95])
def test_the_final_epoch_rule(tmp_path, fraction):
    prefix, count = _final_epoch_sizes(tmp_path, fraction)
    theirs = _megatron(prefix, [count, None, None], 16, 3, "1,0,0", tmp_path / "m")[0]
    ours = GPTDataset(
        prefix,
        "train",
        count,
        GPTDatasetConfig(seq_length=16, seed=3, split="1,0,0", cache_dir=str(tmp_path / "h")),
    )
    np.testing.assert_array_equal(ours.document_index, theirs.document_index)
    np.testing.assert_array_equal(ours.shuffle_index, theirs.shuffle_index)


@pytest.mark.parametrize(
    ("eod_mask_loss", "reset_position_ids"), [(True, False), (False, True), (True, True)]
)
def test_eod_masking_and_position_reset_match(tmp_path, eod_mask_loss, reset_position_ids):
    prefix = _corpus(tmp_path, 4, np.uint16)
    eod = int(IndexedDataset(prefix)[3][0])  # a token that occurs: call it the EOD
    theirs = _megatron(
        prefix,
        [200, None, None],
        64,
        4,
        "1,0,0",
        tmp_path / "m",
        eod=eod,
        eod_mask_loss=eod_mask_loss,
        reset_position_ids=reset_position_ids,
    )[0]
    ours = GPTDataset(
        prefix,
        "train",
        200,
        GPTDatasetConfig(
            seq_length=64,
            seed=4,
            split="1,0,0",
            eod_token=eod,
            eod_mask_loss=eod_mask_loss,
            reset_position_ids=reset_position_ids,
            cache_dir=str(tmp_path / "h"),
        ),
    )
    for j in range(len(ours)):
        item, reference = ours[j], theirs[j]
        for key in ("loss_mask", "position_ids"):
            np.testing.assert_array_equal(item[key], reference[key].numpy(), err_msg=key)


@pytest.mark.parametrize("num_samples", [None, 250, 333])  # 1 epoch; 2; 3, the last apart
def test_indices_of_any_document_ids_equal_megatrons(tmp_path, num_samples, monkeypatch):
    # Any ids (not a contiguous split), summed and gathered across chunk edges.
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from megatron.core.datasets.utils import Split

    monkeypatch.setattr(index, "CHUNK", 5)
    prefix = _corpus(tmp_path, 6, np.uint16)
    sizes = IndexedDataset(prefix).sequence_lengths
    ids = np.flatnonzero(np.random.default_rng(6).random(len(sizes)) < 0.6).astype(np.int32)
    config = gpt_dataset.GPTDatasetConfig(
        random_seed=9,
        sequence_length=16,
        blend=([prefix], None),
        split="1,0,0",
        path_to_cache=None,
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = gpt_dataset.GPTDataset(
            MegatronIndexed(prefix), prefix, ids, num_samples, Split.train, config
        )
    ours = index.build_gpt_indices(sizes, ids, 16, num_samples, 9)
    for name, array in zip(("document_index", "sample_index", "shuffle_index"), ours, strict=True):
        reference = getattr(theirs, name)
        assert array.dtype == reference.dtype, name
        np.testing.assert_array_equal(array, reference, err_msg=name)
