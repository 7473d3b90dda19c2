"""A stop request rides in the step's loss all-reduce as one float32 sum over the ranks:
whatever each rank asks, every rank reads the job's weightiest reason (a failed save, then
the clock, then a signal), at any world size. The runs that stop for each reason are in
test_checkpoint.py and test_run_safety.py."""

from __future__ import annotations

import itertools

import torch
from hp_runtime.train.loop import StopRequest


def _weightiest(asks: list[StopRequest]) -> str | None:
    """The reason to expect, from the requests themselves (not from their encoding)."""
    for reason in ("save_failed", "time_limit", "signal"):
        if any(getattr(ask, reason) for ask in asks):
            return reason
    return None


def _read(asks: list[StopRequest]) -> str | None:
    total = torch.tensor([ask.encode() for ask in asks], dtype=torch.float32).sum()
    request = StopRequest.decode(float(total))
    if request is None:
        return None
    reasons = [r for r in ("save_failed", "time_limit", "signal") if getattr(request, r)]
    assert len(reasons) == 1
    return reasons[0]


def test_every_mix_of_three_ranks_reads_its_weightiest_reason():
    per_rank = [StopRequest(signal=s, save_failed=f) for s in (False, True) for f in (False, True)]
    for clock, *ranks in itertools.product((False, True), per_rank, per_rank, per_rank):
        asks = [StopRequest(ranks[0].signal, clock, ranks[0].save_failed), *ranks[1:]]
        assert _read(asks) == _weightiest(asks), asks


def test_a_large_job_keeps_the_weightiest_reason_through_float32():
    world = 5000  # every rank failing a save and signalled: float32 rounds 3,976 off the sum
    every = StopRequest(signal=True, save_failed=True)
    asks = [StopRequest(True, True, True), *[every] * (world - 1)]
    assert _read(asks) == "save_failed"
    asks = [StopRequest(signal=True, time_limit=True), *[StopRequest(signal=True)] * (world - 1)]
    assert _read(asks) == "time_limit"
    assert _read([StopRequest(signal=True)] * world) == "signal"
    assert _read([StopRequest()] * world) is None


def test_the_reason_as_the_log_says_it():
    assert StopRequest(save_failed=True).describe("SIGTERM") == "a failed checkpoint save"
    assert StopRequest(time_limit=True).describe(None) == "train.time_limit"
    assert StopRequest(signal=True).describe("SIGTERM") == "SIGTERM"
    assert StopRequest(signal=True).describe(None) == "signal"  # another rank got it
