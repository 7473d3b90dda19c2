"""Corpora behind fsspec URLs: the same bytes, order and errors as local files, against
fsspec's own memory filesystem and a real S3-compatible server (moto) started here."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys

import fsspec
import pytest
from hp_data import PreprocessError
from hp_data.readers.discovery import discover
from hp_data.remote import _filesystem, identify

from tests.helpers.corpus_files import english_records, write_jsonl, write_parquet
from tests.helpers.run import cli, read_bytes, run_preprocess


@pytest.fixture
def local(tmp_path, example_corpus):
    """Three corpus files on disk: JSONL (big enough for byte ranges), gzip, Parquet."""
    root = tmp_path / "local"
    root.mkdir()
    (root / "a.jsonl").write_bytes(
        example_corpus.read_bytes()[:400_000].rsplit(b"\n", 1)[0] + b"\n"
    )
    records = english_records(7, 50)
    (root / "b.jsonl.gz").write_bytes(
        gzip.compress(write_jsonl(tmp_path / "b.jsonl", records).read_bytes())
    )
    write_parquet(root / "c.parquet", records)
    return root


def _copy(local, fs, root: str) -> None:
    for path in sorted(local.iterdir()):
        fs.pipe(f"{root}/{path.name}", path.read_bytes())


def test_memory_urls_read_as_the_local_files(tmp_path, local, example_tokenizer):
    fs = fsspec.filesystem("memory")
    _copy(local, fs, "/corpus")
    options = {"chunk_bytes": 50_000, "unit_bytes": 150_000, "append_eod": True}  # byte ranges
    run_preprocess([local], tmp_path / "disk", example_tokenizer, **options)
    # One worker: the memory filesystem lives in this process.
    summary = run_preprocess(["memory:///corpus/"], tmp_path / "mem", example_tokenizer, **options)
    assert read_bytes(tmp_path / "mem") == read_bytes(tmp_path / "disk")
    assert summary.shards == len(discover([str(local)])) + 2  # a.jsonl cut in three ranges
    globbed = discover(["memory:///corpus/*.jsonl*"])
    assert [s.path for s in globbed] == ["memory:///corpus/a.jsonl", "memory:///corpus/b.jsonl.gz"]
    fs.rm("/corpus", recursive=True)


def test_a_bad_line_is_named_by_its_url(tmp_path, example_tokenizer):
    fs = fsspec.filesystem("memory")
    fs.pipe("/bad/x.jsonl", b'{"text": "one"}\n{"text": "two"}\nnot json\n')
    with pytest.raises(PreprocessError, match=r"^memory:///bad/x\.jsonl:3: malformed JSON"):
        run_preprocess(["memory:///bad/x.jsonl"], tmp_path / "o", example_tokenizer)
    with pytest.raises(PreprocessError, match=r"^memory:///bad/none\.jsonl: no such file"):
        discover(["memory:///bad/none.jsonl"])
    with pytest.raises(PreprocessError, match=r"pattern matches no files"):
        discover(["memory:///bad/*.parquet"])
    fs.rm("/bad", recursive=True)
    assert not list(tmp_path.iterdir())


def test_without_fsspec_the_extra_is_named(monkeypatch):
    _filesystem.cache_clear()
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(PreprocessError, match=r"s3:// inputs need fsspec: .*hp-data\[remote\]"):
        discover(["s3://bucket/x.jsonl"])
    _filesystem.cache_clear()


@pytest.mark.slow
def test_s3_with_two_workers_equals_the_local_run(
    tmp_path, local, example_tokenizer, s3_server, monkeypatch
):
    env = {**os.environ, **s3_server}
    run_preprocess([local], tmp_path / "disk", example_tokenizer, append_eod=True)
    fs = fsspec.filesystem("s3", endpoint_url=s3_server["FSSPEC_S3_ENDPOINT_URL"], key="testing",
                           secret="testing", skip_instance_cache=True)  # fmt: skip
    fs.mkdir("corpus-bucket")
    _copy(local, fs, "corpus-bucket/in")
    result = cli(
        "preprocess", "s3://corpus-bucket/in/", "--out", tmp_path / "s3",
        "--tokenizer", example_tokenizer, "--append-eod", "--workers", "2", "--quiet",
        "--unit-mb", "0.1", env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert read_bytes(tmp_path / "s3") == read_bytes(tmp_path / "disk")

    # An object's identity (what a resumed run compares) changes with its contents.
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": fs.endpoint_url})
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    _filesystem.cache_clear()
    before = identify("s3://corpus-bucket/in/a.jsonl")
    assert identify("s3://corpus-bucket/in/a.jsonl") == before
    fs.pipe("corpus-bucket/in/a.jsonl", b'{"text": "changed"}\n')
    assert identify("s3://corpus-bucket/in/a.jsonl") != before
    _filesystem.cache_clear()

    missing = cli(
        "preprocess", "s3://corpus-bucket/in/none.jsonl", "--out", tmp_path / "x",
        "--tokenizer", example_tokenizer, "--quiet", env=env,
    )  # fmt: skip
    assert missing.returncode == 1
    assert missing.stderr == "Error: s3://corpus-bucket/in/none.jsonl: no such file or directory\n"


FORK_WHILE_HELD = """
import os, sys, threading
import fsspec.asyn
import hp_data.remote  # its after-fork hook
held, done = threading.Event(), threading.Event()
def hold():
    with fsspec.asyn.get_lock():  # as a thread does while it makes fsspec's event loop
        held.set()
        done.wait()
threading.Thread(target=hold, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:  # the child's first remote read makes its own loop
    fsspec.asyn.get_loop()
    os._exit(0)
for _ in range(300):  # 30 s
    finished, status = os.waitpid(pid, os.WNOHANG)
    if finished:
        sys.exit(os.waitstatus_to_exitcode(status))
    threading.Event().wait(0.1)
os.kill(pid, 9)
sys.exit("the forked child waited for its parent's fsspec lock")
"""


def test_a_child_forked_while_fsspecs_lock_is_held_makes_its_own_loop():
    """A DataLoader worker forked while another thread held fsspec's lock (fsspec's own
    after-fork hook leaves that lock as it was) must not wait for it forever."""
    done = subprocess.run([sys.executable, "-c", FORK_WHILE_HELD], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
