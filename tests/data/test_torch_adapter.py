"""hp_data.torch_adapter: hp items become tensors, batches stack to [B, L], cu_seqlens pack
for varlen."""

from __future__ import annotations

import itertools
import pickle
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from hp_data.sampler import PretrainingSampler
from hp_data.torch_adapter import as_torch_dataset, collate, make_dataloader

L = 8


class Items:
    """Sample i holds tokens i*L .. i*L+L-1, so a batch row tells which index it came from.

    Documents inside sample i are given by `boundaries[i]`; arrays are built once and kept so
    a test can check that tensors alias them.
    """

    def __init__(self, n, boundaries=None, read_only=False):
        self.items = []
        for i in range(n):
            tokens = np.arange(i * L, (i + 1) * L, dtype=np.int64)
            item = {
                "tokens": tokens,
                "labels": tokens + 1,
                "loss_mask": np.ones(L, dtype=np.float32),
                "position_ids": np.arange(L, dtype=np.int64),
            }
            if boundaries is not None:
                cu = np.asarray(boundaries[i], dtype=np.int32)
                item["cu_seqlens"] = cu
                item["position_ids"] = np.concatenate(
                    [np.arange(b - a, dtype=np.int64) for a, b in itertools.pairwise(cu)]
                )
            if read_only:
                for array in item.values():
                    array.setflags(write=False)
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def test_items_become_tensors_sharing_the_numpy_buffers():
    source = Items(3, boundaries=[[0, 3, L]] * 3)
    dataset = as_torch_dataset(source)
    assert isinstance(dataset, torch.utils.data.Dataset)
    assert len(dataset) == 3
    item = dataset[1]
    expected_dtypes = {
        "tokens": torch.int64,
        "labels": torch.int64,
        "loss_mask": torch.float32,
        "position_ids": torch.int64,
        "cu_seqlens": torch.int32,
    }
    assert {k: v.dtype for k, v in item.items()} == expected_dtypes
    for key, tensor in item.items():
        array = source[1][key]
        assert tuple(tensor.shape) == array.shape
        assert np.array_equal(tensor.numpy(), array)
        assert tensor.data_ptr() == array.ctypes.data  # no copy
    item["tokens"][0] = -7
    assert source[1]["tokens"][0] == -7


def test_read_only_arrays_are_copied_without_warning():
    source = Items(1, read_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        item = as_torch_dataset(source)[0]
    tensor, array = item["tokens"], source[0]["tokens"]
    assert tensor.data_ptr() != array.ctypes.data
    tensor[0] = 99  # a write must not reach the (read-only) source
    assert array[0] == 0


def test_wrapped_dataset_pickles_for_spawned_workers():
    dataset = pickle.loads(pickle.dumps(as_torch_dataset(Items(2))))
    assert torch.equal(dataset[1]["tokens"], torch.arange(L, 2 * L))


def test_collate_stacks_fixed_length_fields():
    source = Items(4)
    batch = collate([as_torch_dataset(source)[i] for i in (2, 0, 3)])
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}  # no varlen keys
    for key in batch:
        assert batch[key].shape == (3, L)
        assert torch.equal(
            batch[key], torch.from_numpy(np.stack([source[i][key] for i in (2, 0, 3)]))
        )
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["tokens"].dtype == torch.int64


def test_collate_accepts_raw_numpy_items():
    source = Items(2)
    batch = collate([source[0], source[1]])
    assert torch.equal(batch["tokens"], torch.arange(2 * L).reshape(2, L))


def test_collate_packs_cu_seqlens_for_flash_attention_varlen():
    boundaries = [[0, 3, L], [0, L], [0, 2, 5, 7, L]]
    batch = collate([as_torch_dataset(Items(3, boundaries))[i] for i in range(3)])
    # By hand: sample 1 starts at 8, sample 2 at 16; the joins 8 and 16 appear once.
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 16, 18, 21, 23, 24]
    # Independently: all document lengths in order, cumulated from 0.
    lengths = [b - a for cu in boundaries for a, b in itertools.pairwise(cu)]
    assert batch["cu_seqlens"].tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"][-1] == 3 * L == batch["tokens"].numel()
    assert batch["max_seqlen"] == max(lengths) == L
    assert type(batch["max_seqlen"]) is int
    assert batch["tokens"].shape == (3, L)


def test_collate_max_seqlen_is_longest_document():
    batch = collate(Items(2, [[0, 3, L], [0, 5, L]]).items)
    assert batch["max_seqlen"] == 5
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 13, 16]


def test_collate_rejects_bad_batches():
    items = Items(2, [[0, 3, L], [0, L]]).items
    with pytest.raises(ValueError, match="empty micro-batch"):
        collate([])
    bad = dict(items[1], cu_seqlens=np.array([0, 3, L - 1], dtype=np.int32))
    with pytest.raises(ValueError, match="batch item 1: cu_seqlens"):
        collate([items[0], bad])
    missing = {k: v for k, v in items[1].items() if k != "cu_seqlens"}
    with pytest.raises(ValueError, match="batch item 1 has fields"):
        collate([items[0], missing])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_yields_this_ranks_items(num_workers):
    source = Items(20, boundaries=[[0, 4, L]] * 20)
    # 3 per rank, 2 ranks, from sample 4: global batches 4..9 and 10..15; 16..19 is dropped.
    sampler = PretrainingSampler(20, 4, 3, data_parallel_rank=1, data_parallel_size=2)
    loader = make_dataloader(source, sampler, num_workers=num_workers)
    assert len(loader) == 2
    batches = list(loader)
    assert len(batches) == 2
    assert sampler.consumed_samples == 4 + 2 * 6
    assert [(b["tokens"][:, 0] // L).tolist() for b in batches] == [[7, 8, 9], [13, 14, 15]]
    for b in batches:
        assert b["tokens"].shape == (3, L)
        assert b["cu_seqlens"].tolist() == [0, 4, 8, 12, 16, 20, 24]
        assert b["max_seqlen"] == 4


def test_adapter_imports_without_torch_and_says_why_it_fails():
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        import hp_data.torch_adapter as adapter
        for call in (lambda: adapter.as_torch_dataset([]), lambda: adapter.collate([{}])):
            try:
                call()
            except ImportError as exc:
                assert "torch" in str(exc), exc
            else:
                raise AssertionError("no ImportError without torch")
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_collate_keeps_per_sample_scalars_beside_packed_cu_seqlens():
    """A blend's items carry an int `dataset_id` first; packing must not mistake it for L."""
    items = [
        {"dataset_id": 1, "tokens": np.arange(4), "cu_seqlens": np.array([0, 2, 4], np.int32)},
        {"dataset_id": 0, "tokens": np.arange(4), "cu_seqlens": np.array([0, 4], np.int32)},
    ]
    out = collate(items)
    assert out["dataset_id"].tolist() == [1, 0]
    assert out["cu_seqlens"].tolist() == [0, 2, 4, 8]
    assert out["max_seqlen"] == 4
