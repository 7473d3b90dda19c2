"""The warm ranks of `run_ranks`: a body finds its process as a fresh one would be, and a
rank that fails or hangs fails its call, not the next one."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.distributed import run_ranks


def _litter(rank: int, world: int) -> int:
    """Change what a body can change in its process, and return the process id."""
    import torch
    import torch.distributed as dist

    os.environ["HP_WARM_RANK_LITTER"] = "1"
    os.chdir("/")
    signal.signal(signal.SIGTERM, lambda *_: None)
    torch.set_num_threads(2)
    torch.rand(5)  # moves the generator on
    dist.new_group(backend="gloo")
    return os.getpid()


def _state(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    return {
        "pid": os.getpid(),
        "litter": os.environ.get("HP_WARM_RANK_LITTER"),
        "cwd": os.getcwd(),
        "sigterm": signal.getsignal(signal.SIGTERM),
        "threads": torch.get_num_threads(),
        "random": torch.rand(3).tolist(),
        "groups": len(dist.distributed_c10d._world.pg_map),
        "world": dist.get_world_size(),
    }


def _fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own error")
    import torch.distributed as dist

    dist.barrier()  # what its peer never reaches


def _hang_on_zero(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_a_body_finds_the_process_as_it_started():
    before = run_ranks(_state, 2)
    pids = run_ranks(_litter, 2)
    after = run_ranks(_state, 2)
    assert pids == [s["pid"] for s in before] == [s["pid"] for s in after]  # the same, warm
    for rank in after:
        assert rank["litter"] is None and rank["cwd"] == os.getcwd()
        assert rank["sigterm"] == signal.SIG_DFL and rank["threads"] == 1
        assert rank["groups"] == 1 and rank["world"] == 2  # the default group alone
    # each rank's generator starts each body where it started the first
    assert [s["random"] for s in after] == [s["random"] for s in before]
    assert [s["world"] for s in run_ranks(_state, 1)] == [1]  # fewer ranks: a group of its own


def test_a_failing_or_hung_rank_fails_its_call_and_the_next_gets_new_ranks():
    pids = [s["pid"] for s in run_ranks(_state, 2)]
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*rank one's own error"):
        run_ranks(_fail_on_one, 2)
    rebuilt = [s["pid"] for s in run_ranks(_state, 2)]
    assert not set(rebuilt) & set(pids)
    with pytest.raises(RuntimeError, match="timed out after 3 s") as hung:
        run_ranks(_hang_on_zero, 2, timeout=3)
    assert "rank 0's stacks:" in str(hung.value) and "_hang_on_zero" in str(hung.value)
    assert not set(s["pid"] for s in run_ranks(_state, 2)) & set(rebuilt)


_KEPT: list = []


def _keep_groups(rank: int, world: int) -> int:
    """Hold more gloo groups than a warm rank may keep (each with its transport thread)."""
    import torch.distributed as dist

    from tests.helpers.distributed import _LEAKED_LOOPS

    _KEPT.extend(dist.new_group(backend="gloo") for _ in range(_LEAKED_LOOPS + 1))
    return os.getpid()


def test_a_rank_left_holding_groups_is_replaced_by_a_fresh_one():
    held = run_ranks(_keep_groups, 2)
    after = run_ranks(_state, 2)
    assert not set(s["pid"] for s in after) & set(held)  # retired, not reused
    assert [s["groups"] for s in after] == [1, 1]
    assert [s["pid"] for s in run_ranks(_state, 2)] == [s["pid"] for s in after]  # warm again
