"""A non-finite loss stops the run at its step; the spike guard skips or stops."""

from __future__ import annotations

from collections import deque

from hp_runtime.train.guard import SpikeGuard

from tests.helpers.train import FAST, hp_train_here, records

DUMMY = ["data.type=dummy", "data.seq_length=32", "optim.warmup_steps=0"]


def test_guard_flags_values_far_above_the_window():
    guard = SpikeGuard("skip", window=4, sigma=3.0)
    for loss in (2.0, 2.1, 1.9, 2.0):
        assert guard.judge(loss, 1.0) is None  # filling the window
    assert guard.judge(2.05, 1.0) is None
    reason = guard.judge(9.0, 1.0)
    assert reason is not None and reason.startswith("loss 9 is ")
    assert "grad norm" in guard.judge(2.0, 50.0)
    assert guard.losses == deque([2.0, 2.05, 9.0, 2.0], maxlen=4)  # spikes join the window


def test_non_finite_loss_stops_at_its_step(tmp_path):
    run = tmp_path / "run"
    done = hp_train_here(
        *FAST,
        *DUMMY,
        "train.steps=20",
        "optim.lr=1e30",
        "metrics.log_interval=10",
        f"train.run_dir={run}",
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "hp-train: error: step 2: loss nan, grad norm nan (samples 1 to 1); stopping. Lower "
        f"optim.lr, check the data of those samples (hp-train blame {run} --step 2 lists "
        "them), or resume from an earlier checkpoint"
    ]
    end = records(run, "end")
    assert end[0]["status"] == "failed" and end[0]["step"] <= 3  # not 50 steps later


def test_spike_guard_skips_the_update_or_stops(tmp_path):
    base = [*DUMMY, "train.steps=12", "train.micro_batch_size=2", "optim.lr=1e-2"]
    guard = ["train.spike_window=5", "train.spike_sigma=2.0"]
    plain_run, run = tmp_path / "plain", tmp_path / "skip"
    assert hp_train_here(*FAST, *base, f"train.run_dir={plain_run}").returncode == 0
    done = hp_train_here(*FAST, *base, *guard, "train.spike_action=skip", f"train.run_dir={run}")
    assert done.returncode == 0, done.stderr
    plain = [r["loss"] for r in records(plain_run)]
    guarded = [r["loss"] for r in records(run)]
    skipped = [r["step"] for r in records(run, "skip")]
    assert skipped, "the settings are chosen so that a step is a spike"
    first = skipped[0]
    # identical up to the spike; the step after it starts from parameters without its update
    assert guarded[:first] == plain[:first]
    assert guarded[first] != plain[first]
    record = records(run, "skip")[0]
    assert record["step"] == first and record["samples"] == [2 * first - 2, 2 * first]
    assert [r["skipped"] for r in records(run)][first - 1] is True

    stop = tmp_path / "stop"
    done = hp_train_here(*FAST, *base, *guard, "train.spike_action=stop", f"train.run_dir={stop}")
    assert done.returncode == 1
    assert done.stderr.startswith(f"hp-train: error: step {first}: ")
    assert "stopping (train.spike_action = 'stop')" in done.stderr
    assert f"hp-train blame {stop} --step {first})" in done.stderr  # where to look next
