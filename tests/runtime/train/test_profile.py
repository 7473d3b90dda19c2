"""Profiler traces of the steps `metrics.profile_steps` names, repeated every
`metrics.profile_every`, one Chrome trace per rank; bad windows refused in one line."""

from __future__ import annotations

import json

import pytest

from tests.helpers.train import FAST, hp_train_here

RUN = [*FAST, "data.type=dummy", "data.seq_length=16", "train.steps=6"]


def test_traces_of_each_window(tmp_path):
    run = tmp_path / "run"
    done = hp_train_here(
        *RUN,
        "metrics.profile_steps=[2, 2]",
        "metrics.profile_every=3",
        "metrics.memory_snapshot=true",  # CUDA only: nothing on the CPU, and no error
        f"train.run_dir={run}",
    )
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in (run / "profiles").iterdir())
    assert files == ["rank-0-steps-2-3.json", "rank-0-steps-5-6.json"]
    for name in files:
        events = json.loads((run / "profiles" / name).read_text())["traceEvents"]
        names = {event.get("name") for event in events}
        assert "aten::mm" in names  # the model's matmuls are in the trace
        assert "Optimizer.step#AdamW.step" in names or any("AdamW" in str(n) for n in names)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["metrics.profile_steps=[0, 2]"], "metrics.profile_steps: give [first step, steps]"),
        (["metrics.profile_steps=[3, 0]"], "metrics.profile_steps: give [first step, steps]"),
        (["metrics.profile_steps=[3]"], "metrics.profile_steps: expected a list of 2"),
        (["metrics.profile_steps=soon"], "metrics.profile_steps: expected a list of 2"),
        (["metrics.profile_steps=[1.5, 2]"], "metrics.profile_steps: expected a list of 2"),
        (["metrics.profile_every=-1"], "metrics.profile_every: must be from 0"),
        (["metrics.profile_every=5"], "metrics.profile_every=5 repeats metrics.profile_steps"),
        (
            ["metrics.profile_steps=[2, 4]", "metrics.profile_every=3"],
            "metrics.profile_every=3 is shorter than the window",
        ),
    ],
)
def test_bad_windows_are_one_line(tmp_path, overrides, message):
    done = hp_train_here(*RUN, *overrides, f"train.run_dir={tmp_path / 'run'}")
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"hp-train: error: {message}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
