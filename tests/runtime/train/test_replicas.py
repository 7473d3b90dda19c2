"""Replica groups (issue 48, `parallel.fault_tolerance`, torchft): two groups, each its own
torchrun job, against a real lighthouse; one is SIGKILLed mid-run and started again. The other
never stops; the healed group's weights equal its peer's bit for bit; the losses before the
kill equal a run without one; the skipped samples are the dead group's share of exactly the
steps it missed, as the sampler gives them."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hp_data.sampler import PretrainingSampler

from tests.helpers.train import TORCHRUN, hp_train_here, records, signal_tree

pytest.importorskip("torchft")

# ~0.3 s a step a group on CI's CPU: a kill lands mid-run and the restart (a new torchrun,
# torch imported again) comes back while the other group still trains.
MODEL = [
    "data.type=dummy", "data.seq_length=64", "model.vocab_size=4096", "model.dim=256",
    "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=688",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.cpu_threads=1",
    "metrics.log_interval=1", "metrics.plot=false", "metrics.tensorboard=false",
    "data.num_workers=0", "optim.decay_style=constant",
]  # fmt: skip
STEPS, KILL_AT = 160, 5  # the restart takes ~80 steps of the survivor: 2x that to spare


@pytest.fixture
def lighthouse():
    from torchft._torchft import LighthouseServer

    # join_timeout: a group that asks while its peer trains waits for the peer's next step
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10_000)
    yield server.address()
    server.shutdown()


def _args(group: int, url: str, run: Path, steps: int = STEPS) -> list[str]:
    ft = f'{{replica_group = {group}, groups = 2, lighthouse = "{url}", quorum_timeout_s = 60}}'
    return [*MODEL, f"train.steps={steps}", f"checkpoint.interval={steps}",
            f"parallel.fault_tolerance={ft}", f"train.run_dir={run / f'g{group}'}"]  # fmt: skip


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [TORCHRUN, "--nproc-per-node=1", "--standalone", "-m", "hp_runtime.train", *args]
    with open(log, "ab") as out:
        return subprocess.Popen(
            command, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT
        )


def _wait(process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_tree(process.pid, signal.SIGKILL)
        raise
    assert code == 0, log.read_text()[-3000:]


def _steps(run: Path) -> list[int]:
    try:
        return [r["step"] for r in records(run)]
    except (FileNotFoundError, ValueError):  # not written yet, or a line being written
        return []


def _model(checkpoint: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(checkpoint))
    names = [k for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")]
    state = {k: torch.empty(reader.read_metadata().state_dict_metadata[k].size) for k in names}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state


@pytest.mark.slow
def test_a_killed_group_heals_and_the_other_never_stops(tmp_path, lighthouse):
    reference, run = tmp_path / "reference", tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("r0", "r1", "g0", "g1", "g1-again")}
    # the run without a kill, as far as the kill (a constant lr: the steps after change nothing)
    both = [_start(_args(g, lighthouse, reference, KILL_AT), logs[f"r{g}"]) for g in (0, 1)]
    for g, process in enumerate(both):
        _wait(process, logs[f"r{g}"])

    g0 = _start(_args(0, lighthouse, run), logs["g0"])
    g1 = _start(_args(1, lighthouse, run), logs["g1"])
    deadline = time.monotonic() + 240
    while len(_steps(run / "g1")) < KILL_AT:
        assert g1.poll() is None and time.monotonic() < deadline, logs["g1"].read_text()[-2000:]
        time.sleep(0.01)
    signal_tree(g1.pid, signal.SIGKILL)
    killed = time.monotonic()
    g1.wait()
    again = _start(_args(1, lighthouse, run), logs["g1-again"])
    while not records(run / "g1", "healed"):
        assert again.poll() is None, logs["g1-again"].read_text()[-3000:]
        assert time.monotonic() < deadline, "the restarted group never healed"
        time.sleep(0.05)
    print(f"recovery: kill to healed in {time.monotonic() - killed:.1f} s")
    _wait(g0, logs["g0"])
    _wait(again, logs["g1-again"])

    # the survivor trained every step once; before the kill, as the run without one
    ref = {r["step"]: r["loss"] for r in records(reference / "g0")}
    got = {r["step"]: r["loss"] for r in records(run / "g0")}
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == ref[s] for s in range(1, KILL_AT + 1))
    # the healed group's weights are its peer's, bit for bit
    final = f"checkpoints/step-{STEPS:07d}"
    mine, peer = _model(run / "g1" / final), _model(run / "g0" / final)
    assert mine and all(torch.equal(mine[k], peer[k]) for k in peer)

    # the steps group 1 missed, and their samples: its share, as the sampler gives it
    healed = records(run / "g1", "healed")[0]["step"]
    missed = [r for r in records(run / "g0", "replicas")]
    assert [r["step"] for r in missed] == list(range(KILL_AT + 1, healed + 1)) or (
        [r["step"] for r in missed] == list(range(KILL_AT + 2, healed + 1))  # died committing 6
    )
    for r in missed:
        assert r["missing"] == [1] and r["groups"] == [0]
        # global batch 8 = 2 micro-batches of 2 samples x 2 data-parallel ranks, one a group
        sampler = PretrainingSampler(10**6, (r["step"] - 1) * 8, 2, 1, 2)
        share = [i for batch in itertools.islice(sampler, 2) for i in batch]
        skipped = [i for start, end in r["skipped"] for i in range(start, end)]
        assert sorted(skipped) == sorted(share), (r, share)
        assert r["skipped_samples"] == 4


def test_bad_values_of_each_key_are_one_line_each(tmp_path):
    base = [*MODEL, "train.steps=2", f"train.run_dir={tmp_path}"]
    cases = {
        "parallel.fault_tolerance={replica_group = 2, groups = 2}": "replica_group = 2",
        "parallel.fault_tolerance={groups = 2, min_replicas = 3}": "min_replicas = 3",
        'parallel.fault_tolerance={lighthouse = "vm:1"}': "lighthouse = 'vm:1'",
        "parallel.fault_tolerance={groups = 0}": "parallel.fault_tolerance.groups",
        "parallel.fault_tolerance={quorum_timeout_s = -1}": "quorum_timeout_s",
        "parallel.fault_tolerance={replica_group = -1}": "replica_group",
    }
    for override, named in cases.items():
        result = hp_train_here(*base, override)
        assert result.returncode == 2, (override, result.stdout, result.stderr)
        assert named in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
            override,
            result.stderr,
        )
    both = hp_train_here(*base, "parallel.dp_replicate=2", "parallel.fault_tolerance={groups = 2}")
    assert both.returncode == 2 and "dp_replicate" in both.stderr


def test_an_unreachable_lighthouse_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ft = f'{{groups = 2, lighthouse = "http://127.0.0.1:{port}", quorum_timeout_s = 5}}'
    log = tmp_path / "log"
    process = _start([*MODEL, "train.steps=2", f"train.run_dir={tmp_path / 'r'}",
                      f"parallel.fault_tolerance={ft}"], log)  # fmt: skip
    code = process.wait(timeout=120)
    text = log.read_text()
    assert code != 0
    assert f"parallel.fault_tolerance.lighthouse http://127.0.0.1:{port}" in text, text[-3000:]
    rank = text.split("torch/distributed/elastic")[0]  # torchrun's own report follows
    assert "Traceback" not in rank, rank[-3000:]
