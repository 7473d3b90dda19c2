"""The hang watchdog: its limit, its verdict from the ranks' reports, and a real 2-rank job
under torchrun whose rank 1 stalls in its data at step 3 — stopped within seconds with one
line naming rank 1, every rank's stacks on disk."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest
from hp_runtime.train.config import load_config
from hp_runtime.train.errors import ConfigError
from hp_runtime.train.watchdog import Watchdog

from tests.helpers.train import FAST, torchrun


def test_the_limit_and_when_a_step_is_overdue(tmp_path):
    dog = Watchdog(str(tmp_path), 0, 1)
    dog.beat(1, "data")
    assert dog.overdue(time.monotonic() + 1e6) is None  # the first step compiles: not watched
    dog.step_done(2.0)
    assert dog.limit() == 300.0  # at least five minutes
    for seconds in (40.0, 41.0, 39.0):
        dog.step_done(seconds)
    assert dog.limit() == 10 * 39.5  # ten medians (2, 39, 40, 41)
    dog.beat(5, "data")
    started = time.monotonic()
    dog.beat(5, "update")  # a later phase keeps the step's start
    assert dog.overdue(started + 390) is None
    assert dog.overdue(started + 400)[:2] == (5, 2)
    dog.step_done(1.0)
    assert dog.overdue(started + 1e6) is None  # between steps: not watched
    assert Watchdog(str(tmp_path), 0, 1, limit_s=3).limit() == 3


def test_the_verdict_names_the_rank_furthest_behind(tmp_path):
    hang = tmp_path / "hang"
    hang.mkdir()
    for rank, step, phase in ((0, 7, "forward-backward"), (1, 7, "data"), (2, 7, "update")):
        report = {"rank": rank, "step": step, "phase": phase, "waited_s": 9.0}
        (hang / f"rank-{rank}.json").write_text(json.dumps(report))
    line = Watchdog(str(tmp_path), 0, 3, limit_s=1).summary(7, 9.0)
    assert "rank 1 stuck at step 7's data" in line and str(hang) in line
    assert json.loads((hang / "summary.json").read_text())["stuck"] == [1]
    line = Watchdog(str(tmp_path), 0, 4, limit_s=1).summary(7, 9.0)  # rank 3 never reported
    assert "rank 3 stuck at no step" in line


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.hang_timeout_s=-1", "train.hang_timeout_s"),
        ("train.hang_timeout_s=soon", "train.hang_timeout_s"),
        ("train.collective_timeout_s=0", "train.collective_timeout_s"),
    ],
)
def test_bad_timeouts_are_one_line(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(
            None,
            [
                "model.preset=tiny",
                "data.type=dummy",
                "data.seq_length=16",
                "train.steps=1",
                override,
            ],
        )
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


STALL = """
    import os, time
    if os.environ.get("RANK") == "1":  # rank 1's data stalls at its third step
        import hp_runtime.train.loader as loader

        take, calls = loader.Loader.take, []

        def stalled(self, count):
            calls.append(count)
            if len(calls) == 3:
                time.sleep(900)  # far past the test's own bound: only the watchdog ends it
            return take(self, count)

        loader.Loader.take = stalled
"""


def test_a_stalled_rank_stops_the_job_with_one_line(tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(textwrap.dedent(STALL))
    run = tmp_path / "run"
    done = torchrun(
        2,
        *FAST,
        "data.type=dummy",
        "data.seq_length=16",
        "parallel.dp_shard=2",
        "train.steps=50",
        "train.hang_timeout_s=20",  # above a loaded machine's slowest step, far below the stall
        f"train.run_dir={run}",
        timeout=300,  # the bound: far below the 900 s sleep and the 600 s collective timeout
        env={"PYTHONPATH": os.pathsep.join([str(inject), *sys.path])},
    )
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("hp-train:")]
    assert len(ours) == 1, done.stderr[-3000:]
    assert "step 3 hangs" in ours[0] and "rank 1 stuck at step 3's data" in ours[0], ours
    hang = run / "hang"
    assert (
        "sleep" in (hang / "rank-1.txt").read_text()
        or "stalled" in (hang / "rank-1.txt").read_text()
    )
    assert (hang / "rank-0.txt").read_text().strip()  # rank 0's stacks: where it waits
    assert json.loads((hang / "summary.json").read_text())["stuck"] == [1]
