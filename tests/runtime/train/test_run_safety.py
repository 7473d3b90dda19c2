"""hp-train never loses a run and never trains on what it did not mean to load: which
checkpoint a command resumes, whose checkpoints `keep` prunes, a checkpoint of another model,
damaged or crafted files, a full disk. Runs go through hp-train's real entry point in this
process (one rank) unless a launcher is the point."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.train import (
    FAST,
    Payload,
    hp_train_here,
    plant_in_optimizer,
    records,
    torchrun,
)

TINY = [
    *FAST,
    "data.type=dummy",
    "data.seq_length=16",
    "optim.warmup_steps=0",
    "optim.decay_style=constant",
]  # fmt: skip  (the LR then does not depend on train.steps)


def run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return hp_train_here(*TINY, f"train.run_dir={run_dir}", *extra)


def ok(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    done = run(run_dir, *extra)
    assert done.returncode == 0, done.stderr + done.stdout[-2000:]
    return done


def refused(run_dir: Path, *extra: str, code: int = 1) -> str:
    """The one line a refused run prints (and that it printed nothing else on stderr)."""
    done = run(run_dir, *extra)
    assert done.returncode == code, done.stdout[-2000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hp-train: error: "), done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run of 6 steps, checkpoints every 2: what every resume must equal."""
    run_dir = tmp_path_factory.mktemp("reference")
    ok(run_dir, "train.steps=6", "checkpoint.interval=2")
    return run_dir


def test_an_explicit_path_seeds_a_run_directory_once(reference, tmp_path):
    seed = reference / "checkpoints" / "step-0000002"
    target = tmp_path / "b"
    command = ["checkpoint.interval=2", f"checkpoint.resume={seed}"]
    first = ok(target, *command, "train.steps=4")  # stopped at 4, as a preemption would
    assert f"resumed from {seed} at step 2" in first.stdout
    again = ok(target, *command, "train.steps=6")  # the same command goes on from its own
    assert "seeds a run directory only while it has no checkpoints" in again.stdout
    assert f"resumed from {target / 'checkpoints' / 'step-0000004'} at step 4" in again.stdout
    assert losses(target) == {s: v for s, v in losses(reference).items() if s > 2}
    kept = snapshot(target / "checkpoints")
    done = ok(target, *command, "train.steps=6")  # finished: nothing retrained, nothing cut
    assert "nothing to do: the run is at step 6" in done.stdout
    assert snapshot(target / "checkpoints") == kept and sorted(losses(target)) == [3, 4, 5, 6]


def test_a_seeded_run_goes_on_after_its_seed_is_deleted(reference, tmp_path):
    """Seed from a scratch checkpoint, delete it, get preempted, run the same command: the
    path is ignored once the run has its own checkpoints, so it is not required to exist."""
    seed = tmp_path / "scratch" / "step-0000002"
    shutil.copytree(reference / "checkpoints" / "step-0000002", seed)
    target = tmp_path / "b"
    command = ["checkpoint.interval=2", f"checkpoint.resume={seed}"]
    ok(target, *command, "train.steps=4")  # 2 steps from the seed, as a preemption would stop
    shutil.rmtree(seed.parent)
    again = ok(target, *command, "train.steps=6")
    assert f"resumed from {target / 'checkpoints' / 'step-0000004'} at step 4" in again.stdout
    assert losses(target) == {s: v for s, v in losses(reference).items() if s > 2}
    line = refused(tmp_path / "c", *command, "train.steps=4")  # where it would seed: refused
    assert (
        line == f"hp-train: error: checkpoint.resume = {str(seed)!r}: no such checkpoint directory"
    )
    assert not (tmp_path / "c").exists()


def test_a_fresh_start_never_mixes_with_another_runs_checkpoints(reference, tmp_path):
    target = tmp_path / "old"
    shutil.copytree(reference, target)
    before = snapshot(target)
    line = refused(target, "checkpoint.resume=none", "checkpoint.keep=1", "train.steps=4",
                   "checkpoint.interval=2")  # fmt: skip
    assert "checkpoint.resume = 'none', but" in line and "step-0000006" in line
    assert snapshot(target) == before  # not even config.toml or metrics.jsonl was touched


