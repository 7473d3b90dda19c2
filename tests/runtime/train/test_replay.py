"""`hp-train replay`: a 2-rank run's steps again from its checkpoint, on its own layout
(bit-identical to what it logged) and on one process (within 1e-5), with step N's per-sample
losses and per-parameter gradient norms dumped; the run's own files untouched."""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.train import FAST, hp_train_here, train_ranks

RUN = [
    *FAST,
    "data.type=dummy",
    "data.seq_length=32",
    "train.steps=6",
    "train.global_batch_size=4",
    "checkpoint.interval=2",
    "optim.lr=1e-2",
]


def _replay(rank: int, world: int, run_dir: str, overrides: list[str], dump: str | None):
    from hp_runtime.train.launch import start
    from hp_runtime.train.replay import replay

    runtime = start("cpu", 1)
    return [vars(s) for s in replay(run_dir, 6, overrides, runtime, dump)]


def _listing(root: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    run = str(tmp_path_factory.mktemp("replay") / "run")
    train_ranks(2, [*RUN, "parallel.dp_shard=2", f"train.run_dir={run}"])
    return run


def test_replay_on_the_layout_and_on_one_process(run_dir, tmp_path):
    before = _listing(run_dir)
    same = run_ranks(_replay, 2, run_dir, ["parallel.dp_shard=2"], None)[0]
    assert [s["step"] for s in same] == [5, 6]  # from the checkpoint of step 4
    for s in same:  # the same layout: the same bits
        assert (s["loss"], s["grad_norm"]) == (s["logged_loss"], s["logged_grad_norm"])
    dump = str(tmp_path / "dump")
    one = run_ranks(_replay, 1, run_dir, ["parallel.dp_shard=1"], dump)[0]
    for s in one:
        assert math.isclose(s["loss"], s["logged_loss"], rel_tol=1e-5)
        assert math.isclose(s["grad_norm"], s["logged_grad_norm"], rel_tol=1e-5)
    assert _listing(run_dir) == before  # nothing of the run written, the replay's own removed

    dumped = json.loads((tmp_path / "dump" / "step-0000006.json").read_text())
    logged = one[-1]
    # step 6 trained the global samples after 5 steps of 4
    assert [s["index"] for s in dumped["samples"]] == [20, 21, 22, 23]
    tokens = sum(s["loss_tokens"] for s in dumped["samples"])
    assert tokens == 4 * 32
    mean = sum(s["loss_sum"] for s in dumped["samples"]) / tokens
    assert math.isclose(mean, logged["logged_loss"], rel_tol=1e-5)  # the 2-rank run's own
    norm = math.sqrt(sum(v * v for v in dumped["grad_norms"].values()))
    assert math.isclose(norm, logged["logged_grad_norm"], rel_tol=1e-5)  # before clipping
    assert "tok_embeddings.weight" in dumped["grad_norms"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--step", "0"], "--step 0: the run trains steps 1 to 6"),
        (["--step", "7"], "--step 7: the run trains steps 1 to 6"),
        (["--step", "3", "--dump", "EXISTING"], "exists; choose another directory"),
        (["--step", "3", "parallel.pp=2", "--dump", "NEW"], "--dump needs pp = 1 and cp = 1"),
    ],
)
def test_bad_requests_are_one_line(run_dir, tmp_path, args, message):
    (tmp_path / "step-0000003.json").write_text("the user's own")
    args = [str(tmp_path) if a == "EXISTING" else str(tmp_path / "new") if a == "NEW" else a
            for a in args]  # fmt: skip
    done = hp_train_here("replay", run_dir, *args)
    assert done.returncode == 1, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
    assert (tmp_path / "step-0000003.json").read_text() == "the user's own"


def test_a_directory_that_is_not_a_run(tmp_path):
    done = hp_train_here("replay", str(tmp_path), "--step", "1")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"hp-train: error: {tmp_path}: no config.toml here: give a hp-train run directory"
    )
