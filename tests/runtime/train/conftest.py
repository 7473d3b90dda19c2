"""A tiny finished run shared by the tests that read a run's outputs (export, plot) rather
than train one of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.train import FAST, hp_train_here


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """3 steps of the tiny model with tied embeddings, a checkpoint at step 3. Read only:
    tests copy what they change."""
    run = tmp_path_factory.mktemp("tiny-run") / "run"
    done = hp_train_here(
        *FAST, "data.type=dummy", "data.seq_length=24", "model.max_seq_len=64",
        "model.tie_embeddings=true", "train.steps=3", "checkpoint.interval=3",
        f"train.run_dir={run}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return run
