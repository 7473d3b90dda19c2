"""Checkpoints: stop anywhere (a kill, a signal, a time limit), resume anywhere, same run."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.train import (
    FAST,
    TORCHRUN,
    hp_train_here,
    records,
    signal_tree,
    train_ranks,
)

# A model heavy enough (~0.25 s a step on 2 CPU ranks) that a kill lands mid-run.
MODEL = [
    "data.type=dummy", "data.seq_length=64", "model.vocab_size=4096", "model.dim=256",
    "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=688",
    "train.micro_batch_size=2", "train.cpu_threads=1", "metrics.log_interval=1",
    "metrics.plot=false", "metrics.tensorboard=false", "data.num_workers=0",
]  # fmt: skip
STEPS = 16


def _losses(run: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records(run)]


def _final_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    import tomllib

    import torch.distributed.checkpoint as dcp
    from hp_runtime.model import Transformer
    from hp_runtime.train.checkpoint_format import read_meta
    from hp_runtime.train.config import build_config

    config = build_config(tomllib.loads(read_meta(str(checkpoint))["config"])).model
    with torch.device("meta"):
        model = Transformer(config)
    state = {n: torch.empty(p.shape) for n, p in model.named_parameters()}
    dcp.load({"model": state}, checkpoint_id=str(checkpoint), no_dist=True)
    return state


def _start(args: list[str], nproc: int, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [TORCHRUN, f"--nproc-per-node={nproc}", "--standalone", "-m", "hp_runtime.train"]
    return subprocess.Popen(
        [*command, *args], cwd=cwd, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _kill_when(process: subprocess.Popen, ready, run: Path, timeout: float = 240) -> None:
    """SIGKILL every rank and the launcher once `ready()` holds, then wait until the killed
    ranks are gone: the launcher's exit does not wait for them, and rank 0 holds the run
    directory's lock (train/dirlock.py) until the kernel has ended it."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, "the run ended before the kill"
        assert time.monotonic() < deadline, "the kill point never came"
        time.sleep(0.002)
    signal_tree(process.pid, signal.SIGKILL)
    process.wait()
    lock = run / "hp-train.lock"
    gone = time.monotonic() + 60
    while lock.exists():
        with open(lock, "a") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < gone, "a killed rank still holds the run directory"
        time.sleep(0.05)


