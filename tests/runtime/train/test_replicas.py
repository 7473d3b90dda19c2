"""Replica groups (issue 48, `parallel.fault_tolerance`, torchft): two groups, each its own
torchrun job, against a real lighthouse; one is SIGKILLed mid-run and started again. The other
never stops; the healed group's weights equal its peer's bit for bit; the losses before the
kill equal a run without one; the skipped samples are the dead group's share of exactly the
steps it missed, as the sampler gives them."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hp_data.sampler import PretrainingSampler
from hp_runtime.train.checkpoint_format import read_meta

from tests.helpers.train import (
    TORCHRUN,
    corpus_overrides,
    hp_train_here,
    records,
    signal_tree,
)

os.environ.setdefault("RUST_LOG", "warn")  # the in-process lighthouse logs every quorum at info
pytest.importorskip("torchft")

# ~0.3 s a step a group on CI's CPU: a kill lands mid-run and the restart (a new torchrun,
# torch imported again) comes back while the other group still trains.
MODEL = [
    "data.type=dummy", "data.seq_length=64", "model.vocab_size=8192", "model.dim=256",
    "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=688",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.cpu_threads=1",
    "metrics.log_interval=1", "metrics.plot=false", "metrics.tensorboard=false",
    "data.num_workers=0", "optim.decay_style=constant",
]  # fmt: skip
STEPS, KILL_AT = 160, 5  # the restart takes ~80 steps of the survivor: 2x that to spare
# A group's layout: (ranks, keys); global batch 8 over 2 groups x the group's data-parallel ranks
LAYOUTS = {"1-rank": (1, []), "fsdp2": (2, ["parallel.dp_shard=2"])}


@pytest.fixture(scope="module")
def corpus(example_corpus, example_tokenizer, tmp_path_factory):
    """The shipped corpus (its samples have records `hp-train blame` finds)."""
    return corpus_overrides(example_corpus, example_tokenizer, tmp_path_factory.mktemp("cache"))


@pytest.fixture
def lighthouse():
    from torchft._torchft import LighthouseServer

    # join_timeout: a group that asks while its peer trains waits for the peer's next step
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10_000)
    yield server.address()
    server.shutdown()


def _args(group: int, url: str, run: Path, steps: int = STEPS, *extra: str) -> list[str]:
    ft = f'{{replica_group = {group}, groups = 2, lighthouse = "{url}", quorum_timeout_s = 60}}'
    return [*MODEL, f"train.steps={steps}", f"checkpoint.interval={STEPS // 4}", *extra,
            f"parallel.fault_tolerance={ft}", f"train.run_dir={run / f'g{group}'}"]  # fmt: skip


def _start(args: list[str], log: Path, nproc: int = 1) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [TORCHRUN, f"--nproc-per-node={nproc}", "--standalone", "-m", "hp_runtime.train"]
    command += args
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


def _logged(run: Path, kind: str = "train") -> list[int]:
    """The steps of `kind` records a running group has logged so far. A restarted group with no
    checkpoint of its own starts fresh: its earlier log is moved aside before the new one is
    opened, so for a moment there is none."""
    try:
        return [r["step"] for r in records(run, kind)]
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
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_group_heals_and_the_other_never_stops(tmp_path, lighthouse, corpus, layout):
    nproc, keys = LAYOUTS[layout]
    reference, run = tmp_path / "reference", tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("r0", "r1", "g0", "g1", "g1-again")}

    def start(group: int, where: Path, log: str, steps: int = STEPS) -> subprocess.Popen:
        return _start(_args(group, lighthouse, where, steps, *corpus, *keys), logs[log], nproc)

    # the run without a kill, as far as the kill (a constant lr: the steps after change nothing)
    both = [start(g, reference, f"r{g}", KILL_AT) for g in (0, 1)]
    for g, process in enumerate(both):
        _wait(process, logs[f"r{g}"])

    g0, g1 = start(0, run, "g0"), start(1, run, "g1")
    deadline = time.monotonic() + 300
    while len(_logged(run / "g1")) < KILL_AT:
        assert g1.poll() is None and time.monotonic() < deadline, logs["g1"].read_text()[-2000:]
        time.sleep(0.01)
    signal_tree(g1.pid, signal.SIGKILL)
    killed = time.monotonic()
    g1.wait()
    again = start(1, run, "g1-again")
    while not _logged(run / "g1", "healed"):
        assert again.poll() is None, logs["g1-again"].read_text()[-3000:]
        assert g0.poll() is None, "the survivor finished before the restarted group healed"
        assert time.monotonic() < deadline, "the restarted group never healed"
        time.sleep(0.05)
    print(f"recovery ({layout}): kill to healed in {time.monotonic() - killed:.1f} s")
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

    # the periodic saves were group 0's alone; each group saved its own at the end
    saved = {g: [p.name for p in sorted((run / f"g{g}" / "checkpoints").glob("step-*"))]
             for g in "01"}  # fmt: skip
    assert saved["0"] == [f"step-{s:07d}" for s in range(STEPS // 4, STEPS + 1, STEPS // 4)]
    assert saved["1"] == [f"step-{STEPS:07d}"]

    # the steps group 1 missed, and their samples: its share, as the sampler gives it
    healed = records(run / "g1", "healed")[0]["step"]
    missed = [r["step"] for r in records(run / "g0", "replicas")]
    # (from KILL_AT + 2 when it died after committing KILL_AT + 1 but before logging it)
    assert missed in (list(range(KILL_AT + 1, healed + 1)), list(range(KILL_AT + 2, healed + 1)))
    dp = 2 * nproc  # the data-parallel ranks of both groups; group 1 holds the upper half
    group1 = range(nproc, dp)
    for r in records(run / "g0", "replicas"):
        assert r["missing"] == [1] and r["groups"] == [0] and r["skipped_samples"] == 4
        first = (r["step"] - 1) * 8
        share = [i for rank in group1 for batch in
                 itertools.islice(PretrainingSampler(10**6, first, 2, rank, dp), 8 // (2 * dp))
                 for i in batch]  # fmt: skip
        skipped = [i for start, end in r["skipped"] for i in range(start, end)]
        assert sorted(skipped) == sorted(share), (r, share)
    # in the checkpoint's data state, the survivor's and (received when it healed) the healed
    untrained = [[1, missed[0], missed[-1]]]
    assert read_meta(str(run / "g0" / final))["untrained"] == untrained
    assert read_meta(str(run / "g1" / final))["untrained"] == untrained
    # and hp-train blame says which samples of a missed step no group trained
    step = missed[0]
    report = json.loads(hp_train_here("blame", run / "g0", "--step", step, "--json").stdout)
    flagged = {s["index"] for s in report["samples"] if s.get("missing_group") == 1}
    assert flagged == {i for r in records(run / "g0", "replicas") if r["step"] == step
                       for start, end in r["skipped"] for i in range(start, end)}  # fmt: skip
    assert len(report["samples"]) == 8 and len(flagged) == 4


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


@pytest.mark.slow
def test_a_quorum_below_min_replicas_stops_in_one_line(tmp_path, lighthouse):
    """min_replicas = 2 and a group dies: the survivor commits nothing more and stops within
    quorum_timeout_s, in one line, instead of waiting for ever."""
    ft = "replica_group = {g}, groups = 2, min_replicas = 2, quorum_timeout_s = 5"
    args = [*MODEL, "train.steps=200"]
    runs = [
        _start([*args, f"parallel.fault_tolerance={{{ft.format(g=g)}, lighthouse = "
                f'"{lighthouse}"}}', f"train.run_dir={tmp_path / f'g{g}'}"],
               tmp_path / f"g{g}.log")
        for g in (0, 1)
    ]  # fmt: skip
    deadline = time.monotonic() + 240
    while len(_logged(tmp_path / "g1")) < 3:
        assert runs[1].poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    signal_tree(runs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    code = runs[0].wait(timeout=120)
    text = (tmp_path / "g0.log").read_text()
    errors = [line for line in text.splitlines() if line.startswith("hp-train: error:")]
    assert code != 0 and len(errors) == 1, text[-3000:]
    assert "parallel.fault_tolerance" in errors[0] and "quorum_timeout_s = 5" in errors[0]
    assert time.monotonic() - killed < 60
    rank = text.split("torch/distributed/elastic")[0]
    assert "Traceback" not in rank, rank[-3000:]
    assert len(_logged(tmp_path / "g0")) < 200


def test_two_jobs_as_one_group_are_refused_in_one_line(tmp_path, lighthouse):
    """Both jobs say replica_group = 0: neither trains that share twice while the other
    share goes missing; each stops at the first step, in one line."""
    ft = f'{{replica_group = 0, groups = 2, lighthouse = "{lighthouse}", quorum_timeout_s = 30}}'
    jobs = [_start([*MODEL, "train.steps=20", f"parallel.fault_tolerance={ft}",
                    f"train.run_dir={tmp_path / f'job{j}'}"], tmp_path / f"job{j}.log")
            for j in (0, 1)]  # fmt: skip
    for j, job in enumerate(jobs):
        assert job.wait(timeout=180) != 0
        text = (tmp_path / f"job{j}.log").read_text()
        errors = [line for line in text.splitlines() if line.startswith("hp-train: error:")]
        assert errors == [
            "hp-train: error: parallel.fault_tolerance.replica_group = 0: 2 jobs run as this "
            "group; give each torchrun job its own replica_group"
        ], text[-3000:]
        assert not _logged(tmp_path / f"job{j}")
