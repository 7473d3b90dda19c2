"""PretrainingSampler deals out samples in Megatron order, resumably, on any data-parallel size."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys

import pytest
from hp_data.sampler import PretrainingSampler
from hypothesis import given
from hypothesis import strategies as st


def reference(total, consumed, mbs, rank, size, drop_last=True):
    """The documented rule, written the slow obvious way: list everything, chop, slice."""
    indices = list(range(consumed, total))
    step = mbs * size
    batches = [indices[i : i + step] for i in range(0, len(indices), step)]
    if drop_last and batches and len(batches[-1]) < step:
        batches.pop()
    return [batch[rank * mbs : (rank + 1) * mbs] for batch in batches]


def samplers(total, consumed, mbs, size, drop_last=True):
    return [PretrainingSampler(total, consumed, mbs, r, size, drop_last) for r in range(size)]


def global_stream(ranks):
    """What all ranks consume together, step by step, in rank order."""
    return [i for step in zip(*ranks, strict=True) for batch in step for i in batch]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(
    ("total", "consumed", "mbs", "size"),
    [(1, 0, 1, 1), (10, 0, 2, 3), (10, 3, 2, 3), (24, 0, 4, 2), (25, 7, 3, 4), (5, 0, 8, 2)],
)
def test_matches_reference_and_len(total, consumed, mbs, size, drop_last):
    for rank, sampler in enumerate(samplers(total, consumed, mbs, size, drop_last)):
        expected = reference(total, consumed, mbs, rank, size, drop_last)
        assert len(sampler) == len(expected)
        got = list(sampler)
        assert got == expected
        assert all(type(i) is int for batch in got for i in batch)


@given(
    total=st.integers(1, 60),
    consumed=st.integers(0, 59),
    mbs=st.integers(1, 5),
    size=st.integers(1, 5),
    drop_last=st.booleans(),
)
def test_any_shape_matches_reference(total, consumed, mbs, size, drop_last):
    consumed = min(consumed, total - 1)
    for rank, sampler in enumerate(samplers(total, consumed, mbs, size, drop_last)):
        expected = reference(total, consumed, mbs, rank, size, drop_last)
        assert list(sampler) == expected
        assert len(PretrainingSampler(total, consumed, mbs, rank, size, drop_last)) == len(expected)


def test_ranks_are_disjoint_and_cover_each_global_batch():
    total, consumed, mbs, size = 50, 5, 3, 4
    ranks = [list(s) for s in samplers(total, consumed, mbs, size)]
    step = mbs * size
    for k, per_rank in enumerate(zip(*ranks, strict=True)):
        flat = [i for batch in per_rank for i in batch]
        assert len(set(flat)) == len(flat) == step
        assert flat == list(range(consumed + k * step, consumed + (k + 1) * step))
    # Only the incomplete tail (50 - 5 = 45 = 3 * 12 + 9) is left out.
    assert len(ranks[0]) == 3


def test_drop_last_false_splits_tail_as_megatron():
    # 10 samples, 2 per rank, 3 ranks: one full global batch 0..5, then 6..9 are left.
    ranks = [list(s) for s in samplers(10, 0, 2, 3, drop_last=False)]
    assert ranks == [
        [[0, 1], [6, 7]],
        [[2, 3], [8, 9]],
        [[4, 5], []],  # Megatron gives a rank past the tail an empty list: every rank steps.
    ]
    assert [len(s) for s in samplers(10, 0, 2, 3, drop_last=False)] == [2, 2, 2]
    kept = [list(s) for s in samplers(10, 0, 2, 3, drop_last=True)]
    assert kept == [[[0, 1]], [[2, 3]], [[4, 5]]]


def test_tail_shorter_than_one_rank_share():
    # 7 samples, 3 per rank, 2 ranks: 0..5 full, then only sample 6 is left, for rank 0.
    ranks = [list(s) for s in samplers(7, 0, 3, 2, drop_last=False)]
    assert ranks == [[[0, 1, 2], [6]], [[3, 4, 5], []]]


def test_consumed_samples_advances_per_micro_batch():
    sampler = PretrainingSampler(20, 2, 2, 1, 3, drop_last=False)
    it = iter(sampler)
    next(it)
    assert sampler.consumed_samples == 2 + 6
    next(it)
    assert sampler.consumed_samples == 2 + 12
    next(it)  # tail: 18 .. 19 left, only what was left is counted
    assert sampler.consumed_samples == 20
    assert list(it) == []


def test_resume_yields_the_tail_of_the_uninterrupted_run():
    total, mbs, size, rank = 40, 2, 3, 2
    full = list(PretrainingSampler(total, 0, mbs, rank, size))
    for stop in range(len(full)):
        first = PretrainingSampler(total, 0, mbs, rank, size)
        head = list(itertools.islice(first, stop))
        state = first.state_dict()
        assert state == {"consumed_samples": stop * mbs * size}
        resumed = PretrainingSampler(total, state["consumed_samples"], mbs, rank, size)
        assert head + list(resumed) == full


def test_resume_on_a_different_data_parallel_size_continues_global_order():
    total = 100
    uninterrupted = list(range(total))
    # 4 ranks x 2 samples for 3 steps ...
    before = samplers(total, 0, 2, 4)
    consumed = global_stream(itertools.islice(s, 3) for s in before)
    states = {s.state_dict()["consumed_samples"] for s in before}
    assert states == {24}
    # ... then 2 ranks x 3 samples from the saved count, to the last full global batch.
    after = samplers(total, states.pop(), 3, 2)
    rest = global_stream(after)
    assert consumed + rest == uninterrupted[: 24 + (total - 24) // 6 * 6]


def test_state_dict_round_trip():
    sampler = PretrainingSampler(30, 0, 2, 0, 2)
    it = iter(sampler)
    next(it)
    next(it)
    clone = PretrainingSampler(30, 0, 2, 0, 2)
    clone.load_state_dict(sampler.state_dict())
    assert clone.consumed_samples == 8
    assert list(clone) == list(it)


def test_load_state_dict_rejects_bad_state():
    sampler = PretrainingSampler(30, 0, 2, 0, 2)
    with pytest.raises(ValueError, match="expected 'consumed_samples'"):
        sampler.load_state_dict({"consumed": 4})
    with pytest.raises(ValueError, match="consumed_samples=31: more than total_samples=30"):
        sampler.load_state_dict({"consumed_samples": 31})
    assert sampler.consumed_samples == 0


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_finished_pass_loads_back_and_continues_on_more_data(drop_last):
    # 30 samples, global batch 4: 7 full batches (and a tail of 2 without drop_last).
    ranks = samplers(30, 0, 2, 2, drop_last)
    for sampler in ranks:
        list(sampler)
    end = ranks[0].state_dict()
    assert end == {"consumed_samples": 30 if not drop_last else 28}
    for rank, sampler in enumerate(ranks):
        sampler.load_state_dict({"consumed_samples": 30})
        assert len(sampler) == 0 and list(sampler) == []
        # The same state on a second epoch's worth of samples continues from sample 30, as
        # one uninterrupted pass over 60 would.
        longer = PretrainingSampler(60, 0, 2, rank, 2, drop_last)
        longer.load_state_dict({"consumed_samples": 30})
        assert list(longer) == reference(60, 30, 2, rank, 2, drop_last)


def test_huge_dataset_is_not_materialised():
    total = 10**15
    sampler = PretrainingSampler(total, total - 10**9, 4, 3, 8)
    assert len(sampler) == 10**9 // 32
    start = total - 10**9
    assert next(iter(sampler)) == list(range(start + 12, start + 16))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_samples": 0}, "total_samples=0"),
        ({"total_samples": -3}, "total_samples=-3"),
        ({"consumed_samples": -1}, "consumed_samples=-1: must be >= 0"),
        ({"consumed_samples": 11}, "consumed_samples=11: more than total_samples=10"),
        ({"micro_batch_size": 0}, "micro_batch_size=0: must be at least 1"),
        ({"data_parallel_size": 0}, "data_parallel_size=0: must be at least 1"),
        ({"data_parallel_rank": 2}, "data_parallel_rank=2: must be in [0, data_parallel_size=2)"),
        ({"data_parallel_rank": -1}, "data_parallel_rank=-1"),
    ],
)
def test_validation_messages(kwargs, message):
    args = {
        "total_samples": 10,
        "consumed_samples": 0,
        "micro_batch_size": 2,
        "data_parallel_rank": 0,
        "data_parallel_size": 2,
    } | kwargs
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        PretrainingSampler(**args)
    assert "\n" not in str(info.value)


def test_sampler_does_not_import_torch():
    script = "import sys, hp_data.sampler; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
