"""Fixtures shared by every test: the repo's paths, the shipped example and a local S3 server."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# One thread per process keeps CPU tests fast on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Proven tokenizer recipes go to a directory of this test session's, not the user's cache
# (hp_data/recipe_cache.py); the processes a test starts inherit it.
os.environ["HP_DATA_TOKENIZER_CACHE"] = tempfile.mkdtemp(prefix="hp-test-recipes-")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def example_corpus() -> Path:
    return REPO / "examples" / "docstrings.jsonl"


@pytest.fixture(scope="session")
def example_tokenizer() -> Path:
    return REPO / "examples" / "tokenizer.json"


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free port of this machine; its address in fsspec's and boto's
    environment variables, which the hp-data processes started by a test inherit. moto keeps
    buckets per process, across servers: each test names buckets of its own."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}",
    }
    yield env
    server.stop()


# Files whose tests launch whole jobs (torchrun's ranks, a Ray cluster). On CI's two cores two of
# them side by side only slow each other down (a run measured them at up to three times their
# serial time), so xdist's scheduler takes them as one unit: one worker runs them one after
# another while the other takes the rest. Every other file is a unit of its own (loadfile).
LAUNCHERS = {
    "tests/data/preprocess/test_ray.py",
    "tests/runtime/train/test_checkpoint.py",
    "tests/runtime/train/test_cli.py",
    "tests/runtime/train/test_dirlock.py",
    "tests/runtime/train/test_run_safety.py",
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadFileScheduling

    class LaunchersTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "launchers" if scope in LAUNCHERS else scope

    return LaunchersTogether(config, log)