def _logged_steps(run: Path) -> int:
    """Train records so far (a line cut mid-write counts not)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return sum(1 for line in lines if line.startswith('{"kind": "train"') and line.endswith("}"))


LAYOUTS = {
    # Muon: its momentum and its sharded iteration (AdamW beside it: the other layouts' own).
    # The iteration in float32: on a CPU without bfloat16 instructions (CI's) a bfloat16
    # matmul is ~30x a float32 one, and the default iteration made a step 5 s, not 0.3 s.
    "fsdp2-muon": (2, ["parallel.dp_shard=2", "optim.name=muon",
                       "optim.muon.ns_dtype=float32"]),
    "pp2-tied": (2, ["parallel.pp=2", "model.tie_embeddings=true",
                     "train.global_batch_size=4"]),
    # DeepSeek-V3's shape (latent attention, YaRN, grouped sigmoid routing, the balancing
    # bias: state a resume must carry) at MODEL's widths, its experts over two ranks
    "deepseek-ep2": (2, ["model.preset=deepseek-v3-tiny", "model.n_kv_heads=4",
                         "parallel.dp_shard=2", "parallel.ep=2"]),
}  # fmt: skip


def _args(layout: str) -> list[str]:
    return [*MODEL, *LAYOUTS[layout][1], f"train.steps={STEPS}", "checkpoint.interval=4"]


def _resume(nproc: int, args: list[str], run: Path) -> str:
    """Rank 0's log of the run resumed in warm ranks through the library: what is under test
    is the stop (a launcher's job killed or signalled); the resume is the library's own."""
    return train_ranks(nproc, [*args, f"train.run_dir={run}"])[0]["log"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs by layout, made once for the tests that compare with them, in warm
    ranks through the library: the runs under test are launched by torchrun, as users do."""
    runs: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in runs:
            run = tmp_path_factory.mktemp(f"reference-{layout}")
            train_ranks(LAYOUTS[layout][0], [*_args(layout), f"train.run_dir={run}"])
            runs[layout] = run
        return runs[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sigkill_then_resume_is_bit_identical(repo, tmp_path, reference, layout):
    nproc, args = LAYOUTS[layout][0], _args(layout)
    run = tmp_path / "run"
    kill_at = random.Random(layout).randint(6, STEPS - 4)  # after the step-4 checkpoint
    process = _start([*args, f"train.run_dir={run}"], nproc, repo)
    _kill_when(process, lambda: _logged_steps(run) >= kill_at, run)
    assert STEPS > len(records(run)) >= kill_at
    resumed = _resume(nproc, args, run)
    assert "resumed from" in resumed

    # every step once, with the uninterrupted run's losses and grad norms, bit for bit
    assert _losses(run) == _losses(reference(layout))
    final = f"checkpoints/step-{STEPS:07d}"
    want, got = _final_model(reference(layout) / final), _final_model(run / final)
    assert all(torch.equal(want[name], got[name]) for name in want)


@pytest.mark.slow
def test_a_kill_during_an_async_save_leaves_it_out(repo, tmp_path, reference):
    args = [*_args("fsdp2-muon"), "checkpoint.async=true"]
    run = tmp_path / "run"
    partial = run / "checkpoints" / ".tmp-step-0000008"
    process = _start([*args, f"train.run_dir={run}"], 2, repo)
    _kill_when(process, partial.exists, run)  # the second save has begun, not committed
    assert partial.exists()
    assert [p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")] == [
        "step-0000004"
    ]
    resumed = _resume(2, args, run)
    assert "resumed from" in resumed and "step-0000004" in resumed
    assert not partial.exists()
    assert _losses(run) == _losses(reference("fsdp2-muon"))  # async saves change nothing


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero_then_resumes(repo, tmp_path, reference):
    args = [*_args("fsdp2-muon"), "checkpoint.interval=0"]  # a stop request saves all the same
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [TORCHRUN, "--nproc-per-node=2", "--standalone", "-m", "hp_runtime.train", *args,
         f"train.run_dir={run}"],
        cwd=repo, env=env, start_new_session=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    while _logged_steps(run) < 5:
        assert process.poll() is None
        time.sleep(0.01)
    # a cluster's preemption signals every process of the job: here, the ranks
    signal_tree(process.pid, signal.SIGTERM, launcher=False)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0  # every rank saved and exited 0
    assert "stopped by SIGTERM" in out and "run the same command to resume" in out
    stopped = records(run, "end")[-1]
    assert stopped["status"] == "stopped by SIGTERM"
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step-{stopped['step']:07d}"]
    _resume(2, args, run)
    assert _losses(run) == _losses(reference("fsdp2-muon"))


@pytest.mark.slow
def test_time_limit_stops_before_it_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    started = time.monotonic()
    done = hp_train_here(*MODEL, "train.steps=100000", "train.time_limit=5",
                         f"train.run_dir={run}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "stopped by train.time_limit" in done.stdout
    assert time.monotonic() - started < 5 + 8  # the set-up is outside the limit
    step = records(run, "end")[-1]["step"]
    assert 0 < step < 100000 and (run / "checkpoints" / f"step-{step:07d}").is_dir()


# Resharding, in spawned ranks through the library: (world, layout) pairs.
DEEPSEEK = ["model.preset=deepseek-v3-tiny", "model.max_seq_len=64"]
MUON = ["optim.name=muon", "optim.muon.lr=0.02"]
RESHARD = {
    "fsdp2xtp2-to-fsdp4": ((4, ["parallel.dp_shard=2", "parallel.tp=2"]),
                           (4, ["parallel.dp_shard=4"])),
    "pp2-to-one": ((2, ["parallel.pp=2", "model.tie_embeddings=true"]),
                   (1, ["model.tie_embeddings=true"])),
    "one-to-hsdp2x2": ((1, []), (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"])),
    "cp2-to-one": ((2, ["parallel.cp=2"]), (1, [])),
    "one-to-hsdp2xcp2": ((1, []), (4, ["parallel.dp_replicate=2", "parallel.cp=2"])),
    "deepseek-ep2xpp2-to-one": ((4, [*DEEPSEEK, "parallel.dp_shard=2", "parallel.ep=2",
                                     "parallel.pp=2"]), (1, DEEPSEEK)),
    "muon-fsdp2-to-one": ((2, [*MUON, "parallel.dp_shard=2"]), (1, MUON)),
}  # fmt: skip
BASE = [  # SGD with momentum: optimizer state to move, less chaotic than Adam's first steps
    "data.type=dummy", "data.seq_length=32", "train.micro_batch_size=1",
    "train.global_batch_size=4", "train.steps=5", "optim.name=sgd", "optim.lr=0.1",
    "optim.momentum=0.9", "optim.warmup_steps=0",
]  # fmt: skip


def _loaded_then_trained(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """Set a run up (so it resumes), gather its full parameters and optimizer state, then
    train its remaining steps."""
    import io

    from hp_runtime.train import load_config, train
    from hp_runtime.train.launch import start
    from hp_runtime.train.setup import setup
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    config = load_config(None, [*FAST, *overrides])
    runtime = start("cpu", 1)
    run = setup(config, runtime, io.StringIO())
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    state = {"consumed_samples": np.array(run.state.consumed_samples)}
    for module, opt in zip(run.state.modules, run.state.optimizer.optimizers, strict=True):
        for name, value in get_model_state_dict(module, options=options).items():
            state[f"model.{name}"] = value.detach().numpy().copy()
        for name, value in get_optimizer_state_dict(module, opt, options=options).items():
            if isinstance(value, torch.Tensor):
                state[f"optim.{name}"] = value.detach().float().numpy().copy()
    result = train(config, runtime, io.StringIO(), run=run)
    return {"state": state, "losses": [result.losses[s] for s in sorted(result.losses)]}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESHARD))
def test_resume_on_another_layout(tmp_path, case):
    (world_a, layout_a), (world_b, layout_b) = RESHARD[case]
    run = tmp_path / "run"
    first = train_ranks(world_a, [*BASE, f"train.run_dir={run}", "checkpoint.interval=3",
                                  *layout_a])[0]  # fmt: skip
    resume = f"checkpoint.resume={run / 'checkpoints' / 'step-0000003'}"
    model = [o for o in layout_a if o.startswith(("model.", "optim."))]  # the same in both
    # what the checkpoint holds, read by one process, against what layout B loaded
    saved = run_ranks(_loaded_then_trained, 1, [*BASE, f"train.run_dir={tmp_path / 'one'}",
                                                *model, resume])  # fmt: skip
    loaded = run_ranks(_loaded_then_trained, world_b, [*BASE, f"train.run_dir={tmp_path / 'b'}",
                                                       *layout_b, resume])  # fmt: skip
    want, got = saved[0]["state"], {}
    for rank in loaded:
        got.update(rank["state"])
    assert got["consumed_samples"] == 12
    assert set(got) == set(want) and any("momentum_buffer" in name for name in want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # the same next samples: the resumed steps 4 and 5 repeat the first layout's
    np.testing.assert_allclose(loaded[0]["losses"], first["losses"][3:], rtol=1e-5)


def _fails(*overrides: str) -> str:
    done = hp_train_here(*FAST, *overrides)
    assert done.returncode == 1, done.stdout[-2000:]
    assert len(done.stderr.splitlines()) == 1, done.stderr
    return done.stderr


def test_resume_refuses_what_would_not_be_the_same_run(tmp_path):
    run = tmp_path / "run"
    base = [*BASE, f"train.run_dir={run}", "checkpoint.interval=5"]
    assert hp_train_here(*FAST, *base).returncode == 0
    step5 = run / "checkpoints" / "step-0000005"
    again = hp_train_here(*FAST, *base)  # the finished run, run again: said plainly, no NaN loss
    assert again.returncode == 0, again.stderr
    assert "hp-train: nothing to do: the run is at step 5 of train.steps 5" in again.stdout
    assert "loss nan" not in again.stdout
    message = _fails(*base, "train.steps=8", "train.global_batch_size=8")
    assert f"train.global_batch_size=8, but {step5} was trained with 4" in message
    message = _fails(*base, "train.steps=8", "data.seed=7")
    assert f"data.seed changed from 1234 to 7 since {step5}" in message
    assert "checkpoint.allow_data_change = true" in message
    message = _fails(*base, "train.steps=8", "model.ffn_hidden=128")
    assert f"model.ffn_hidden = 128, but {step5} was trained with 172" in message
    done = hp_train_here(*FAST, *base, "train.steps=8", "data.seed=7",
                    "checkpoint.allow_data_change=true")  # fmt: skip
    assert done.returncode == 0 and "resuming anyway" in done.stdout


def test_a_corrupt_newest_checkpoint_falls_back(tmp_path):
    run = tmp_path / "run"
    base = [*BASE, "train.steps=6", f"train.run_dir={run}", "checkpoint.interval=2",
            "checkpoint.keep=2"]  # fmt: skip
    assert hp_train_here(*FAST, *base).returncode == 0
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-0000004", "step-0000006"]  # keep = 2
    shard = next((run / "checkpoints" / "step-0000006").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    done = hp_train_here(*FAST, *base, "train.steps=8")
    assert done.returncode == 0, done.stderr
    assert f"warning: {run / 'checkpoints' / 'step-0000006'}" in done.stdout
    assert "resumed from" in done.stdout and "step-0000004" in done.stdout
    steps = [r["step"] for r in records(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 8  # the log goes on without repeats
    for path in (run / "checkpoints").glob("step-*"):  # every checkpoint unreadable
        for file in path.glob("*.distcp"):
            file.write_bytes(b"")
    message = _fails(*base, "train.steps=10")
    assert "no checkpoint of" in message and "could be loaded" in message


def test_checkpoint_names_sort_by_step(tmp_path):
    from hp_runtime.train.checkpoint_format import committed, step_name

    for step in (10, 9, 100):
        (tmp_path / step_name(step)).mkdir()
    (tmp_path / ".tmp-step-0000200").mkdir()
    assert [Path(p).name for p in committed(str(tmp_path))] == [
        "step-0000009", "step-0000010", "step-0000100"
    ]  # fmt: skip
    assert json.loads(json.dumps(step_name(3))) == "step-0000003"
