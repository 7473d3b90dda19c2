"""Fixtures shared by every test: the repo's paths and the shipped example."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# One thread per process keeps CPU tests fast on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def example_corpus() -> Path:
    return REPO / "examples" / "docstrings.jsonl"


@pytest.fixture(scope="session")
def example_tokenizer() -> Path:
    return REPO / "examples" / "tokenizer.json"
