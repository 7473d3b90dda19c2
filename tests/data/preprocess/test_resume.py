"""A run killed with SIGKILL and started again ends with the same bytes as one that was not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.run import HP_DATA, read_bytes, run_preprocess


@pytest.fixture
def shards(tmp_path, example_corpus) -> list[Path]:
    lines = example_corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    paths = []
    for i in range(6):
        path = tmp_path / "in" / f"shard{i}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            json.dumps({"text": f"shard {i}"}) + "\n" + "".join(lines[i * 300 :]), encoding="utf-8"
        )
        paths.append(path)
    return paths


def _start(inputs, out, tokenizer, workers: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            HP_DATA,
            "preprocess",
            *map(str, inputs),
            "--out",
            str(out),
            "--tokenizer",
            str(tokenizer),
            "--append-eod",
            "--dedup",
            "exact",
            "--workers",
            str(workers),
            "--quiet",
            "--json",
            "--chunk-mb",
            "0.05",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _kill_when(process: subprocess.Popen, ready, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "the run never reached the kill point"
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)  # the main process and its workers
    process.wait()


def _finished_shards(out: Path) -> int:
    manifest = out.parent / f".{out.name}.hp-preprocess" / "manifest.json"
    try:
        return len(json.loads(manifest.read_text())["shards"])
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_killed_run_resumes_at_the_first_unfinished_shard(
    tmp_path, shards, example_tokenizer, workers
):
    run_preprocess(
        shards, tmp_path / "reference", example_tokenizer, append_eod=True, dedup="exact"
    )
    out = tmp_path / "out"
    process = _start(shards, out, example_tokenizer, workers)
    _kill_when(process, lambda: _finished_shards(out) >= 2)
    assert process.returncode == -signal.SIGKILL
    assert not out.with_suffix(".bin").exists() and not out.with_suffix(".idx").exists()

    rerun = _start(shards, out, example_tokenizer, 3 - workers)  # any worker count
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["resumed_shards"] >= 2
    assert summary["shards"] == 6
    assert read_bytes(out, metadata=True) == read_bytes(tmp_path / "reference", metadata=True)
    sources = [
        (p.with_name(p.name + ".hp.sources")).read_bytes() for p in (out, tmp_path / "reference")
    ]
    assert sources[0] == sources[1]  # the resumed run's provenance is the uninterrupted one's
    assert sorted(os.listdir(tmp_path)) == [
        "in",
        "out.bin",
        "out.hp.json",
        "out.hp.sources",
        "out.idx",
        "reference.bin",
        "reference.hp.json",
        "reference.hp.sources",
        "reference.idx",
    ]


@pytest.mark.slow
def test_a_killed_run_over_one_file_resumes_from_its_last_finished_unit(
    tmp_path, example_corpus, example_tokenizer
):
    # Byte-range work units bring resume below file granularity (plan.py).
    run_preprocess(
        [example_corpus],
        tmp_path / "reference",
        example_tokenizer,
        append_eod=True,
        dedup="exact",
    )
    out = tmp_path / "out"
    process = _start([example_corpus], out, example_tokenizer, 1, "--unit-mb", "0.1")
    _kill_when(process, lambda: _finished_shards(out) >= 3)
    rerun = _start([example_corpus], out, example_tokenizer, 1, "--unit-mb", "0.1")
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["resumed_shards"] >= 3 and summary["shards"] > summary["resumed_shards"]
    assert read_bytes(out, metadata=True) == read_bytes(tmp_path / "reference", metadata=True)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 0.7])
def test_killed_at_any_moment_still_ends_identical(tmp_path, shards, example_tokenizer, delay):
    run_preprocess(
        shards, tmp_path / "reference", example_tokenizer, append_eod=True, dedup="exact"
    )
    out = tmp_path / "out"
    process = _start(shards, out, example_tokenizer, 2)
    started = time.monotonic()
    _kill_when(process, lambda: time.monotonic() - started > delay)
    rerun = _start(shards, out, example_tokenizer, 2)
    _, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    assert read_bytes(out, metadata=True) == read_bytes(tmp_path / "reference", metadata=True)


def test_changed_options_start_over(tmp_path, shards, example_tokenizer):
    out = tmp_path / "out"
    process = _start(shards, out, example_tokenizer, 1)
    _kill_when(process, lambda: _finished_shards(out) >= 1)
    # Without --append-eod the finished shards do not fit: nothing may be reused.
    summary = run_preprocess(shards, out, example_tokenizer, dedup="exact")
    assert summary.resumed_shards == 0
    run_preprocess(shards, tmp_path / "reference", example_tokenizer, dedup="exact")
    assert read_bytes(out, metadata=True) == read_bytes(tmp_path / "reference", metadata=True)
