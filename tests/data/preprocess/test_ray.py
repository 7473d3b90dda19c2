"""Shards as Ray tasks on a real local cluster (2 CPUs): the merged output is byte-identical
to a one-machine run, also when a worker process is killed in the middle of a task."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from hp_data import PreprocessError
from hp_data.on_ray import preprocess_on_ray
from hp_data.pipeline import PreprocessOptions

from tests.helpers.corpus_files import english_records, write_jsonl, write_parquet
from tests.helpers.run import documented_json_keys, read_bytes, run_preprocess

ray = pytest.importorskip("ray")

OPTIONS = {"append_eod": True, "dedup": "exact", "unit_bytes": 40_000}


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, example_corpus) -> list[Path]:
    """A JSONL file cut in byte ranges, a small one, and Parquet, with records repeated."""
    root = tmp_path_factory.mktemp("ray-corpus")
    big = root / "big.jsonl"
    big.write_bytes(example_corpus.read_bytes()[:300_000].rsplit(b"\n", 1)[0] + b"\n")
    records = english_records(3, 200)
    return [
        big,
        write_jsonl(root / "small.jsonl", records),
        write_parquet(root / "t.parquet", records),
    ]


def _on_ray(corpus, out, tokenizer, tasks: int) -> dict:
    options = PreprocessOptions(workers=1, num_shards=tasks, show_progress=False, **OPTIONS)
    return preprocess_on_ray([str(p) for p in corpus], str(out), str(tokenizer), options)


@pytest.mark.slow
def test_ray_tasks_merge_to_the_one_machine_bytes(cluster, tmp_path, corpus, example_tokenizer):
    run_preprocess(corpus, tmp_path / "one", example_tokenizer, **OPTIONS)
    report = _on_ray(corpus, tmp_path / "ray", example_tokenizer, tasks=5)
    assert report["tasks"] == 5 and report["duplicates_across_shards"] > 0
    assert set(report) == documented_json_keys()["hp-data preprocess --ray --json"]
    assert read_bytes(tmp_path / "ray", metadata=True) == read_bytes(
        tmp_path / "one", metadata=True
    )


def _kill_first_task(name: str, killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the first process whose title says it runs the task `name` (Ray sets it)."""
    while not stop.is_set() and not killed:
        for pid in os.listdir("/proc"):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if pid.isdigit() and title.startswith(f"ray::{name}".encode()):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                return
        time.sleep(0.002)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_killed_mid_task_is_retried_to_the_same_bytes(
    cluster, tmp_path, corpus, example_tokenizer
):
    run_preprocess(corpus, tmp_path / "one", example_tokenizer, **OPTIONS)
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_first_task, args=("_shard", killed, stop))
    killer.start()
    try:
        _on_ray(corpus, tmp_path / "ray", example_tokenizer, tasks=3)
    finally:
        stop.set()
        killer.join()
    assert killed, "no task was caught running"
    assert read_bytes(tmp_path / "ray", metadata=True) == read_bytes(
        tmp_path / "one", metadata=True
    )


def test_without_ray_the_flag_says_what_to_install(monkeypatch, tmp_path, corpus):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if hp-data[ray] were not installed
    with pytest.raises(PreprocessError, match=r"pip install 'hp-data\[ray\]'"):
        preprocess_on_ray([str(corpus[0])], str(tmp_path / "x"), "tok.json")
