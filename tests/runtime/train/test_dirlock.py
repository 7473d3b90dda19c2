"""One job per run directory (`train/dirlock.py`): a second hp-train job in a directory a live
job holds (the same command twice, a scheduler's duplicate launch, a replay beside a live run)
is refused in one line naming the holder's host and pid, before it writes anything; the first
trains on as if alone. A killed holder's lock file blocks no one; a filesystem without locks
warns and runs. Same for two exports into one `--out`.

Two jobs are launched 1 s apart, as a duplicate launch would start them; the one that takes the
directory is paused (SIGSTOP, every process of it) until the other has ended, so that the other
meets it however slowly a loaded machine starts either: a paused job still holds its directory.
The holder then trains on, and what it wrote is compared with a run alone in another
directory."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.train import (
    HP_TRAIN,
    TORCHRUN,
    hp_train_here,
    records,
    signal_tree,
    train_ranks,
    workers,
)
from tests.runtime.train.test_run_safety import TINY, ok, refused

LOCK = "hp-train.lock"
HOLDER = r"\(pid (\d+) on host (\S+), since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\)"
STEPS = ["train.steps=4", "checkpoint.interval=2"]
ARGS = [*TINY, *STEPS]
TWO_RANKS = [*ARGS, "parallel.dp_shard=2", "train.global_batch_size=2"]
Ranks = Callable[[subprocess.Popen], list[int]]  # a job's processes that may hold the lock


def _deterministic(run_dir: Path) -> tuple[list[tuple], dict[str, bytes]]:
    """What two runs of one config in two directories share: the log's values (not its
    timings, nor paths) and the checkpoints' tensor files, byte for byte."""
    fields = ("kind", "step", "loss", "grad_norm", "lr", "consumed_samples", "status")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    logged = [tuple(record.get(f) for f in fields) for record in map(json.loads, lines)]
    shards = {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted((run_dir / "checkpoints").rglob("*.distcp"))
    }
    return logged, shards


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root`, a file's with its bytes: an empty directory made counts."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}  # fmt: skip


def _holder(run_dir: Path, jobs: list[subprocess.Popen], ranks: Ranks) -> int:
    """The pid the lock file names, once a process of one of `jobs` holds it."""
    deadline = time.monotonic() + 120
    while True:
        assert all(job.poll() is None for job in jobs), "a job ended before either held the dir"
        assert time.monotonic() < deadline, "no job held its directory"
        try:
            pid = json.loads((run_dir / LOCK).read_text())["pid"]
            if any(pid in ranks(job) for job in jobs):
                return pid
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.01)


def _finish(job: subprocess.Popen) -> tuple[str, str]:
    try:
        return job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        signal_tree(job.pid, signal.SIGKILL)
        job.communicate()
        raise


def _one_trains(
    command: list[str], run: Path, ranks: Ranks, cwd: Path | None = None
) -> tuple[int, str]:
    """`command` launched twice, 1 s apart (a duplicate launch): the job that takes `run` is
    paused (every process of it) until the other has ended, refused, having changed nothing
    there; then it trains on. The holder's pid and the other's stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs: list[subprocess.Popen] = []
    try:
        for _ in range(2):
            jobs.append(
                subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )  # fmt: skip
            time.sleep(1.0 if len(jobs) == 1 else 0)
        pid = _holder(run, jobs, ranks)
        holder, other = sorted(jobs, key=lambda job: pid not in ranks(job))
        signal_tree(holder.pid, signal.SIGSTOP)
        before = _tree(run)
        out, err = _finish(other)
        assert other.returncode != 0, out[-2000:]
        assert _tree(run) == before  # the refused job wrote nothing, not even its lock
    finally:
        for job in jobs:
            signal_tree(job.pid, signal.SIGCONT)
        done = [_finish(job) for job in jobs]
    assert holder.returncode == 0, done[jobs.index(holder)][1][-3000:]
    return pid, err


def _one_line(stderr: str) -> str:
    """hp-train's one error line, whatever a launcher adds around it."""
    ours = [line for line in stderr.splitlines() if line.startswith("hp-train: error:")]
    assert len(ours) == 1, stderr[-3000:]
    assert "/hp_runtime/" not in stderr  # no traceback through hp's code
    return ours[0]


def _refused_by(line: str, run_dir: Path, pid: int) -> None:
    holder = re.search(HOLDER, line)
    assert line.startswith(f"hp-train: error: {run_dir}: another hp-train job is writing here")
    assert holder is not None and holder[1] == str(pid), line
    assert holder[2] == socket.gethostname(), line


def test_two_hp_trains_in_one_run_directory_one_trains_as_if_alone(tmp_path):
    reference = tmp_path / "alone"
    ok(reference, *STEPS)
    run = tmp_path / "run"
    pid, err = _one_trains([HP_TRAIN, *ARGS, f"train.run_dir={run}"], run, lambda job: [job.pid])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    _refused_by(_one_line(err), run, pid)
    assert _deterministic(run) == _deterministic(reference)
    assert not (run / LOCK).exists()  # let go, and removed


def test_two_torchrun_jobs_in_one_run_directory_one_trains_as_if_alone(tmp_path, repo):
    """Rank 0 holds the directory for its job; every rank of the other job exits with rank 0's
    one line, none left waiting."""
    reference = tmp_path / "alone"
    train_ranks(2, [*TWO_RANKS, f"train.run_dir={reference}"])
    run = tmp_path / "run"
    command = [TORCHRUN, "--nproc-per-node=2", "--standalone", "-m", "hp_runtime.train"]
    pid, err = _one_trains(
        [*command, *TWO_RANKS, f"train.run_dir={run}"], run, lambda job: workers(job.pid), repo
    )
    _refused_by(_one_line(err), run, pid)
    assert _deterministic(run) == _deterministic(reference)
    assert not (run / LOCK).exists()


def _held_then_killed(lock: Path) -> tuple[int, int]:
    """A process that takes `lock` as a job does (hp's own code), forks a child that lives on
    (a DataLoader worker), and dies by SIGKILL: (its pid, the child's). The file stays
    behind, naming the dead one."""
    from hp_runtime.train.dirlock import DirLock

    ready = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: take it, fork the worker, say so, wait to be killed
        try:
            DirLock(str(lock)).take()
            worker = os.fork()
            if worker == 0:
                time.sleep(60)
                os._exit(0)
            os.write(ready[1], worker.to_bytes(4, "little"))
            time.sleep(60)
        finally:
            os._exit(1)
    worker = int.from_bytes(os.read(ready[0], 4), "little")
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    for fd in ready:
        os.close(fd)
    return pid, worker


def test_a_killed_jobs_lock_file_blocks_no_one(tmp_path):
    """Not even while a process it forked lives on: a worker's copy of the lock would hold the
    directory for the worker's whole life."""
    run = tmp_path / "run"
    run.mkdir()
    dead, worker = _held_then_killed(run / LOCK)
    try:
        assert json.loads((run / LOCK).read_text())["pid"] == dead  # left behind by the kill
        done = ok(run, *STEPS)
        os.kill(worker, 0)  # the worker was alive all along
    finally:
        os.kill(worker, signal.SIGKILL)
    assert "warning" not in done.stdout + done.stderr
    assert records(run, "end")[-1]["status"] == "completed"
    assert not (run / LOCK).exists()


def test_a_filesystem_without_locks_warns_and_trains(tmp_path, monkeypatch):
    """NFS without a lock daemon answers flock with ENOLCK (some FUSE filesystems with
    EOPNOTSUPP): the run goes on unguarded, and says so."""
    from hp_runtime.train import dirlock

    def no_locks(fd: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(dirlock, "_lock", no_locks)
    run = tmp_path / "run"
    done = ok(run, *STEPS)
    assert (
        f"hp-train: warning: {run / LOCK}: this filesystem cannot lock files "
        f"({os.strerror(errno.ENOLCK)}); nothing stops a second job" in done.stdout
    )
    assert records(run, "end")[-1]["status"] == "completed"
    assert not (run / LOCK).exists()


@pytest.mark.parametrize("command", ["replay", "verify", "train"])
def test_every_command_that_writes_there_is_refused_while_a_job_holds_it(tmp_path, command):
    """The holder is this test process, with a save in progress; the refused command writes
    nothing: no replay-* or verify-* directory, no config, no log, no cleaning up."""
    from hp_runtime.train.dirlock import DirLock

    run = tmp_path / "run"
    ok(run, "train.steps=2", "checkpoint.interval=2")
    saving = run / "checkpoints" / ".tmp-step-0000004"  # what a start would remove as stale
    saving.mkdir()
    (saving / "__0_0.distcp").write_bytes(os.urandom(64))
    before = _tree(run)
    with DirLock(str(run / LOCK)) as lock:
        assert lock.take() is None
        args = {
            "replay": ["replay", run, "--step", "2"],
            "verify": ["verify", *TINY, f"train.run_dir={run}"],
            "train": [*TINY, f"train.run_dir={run}", "train.steps=4"],
        }[command]
        done = hp_train_here(*args)
        assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr
        _refused_by(done.stderr.strip(), run, os.getpid())
        assert _tree(run) == {**before, LOCK: (run / LOCK).read_bytes()}
    assert _tree(run) == before


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_lock_path_that_is_not_a_lock_file_is_refused_untouched(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    mine = tmp_path / "mine.txt"
    mine.write_text("my notes\n")
    if kind == "symlink":
        (run / LOCK).symlink_to(mine)
    else:
        (run / LOCK).mkdir()
    line = refused(run, "train.steps=2")
    what = "a symbolic link" if kind == "symlink" else "a directory"
    assert line == (
        f"hp-train: error: {run / LOCK}: is {what}, not hp-train's lock file; move it aside"
    )
    assert mine.read_text() == "my notes\n"
    assert sorted(p.name for p in run.iterdir()) == [LOCK]


def test_a_second_export_into_one_directory_is_refused(tmp_path, tiny_run):
    """Another export (held here, by this process) is writing DIR: the second refuses in one
    line naming it, and leaves nothing beside DIR; once it is let go, the export works."""
    from hp_runtime.train.dirlock import DirLock

    checkpoint = tiny_run / "checkpoints" / "step-0000003"
    out = tmp_path / "hf"
    lock = tmp_path / ".hf.export-lock"
    with DirLock(str(lock)) as held:
        assert held.take() is None
        done = hp_train_here("export", checkpoint, "--out", out)
        assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
        line = done.stderr.strip()
        assert line.startswith(f"hp-train: error: --out {out}: another hp-train export is writing")
        assert re.search(HOLDER, line)[1] == str(os.getpid()), line
        assert sorted(os.listdir(tmp_path)) == [lock.name]  # no DIR, no hidden staging
    done = hp_train_here("export", checkpoint, "--out", out)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # the lock file goes with the export
