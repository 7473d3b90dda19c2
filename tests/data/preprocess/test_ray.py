"""Shards as Ray tasks on a real local cluster (2 CPUs): the merged output is byte-identical
to a one-machine run, also when a worker process is killed in the middle of a task; a run
whose tasks no node can take ends in one line instead of waiting for ever; --quiet is quiet."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from hp_data import PreprocessError
from hp_data.on_ray import preprocess_on_ray
from hp_data.pipeline import PreprocessOptions

from tests.helpers.corpus_files import english_records, write_jsonl, write_parquet
from tests.helpers.run import cli, documented_json_keys, read_bytes, run_preprocess

ray = pytest.importorskip("ray")

OPTIONS = {"append_eod": True, "dedup": "exact", "unit_bytes": 40_000}
FLAGS = ("--append-eod", "--dedup", "exact", "--unit-mb", str(40_000 / (1 << 20)))  # the same


@pytest.fixture(scope="module")
def cluster() -> str:
    """A 2-CPU cluster; its address, for `hp-data preprocess --ray=ADDRESS`."""
    ray.init(num_cpus=2, log_to_driver=False, configure_logging=False)
    yield ray.get_runtime_context().gcs_address
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


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, corpus, example_tokenizer) -> tuple[bytes, ...]:
    """The bytes a one-machine run writes: what every Ray run must write."""
    out = tmp_path_factory.mktemp("one-machine") / "one"
    run_preprocess(corpus, out, example_tokenizer, **OPTIONS)
    return read_bytes(out, metadata=True)


def _on_ray(corpus, out, tokenizer, tasks: int) -> dict:
    options = PreprocessOptions(workers=1, num_shards=tasks, show_progress=False, **OPTIONS)
    return preprocess_on_ray([str(p) for p in corpus], str(out), str(tokenizer), options)


@pytest.mark.slow
def test_ray_tasks_merge_to_the_one_machine_bytes(
    cluster, tmp_path, corpus, example_tokenizer, one_machine
):
    report = _on_ray(corpus, tmp_path / "ray", example_tokenizer, tasks=5)
    assert report["tasks"] == 5 and report["duplicates_across_shards"] > 0
    assert set(report) == documented_json_keys()["hp-data preprocess --ray --json"]
    assert read_bytes(tmp_path / "ray", metadata=True) == one_machine


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
    cluster, tmp_path, corpus, example_tokenizer, one_machine
):
    """Through the command: Ray's notice of the death, which its driver prints on stdout,
    must not land in the --json object there."""
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_first_task, args=("_shard", killed, stop))
    killer.start()
    try:
        result = _cli_on_ray(corpus, tmp_path / "ray", example_tokenizer, f"--ray={cluster}",
                             "--num-shards", "3", "--workers", "1", *FLAGS, "--json")  # fmt: skip
    finally:
        stop.set()
        killer.join()
    assert killed, "no task was caught running"
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and json.loads(result.stdout)["tasks"] == 3
    assert read_bytes(tmp_path / "ray", metadata=True) == one_machine


def test_without_ray_the_flag_says_what_to_install(monkeypatch, tmp_path, corpus):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if hp-data[ray] were not installed
    with pytest.raises(PreprocessError, match=r"pip install 'hp-data\[ray\]'"):
        preprocess_on_ray([str(corpus[0])], str(tmp_path / "x"), "tok.json")


def _cli_on_ray(corpus, out, tokenizer, *flags: str, env=None):
    """`hp-data preprocess --ray...` in its own process, so that a hang fails the test."""
    return cli(
        "preprocess", *corpus, "--out", out, "--tokenizer", tokenizer, "--quiet",
        *flags, timeout=120, env=env,
    )  # fmt: skip


def test_workers_above_the_largest_node_are_refused_before_any_task(
    cluster, tmp_path, corpus, example_tokenizer
):
    result = _cli_on_ray(corpus, tmp_path / "x", example_tokenizer, f"--ray={cluster}",
                         "--workers", "3")  # fmt: skip
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    for part in ("--workers 3", "asks for 3 CPUs", "largest node has 2", "--workers 2 or fewer"):
        assert part in result.stderr
    assert not any(tmp_path.iterdir())


@pytest.fixture
def node_type_never_added(cluster):
    """What an autoscaler (v2, KubeRay) publishes in the cluster's store: it may add a node of
    8 CPUs. No autoscaler runs, so that node never comes."""
    from ray._raylet import GCS_AUTOSCALER_CLUSTER_CONFIG_KEY as KEY
    from ray._raylet import GCS_AUTOSCALER_STATE_NAMESPACE as NAMESPACE
    from ray.core.generated.autoscaler_pb2 import ClusterConfig
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    config = ClusterConfig()
    group = config.node_group_configs.add(name="big", max_count=1)
    group.resources["CPU"] = 8
    _internal_kv_put(KEY, config.SerializeToString(), namespace=NAMESPACE)
    yield
    _internal_kv_del(KEY, namespace=NAMESPACE)


def test_a_task_no_node_takes_stops_the_run_after_the_bound(
    cluster, node_type_never_added, tmp_path, corpus, example_tokenizer
):
    result = _cli_on_ray(corpus, tmp_path / "x", example_tokenizer, f"--ray={cluster}",
                         "--workers", "4", "--ray-schedule-timeout", "2")  # fmt: skip
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "none of the run's tasks could start for 2 s" in result.stderr
    assert "asks for 4 CPU(s)" in result.stderr and "--ray-schedule-timeout" in result.stderr
    assert not any(tmp_path.iterdir())


@ray.remote(num_cpus=2)
class _Busy:
    """Another job holding every CPU of the cluster."""

    def ready(self) -> bool:
        return True


@ray.remote(num_cpus=2)
def _on_every_cpu() -> None:
    """Runs once every CPU is free (and every task queued before it had its turn)."""
    time.sleep(1.0)


def test_a_run_on_a_busy_cluster_stops_and_cancels_its_tasks(
    cluster, tmp_path, corpus, example_tokenizer
):
    busy = _Busy.remote()
    ray.get(busy.ready.remote(), timeout=60)
    options = PreprocessOptions(workers=1, num_shards=2, show_progress=False, **OPTIONS)
    try:
        with pytest.raises(PreprocessError, match="none of the run's tasks could start for 1 s"):
            preprocess_on_ray(
                [str(p) for p in corpus], str(tmp_path / "x"), str(example_tokenizer),
                options, schedule_timeout=1,
            )  # fmt: skip
    finally:
        ray.kill(busy)
    # Once the CPUs are free, a task that was still queued would run and write its shard.
    ray.get(_on_every_cpu.remote(), timeout=60)
    time.sleep(1.0)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_quiet_prints_nothing_but_the_json(tmp_path, corpus, example_tokenizer, one_machine):
    """With a local cluster of its own, whose start prints Ray's token-authentication notice."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    result = _cli_on_ray(corpus, tmp_path / "ray", example_tokenizer, "--ray", "--workers", "1",
                         *FLAGS, "--json", env=env)  # fmt: skip
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.count("\n") == 1 and json.loads(result.stdout)["ok"] is True
    assert read_bytes(tmp_path / "ray", metadata=True) == one_machine


def test_an_address_nothing_answers_at_is_one_line(tmp_path, corpus, example_tokenizer):
    """Ray itself would retry it for about a quarter of an hour."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    result = _cli_on_ray(corpus, tmp_path / "x", example_tokenizer, f"--ray=127.0.0.1:{port}")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert f"--ray=127.0.0.1:{port}: cannot reach it" in result.stderr
    assert not any(tmp_path.iterdir())