def test_auto_refuses_a_directory_holding_two_runs(reference, tmp_path):
    other = tmp_path / "other"
    ok(other, "train.steps=2", "checkpoint.interval=2", "train.seed=5")
    target = tmp_path / "mixed"
    shutil.copytree(reference, target)
    shutil.copytree(other / "checkpoints" / "step-0000002", target / "checkpoints" / "step-0000001")
    before = snapshot(target)
    line = refused(target, "train.steps=8", "checkpoint.interval=2")
    assert "holds checkpoints of 2 runs" in line
    assert snapshot(target) == before


def test_keep_prunes_only_the_runs_own_checkpoints(reference, tmp_path):
    """A foreign checkpoint in the directory (put there by hand) survives `keep`."""
    from hp_runtime.train.checkpoint import Checkpointer
    from hp_runtime.train.checkpoint_format import read_meta
    from hp_runtime.train.config import CheckpointConfig
    from hp_runtime.train.launch import Runtime

    target = tmp_path / "run"
    shutil.copytree(reference, target)
    root = target / "checkpoints"
    foreign = root / "step-0000009"
    shutil.copytree(root / "step-0000002", foreign)
    meta = json.loads((foreign / "meta.json").read_text())
    meta.pop("xxh3")
    meta["run_id"] = "someone-else"
    (foreign / "meta.json").write_text(json.dumps(meta))  # no checksum: read as written
    runtime = Runtime(0, 1, 0, 1, torch.device("cpu"))
    checkpointer = Checkpointer(str(target), CheckpointConfig(keep=1), runtime)
    checkpointer.adopt(read_meta(str(root / "step-0000006")))
    checkpointer._prune()
    assert sorted(p.name for p in root.iterdir()) == ["step-0000006", "step-0000009"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("model.n_layers=1", "model.n_layers = 1, but"),
        ("model.tie_embeddings=true", "model.tie_embeddings = True, but"),
        ("model.vocab_size=300", "model.vocab_size = 300, but"),
        ("model.rope_theta=500000.0", "model.rope_theta = 500000.0, but"),
    ],
)
def test_a_checkpoint_of_another_model_is_refused_by_name(reference, tmp_path, change, named):
    target = tmp_path / "run"
    shutil.copytree(reference, target)
    before = snapshot(target / "checkpoints")
    line = refused(target, "train.steps=8", change)
    assert named in line and "step-0000006 was trained with" in line
    assert snapshot(target / "checkpoints") == before


def test_extra_or_missing_tensors_are_named(reference):
    """Below the config check: the tensor sets compared both ways (a checkpoint whose config
    was edited by hand would otherwise load in part)."""
    from hp_runtime.model import ModelConfig
    from hp_runtime.train.checkpoint_format import CheckpointError
    from hp_runtime.train.compat import check_tensors
    from hp_runtime.train.storage import CheckedReader

    path = str(reference / "checkpoints" / "step-0000006")
    metadata = CheckedReader(path).read_metadata()
    with pytest.raises(CheckpointError, match=r"has layers\.1\.attention\.wk\.weight, .*which"):
        check_tensors(path, metadata, ModelConfig(n_layers=1))
    with pytest.raises(CheckpointError, match=r"has no layers\.2\.attention\.wk\.weight"):
        check_tensors(path, metadata, ModelConfig(n_layers=3))
    check_tensors(path, metadata, ModelConfig())  # the model that wrote it


def _flip(file: Path, where: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * where)] ^= 0x20
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_flipped_byte_is_found_and_fallen_back_from(tmp_path, reference, mode):
    target = tmp_path / "run"
    ok(
        target,
        "train.steps=6",
        "checkpoint.interval=2",
        f"checkpoint.async={str(mode == 'async').lower()}",
    )
    assert losses(target) == losses(reference)
    shard = next((target / "checkpoints" / "step-0000006").glob("*.distcp"))
    _flip(shard)
    done = ok(target, "train.steps=6", "checkpoint.interval=2")
    assert f"warning: {target / 'checkpoints' / 'step-0000006'}: cannot be loaded" in done.stdout
    assert f"{shard}: " in done.stdout and "fails its checksum" in done.stdout
    assert "resumed from" in done.stdout and "step-0000004" in done.stdout
    # steps 5 and 6 trained again from step 4: the same losses as the first time
    assert losses(target) == losses(reference)
    # the damaged step-6 is kept aside, not deleted, and never loaded again
    assert (target / "checkpoints" / "step-0000006.replaced-1" / shard.name).exists()


