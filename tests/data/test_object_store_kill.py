"""A process killed (SIGKILL) in the middle of a chunk download: the next reader of the node
never reads the half chunk as data, downloads it again, and leaves no half-written file of
the dead one behind (it would never be evicted, and so outgrow data.remote_cache_gb)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from hp_data.gpt import GPTDataset, GPTDatasetConfig

from tests.helpers.fault_http import Faults, fault_server
from tests.helpers.object_store import CHUNK_MB, files_of, write_corpus

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 4 * CHUNK_MB  # 16 KiB chunks
# The killed reader: copies 512 bytes at a time, so that its temporary file is half written
# (past Python's 8 KiB write buffer) when the server stalls (the hook below) and the test
# kills it.
READER = """
import sys
from hp_data import object_store
from hp_data.gpt import GPTDataset, GPTDatasetConfig
object_store._COPY_BLOCK = 512
config = GPTDatasetConfig(seq_length=24, split="1,0,0", cache_dir=sys.argv[2],
                          remote_chunk_mb=float(sys.argv[3]))
GPTDataset(sys.argv[1], "train", None, config)[0]
"""


def _temporary(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*.chunk.tmp-*") if p.is_file()]


def test_a_reader_killed_mid_chunk_leaves_nothing_read_and_nothing_behind(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    prefix = write_corpus(tmp_path / "a", 5, count=400)  # three chunks
    for suffix, data in files_of(prefix).items():
        (served / f"a{suffix}").write_bytes(data)
    release, bin_gets = threading.Event(), []

    def stall(_number: int, method: str, path: str) -> None:
        if method == "GET" and path.endswith(".bin"):
            bin_gets.append(path)
            if len(bin_gets) > 20:  # 10 KiB of the first chunk, then no answer
                release.wait(30)

    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with fault_server(served, Faults(hook=stall)) as server:
        url = server.url("a")
        child = subprocess.Popen(
            [sys.executable, "-c", READER, url, str(cache), str(CHUNK)], cwd=ROOT, env=env
        )
        deadline = time.monotonic() + 30
        while not any(p.stat().st_size >= 8192 for p in _temporary(cache)):
            assert child.poll() is None and time.monotonic() < deadline, "no download began"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        release.set()
        server.faults.hook = None
        reference = GPTDataset(prefix, "train", None, GPTDatasetConfig(
            seq_length=24, split="1,0,0", cache_dir=str(tmp_path / "local")))  # fmt: skip
        again = GPTDataset(url, "train", None, GPTDatasetConfig(
            seq_length=24, split="1,0,0", cache_dir=str(cache), remote_chunk_mb=CHUNK))  # fmt: skip
        for i in range(len(reference)):
            np.testing.assert_array_equal(again[i]["tokens"], reference[i]["tokens"])
    assert _temporary(cache) == []
