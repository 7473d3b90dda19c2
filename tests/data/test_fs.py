"""hp_data.fs: atomic writes under unique temporary names, and the writable-directory check."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest
from hp_data import fs

SIZE = 1 << 20  # big enough that two writers of one file would interleave


def _write_many(path: str, byte: int, times: int) -> None:
    for _ in range(times):
        fs.write_bytes(path, bytes([byte]) * SIZE, durable=False)


def _whole(path: str) -> bool:
    data = Path(path).read_bytes()
    return len(data) == SIZE and data == data[:1] * SIZE


def test_temporary_names_are_unique_and_recognised(tmp_path):
    target = str(tmp_path / "0000000003.chunk")
    names = {fs.temp_name(target) for _ in range(100)}
    assert len(names) == 100
    for name in names:
        assert os.path.dirname(name) == str(tmp_path)  # beside the target: one filesystem
        assert fs.is_temp(name) and fs.temp_target(name) == "0000000003.chunk"
    assert fs.temp_target("0000000003.chunk.tmp-1-1") == "0000000003.chunk"  # an older writer's
    assert not fs.is_temp("0000000003.chunk") and fs.temp_target("x.idx") is None
    assert fs.staging_name("step-0000004") == ".tmp-step-0000004"  # the name older runs left
    assert fs.is_staging(".tmp-step-0000004") and not fs.is_staging("step-0000004")
    assert not fs.is_temp(".tmp-step-0000004")


def test_writers_in_threads_never_collide(tmp_path):
    path = str(tmp_path / "out.bin")
    threads = [threading.Thread(target=_write_many, args=(path, byte, 5)) for byte in range(1, 9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _whole(path)
    assert os.listdir(tmp_path) == ["out.bin"]


def test_writers_in_processes_never_collide(tmp_path):
    path = str(tmp_path / "out.bin")
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_write_many, args=(path, byte, 5)) for byte in (1, 2, 3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert _whole(path)
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_failing_streaming_writer_leaves_nothing(tmp_path):
    path = tmp_path / "out.json"
    with pytest.raises(RuntimeError), fs.committing(str(path), "w") as stream:
        stream.write("half of it")
        raise RuntimeError("the writer failed")
    assert os.listdir(tmp_path) == []
    path.write_text("old")
    with pytest.raises(RuntimeError), fs.committing(str(path), "w") as stream:
        stream.write("half of it")
        raise RuntimeError("the writer failed")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]


def test_atomic_file_commits_or_discards(tmp_path):
    path = str(tmp_path / "out")
    kept = fs.AtomicFile(path)
    kept.file.write(b"kept")
    assert not os.path.exists(path)  # nothing at the final path until committed
    kept.commit()
    kept.discard()  # after a commit: nothing
    with fs.AtomicFile(path) as dropped:
        dropped.file.write(b"dropped")
        dropped.discard()
    assert Path(path).read_bytes() == b"kept"
    assert os.listdir(tmp_path) == ["out"]
    fs.write_json(path, {"a": 1}, indent=1)
    assert Path(path).read_text() == '{\n "a": 1\n}'
    fs.write_text(path, "text")
    assert Path(path).read_text() == "text"


def test_writable_dir_reasons(tmp_path):
    missing = tmp_path / "no"
    file = tmp_path / "file.txt"
    file.write_text("x")
    assert fs.writable_dir_problem(str(tmp_path)) is None
    assert fs.writable_dir_problem(str(missing)) == f"{missing} does not exist"
    assert fs.writable_dir_problem(str(missing), fix="create it") == (
        f"{missing} does not exist; create it"
    )
    assert fs.writable_dir_problem(str(file)) == f"{file} is not a directory"
    assert fs.directory_problem(str(file)) == f"{file} is not a directory"
    assert fs.can_write_in(str(missing / "made"))  # made, with its parent
    assert not fs.can_write_in(str(file / "x"))
    assert sorted(os.listdir(missing / "made")) == []  # the probe is gone


def test_a_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions do not bind")
        assert fs.writable_dir_problem(str(locked)) == (
            f"cannot write in {locked} (permission denied)"
        )
        assert not fs.can_write_in(str(locked))
        with pytest.raises(PermissionError):
            fs.write_bytes(str(locked / "x"), b"x")
    finally:
        locked.chmod(0o700)


def test_first_line():
    assert fs.first_line(ValueError("one\ntwo")) == "one"
    assert fs.first_line(ValueError("one\ntwo"), named=True) == "ValueError: one"
    assert fs.first_line(KeyError()) == "KeyError"


def test_an_output_directory_to_make_is_judged_by_the_nearest_one_that_stands(tmp_path):
    """`creatable_dir_problem`: a path to create below a directory is fine; a file where a
    parent should be, or a name longer than the file system takes, is named in one line."""
    from hp_data.fs import creatable_dir_problem

    assert creatable_dir_problem(str(tmp_path)) is None
    assert creatable_dir_problem(str(tmp_path / "a" / "b")) is None
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    assert creatable_dir_problem(str(blocker)) == "it is not a directory"
    assert creatable_dir_problem(str(blocker / "run"), lambda p: f"<{p}>") == (
        f"<{blocker}> is not a directory"
    )
    assert creatable_dir_problem(str(tmp_path / ("x" * 256))) == "the name is too long"
    assert blocker.read_text() == "mine"  # nothing of the user's touched