def _legacy_rng(checkpoint: Path) -> None:
    """Rewrite a checkpoint's random states as hp wrote them before: a pickle."""
    from hp_runtime.train import rng

    for file in (checkpoint / "extra").glob("rank-*.json"):
        from hp_runtime.train.storage import read_json

        saved = read_json(str(file))
        rng.restore(saved, torch.device("cpu"))
        import random

        torch.save(
            {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()},
            file.with_suffix(".pt"),
        )  # fmt: skip
        file.unlink()


def test_old_random_states_still_resume_exactly_and_crafted_ones_run_nothing(reference, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(reference, target)
    for step in (4, 6):
        _legacy_rng(target / "checkpoints" / f"step-{step:07d}")
    shutil.rmtree(target / "checkpoints" / "step-0000006")  # resume the old format from 4
    ok(target, "train.steps=6", "checkpoint.interval=2")
    assert losses(target) == losses(reference)
    # a crafted pickle in the newest checkpoint: refused by name, never run; falls back
    marker = tmp_path / "pwned"
    newest = target / "checkpoints" / "step-0000006"
    _legacy_rng(newest)
    torch.save({"torch": Payload(marker)}, newest / "extra" / "rank-00000.pt")
    done = ok(target, "train.steps=6", "checkpoint.interval=2")
    assert "refers to posix.system, which a checkpoint never holds" in done.stdout
    assert "step-0000004" in done.stdout and not marker.exists()
    metadata = target / "checkpoints" / "step-0000006" / ".metadata"
    with open(metadata, "wb") as stream:
        pickle.dump(Payload(marker), stream)
    meta = json.loads((metadata.parent / "meta.json").read_text())
    meta.pop("xxh3")
    meta.pop("dcp_metadata_xxh3")  # as a checkpoint from before checksums would be
    (metadata.parent / "meta.json").write_text(json.dumps(meta))
    done = ok(target, "train.steps=6", "checkpoint.interval=2")
    assert f"{metadata}: refers to posix.system" in done.stdout and not marker.exists()


def _mutations(checkpoint: Path, seed: int):
    """Seeded damage of one file of `checkpoint`: (what was done, how to do it)."""
    rng = np.random.default_rng(seed)
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    file = files[int(rng.integers(len(files)))]
    kind = ["truncate", "flip", "delete", "garble", "empty"][int(rng.integers(5))]
    if file.name == "meta.json" and rng.random() < 0.5:
        kind = "json-types"
    return file, kind, float(rng.uniform(0.01, 0.99))


def _damage(file: Path, kind: str, where: float) -> None:
    data = file.read_bytes()
    if kind == "truncate":
        file.write_bytes(data[: int(len(data) * where)])
    elif kind == "flip":
        _flip(file, where)
    elif kind == "delete":
        file.unlink()
    elif kind == "garble":
        cut = int(len(data) * where)
        file.write_bytes(data[:cut] + os.urandom(min(64, len(data) - cut)) + data[cut + 64 :])
    elif kind == "empty":
        file.write_bytes(b"")
    else:  # valid JSON, wrong shape
        choice = {0: {}, 1: [1], 2: {**json.loads(data), "step": "6"}}[int(where * 3) % 3]
        file.write_text(json.dumps(choice))


@pytest.mark.parametrize("seed", range(8))
def test_checkpoint_fuzz_never_loads_damage(reference, tmp_path, seed):
    target = tmp_path / "run"
    shutil.copytree(reference, target)
    newest = target / "checkpoints" / "step-0000006"
    file, kind, where = _mutations(newest, seed)
    _damage(file, kind, where)
    done = run(target, "train.steps=6", "checkpoint.interval=2")
    assert "Traceback" not in done.stdout + done.stderr
    assert done.returncode == 0, (kind, file.name, done.stderr)
    assert f"warning: {newest}" in done.stdout, (kind, file.name, done.stdout[-1500:])
    assert "step-0000004" in done.stdout
    assert losses(target) == losses(reference)  # steps 5, 6 again from the good checkpoint


def test_every_checkpoint_damaged_stops_with_one_line(reference, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(reference, target)
    for checkpoint in (target / "checkpoints").iterdir():
        (checkpoint / "meta.json").write_text("[1]")
    line = refused(target, "train.steps=8")
    assert "no checkpoint of" in line and "could be loaded" in line


def _tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip("a full disk needs a small tmpfs (root)")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_during_a_save(tmp_path, mode):
    disk = tmp_path / "disk"
    _tmpfs(disk, "400k")  # the run's logs fit; a checkpoint (~1.3 MB) does not
    try:
        target = disk / "run"
        line = refused(target, "train.steps=4", "checkpoint.interval=2",
                       f"checkpoint.async={str(mode == 'async').lower()}")  # fmt: skip
        assert "checkpoint of step 2 not written: no space left on the device holding" in line
        assert "GB, " in line and "run the same command to resume" in line
        assert list((target / "checkpoints").iterdir()) == []  # nothing partial left
        assert records(target, "checkpoint") == []  # none logged that was never committed
        end = records(target, "end")[-1]
        assert end["status"] == "failed" and "no space left" in end["reason"]
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_refusal_under_torchrun_is_one_line_from_rank_0(reference, tmp_path, repo):
    """Found alike on both ranks, reported once; no rank left behind."""
    target = tmp_path / "old"
    shutil.copytree(reference, target)
    before = snapshot(target)
    done = torchrun(2, *TINY, f"train.run_dir={target}", "parallel.dp_shard=2",
                    "train.global_batch_size=2", "checkpoint.resume=none", "train.steps=6",
                    cwd=repo)  # fmt: skip
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("hp-train: error:")]
    assert len(ours) == 1 and "checkpoint.resume = 'none', but" in ours[0], done.stderr[-2000:]
    assert "/hp_runtime/" not in done.stderr  # no traceback through hp's code
    assert snapshot(target) == before


def test_export_refuses_a_crafted_metadata_and_runs_nothing(reference, tmp_path):
    from hp_runtime.train.hf import export_checkpoint
    from hp_runtime.train.launch import TrainError

    checkpoint = tmp_path / "step"
    shutil.copytree(reference / "checkpoints" / "step-0000006", checkpoint)
    marker = tmp_path / "pwned"
    with open(checkpoint / ".metadata", "wb") as stream:
        pickle.dump(Payload(marker), stream)
    with pytest.raises(TrainError, match=r"\.metadata: fails its checksum"):
        export_checkpoint(str(checkpoint), str(tmp_path / "hf"))
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta.pop("xxh3")
    meta.pop("dcp_metadata_xxh3")  # no checksum to catch it: the unpickler must
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TrainError, match=r"\.metadata: refers to posix\.system"):
        export_checkpoint(str(checkpoint), str(tmp_path / "hf"))
    assert not marker.exists() and not (tmp_path / "hf").exists()


def _users_files(directory: Path) -> dict[str, bytes]:
    """A user's own files in a directory hp is pointed at."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "notes.txt").write_text("my notes\n")
    (directory / "sub").mkdir(exist_ok=True)
    (directory / "sub" / "keep.bin").write_bytes(os.urandom(64))
    (directory / "step-0000003.txt").write_text("named like a checkpoint\n")
    return snapshot(directory)


def test_train_export_and_plot_leave_a_users_files_alone(reference, tmp_path):
    """Every hp-train command that writes, pointed at directories holding a user's files,
    succeeding and failing: those files are byte-identical afterwards."""
    home = tmp_path / "home"
    mine = _users_files(home)
    ok(home, "train.steps=2", "checkpoint.interval=2", "metrics.plot=true")
    refused(home, "train.steps=4", "checkpoint.resume=none")  # a refusal touches nothing
    refused(home, "train.steps=4", "model.n_layers=1")
    checkpoint = home / "checkpoints" / "step-0000002"
    for out in (home, home / "sub", tmp_path):  # run dir, a user's folder, the cwd's parent
        done = hp_train_here("export", checkpoint, "--out", out)
        assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert hp_train_here("export", checkpoint, "--out", home / "hf").returncode == 0
    for out in (home / "sub", home / "notes.txt" / "x.png", home / "missing" / "x.png"):
        done = hp_train_here("plot", home, "--out", out)
        assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert hp_train_here("plot", home, "--out", home / "curves.png").returncode == 0
    now = snapshot(home)
    assert {name: now[name] for name in mine} == mine


def test_a_crafted_optimizer_item_runs_nothing(reference, tmp_path):
    """DCP stores the optimizer's hyperparameters as pickled byte items, and its own loader
    unpickles them with weights_only=False: hp's does not."""
    target = tmp_path / "run"
    shutil.copytree(reference, target)
    marker = tmp_path / "pwned"
    lr = plant_in_optimizer(target / "checkpoints" / "step-0000006", marker, tmp_path)
    done = ok(target, "train.steps=6", "checkpoint.interval=2")
    assert f"optim.{lr}: refers to posix.system" in done.stdout, done.stdout[-2000:]
    assert "step-0000004" in done.stdout and not marker.exists()
    assert losses(target) == losses(reference)


def _strip_run_ids(run_dir: Path) -> None:
    """Make a run's checkpoints look as hp wrote them before run ids (and checksums)."""
    for meta_file in (run_dir / "checkpoints").glob("step-*/meta.json"):
        meta = json.loads(meta_file.read_text())
        for key in ("run_id", "xxh3"):
            meta.pop(key)
        meta_file.write_text(json.dumps(meta))


def test_a_run_from_before_run_ids_resumes_again_and_again(reference, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(reference, target)
    _strip_run_ids(target)
    ok(target, "train.steps=8", "checkpoint.interval=2")
    ok(target, "train.steps=10", "checkpoint.interval=2", "checkpoint.keep=2")
    names = sorted(p.name for p in (target / "checkpoints").iterdir())
    assert names == ["step-0000008", "step-0000010"]  # keep pruned the old ones too: one run


def test_an_older_checkpoint_of_the_same_directory_is_no_rollback_in_place(reference, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(reference, target)
    before = snapshot(target)
    old = target / "checkpoints" / "step-0000004"
    line = refused(target, "train.steps=8", f"checkpoint.resume={old}")
    assert "is an older checkpoint of this run directory" in line and "step-0000006" in line
    assert snapshot(target) == before
    newest = target / "checkpoints" / "step-0000006"
    done = ok(target, "train.steps=6", f"checkpoint.resume={newest}")  # the newest: as auto
    assert "nothing to do" in done.stdout


def test_an_optimizer_change_is_refused_but_the_schedule_may_change(reference, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(reference, target)
    line = refused(target, "train.steps=8", "optim.weight_decay=0.5")
    assert "optim.weight_decay = 0.5, but" in line and "was trained with 0.1" in line
    line = refused(target, "train.steps=8", "optim.name=sgd")
    assert "optim.name = 'sgd', but" in line
    ok(target, "train.steps=7", "optim.lr=1e-4")


def test_a_fresh_start_keeps_the_earlier_log(tmp_path):
    target = tmp_path / "run"
    ok(target, "train.steps=2")  # no checkpoint: a rerun starts afresh
    first = (target / "metrics.jsonl").read_bytes()
    done = ok(target, "train.steps=2")
    assert f"keeps the earlier metrics.jsonl as {target / 'metrics.jsonl.1'}" in done.stdout
    assert (target / "metrics.jsonl.1").read_bytes() == first
    assert sorted(losses(target)) == [1, 2]


def test_a_full_disk_under_torchrun_stops_every_rank_with_one_line(tmp_path, repo):
    """A background save that fails on both ranks: they stop at the same step (the failure
    travels with the step's stop flag), one line from rank 0, no rank left waiting."""
    disk = tmp_path / "disk"
    _tmpfs(disk, "400k")
    try:
        target = disk / "run"
        done = torchrun(2, *TINY, f"train.run_dir={target}", "parallel.dp_shard=2",
                        "train.global_batch_size=2", "train.steps=6", "checkpoint.interval=2",
                        "checkpoint.async=true", cwd=repo, timeout=120)  # fmt: skip
        assert done.returncode != 0
        ours = [line for line in done.stderr.splitlines() if line.startswith("hp-train: error:")]
        assert len(ours) == 1 and "no space left on the device" in ours[0], done.stderr[-3000:]
        assert "/hp_runtime/" not in done.stderr
        assert list((target / "checkpoints").iterdir()) == []
        assert records(target, "end")[-1]["status"] == "failed"
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_credential_in_a_key_is_stored_nowhere(tmp_path):
    """config.toml, checkpoints' meta.json and the log hold a path's credentials redacted."""
    target = tmp_path / "run"
    secret = "SECRETPW7"
    done = ok(target, "train.steps=2", "checkpoint.interval=2",
              f"data.path=https://user:{secret}@127.0.0.1:9/corpus")  # fmt: skip
    assert secret not in done.stdout + done.stderr
    assert all(secret.encode() not in data for data in snapshot(target).values())
    assert b"https://***:***@127.0.0.1:9/corpus" in (target / "config.toml").read_bytes()
    again = ok(target, "train.steps=4", "checkpoint.interval=2",
               "data.path=https://user:ROTATED@127.0.0.1:9/corpus")  # fmt: skip
    assert "resumed from" in again.stdout  # the identity does not depend on the secret
