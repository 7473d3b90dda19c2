"""A resume may change what computes the same numbers: the attention kernel
(`model.attention`) and the loss's chunking (`train.loss_chunk_tokens`); and a checkpoint
written before those keys (and `model.rope_scaling`) existed still resumes.

The reference is the run without the interruption: the resumed steps' losses and gradient
norms equal it within float noise (the kernels and the chunking sum in other orders)."""

from __future__ import annotations

import numpy as np
import pytest
from hp_runtime.train import storage

from tests.helpers.train import FAST, hp_train_here, records

# Packed documents (end-of-document id 3 of 16: about one token in sixteen) with masking, so
# that the kernel matters; SGD with momentum, so that the optimizer state moves too.
BASE = [
    *FAST, "data.type=dummy", "data.seq_length=32", "model.vocab_size=16", "data.eod_token=3",
    "data.reset_position_ids=true", "data.document_masking=true", "train.micro_batch_size=2",
    "train.global_batch_size=4", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0.9",
    "optim.warmup_steps=0", "optim.decay_style=constant", "train.eval_interval=0",
    "checkpoint.interval=3",
]  # fmt: skip
NEW_KEYS = ("attention", "rope_scaling", "loss_chunk_tokens", "attention_kind", "mla", "mtp")


def _run(run_dir, *overrides: str) -> list[tuple[float, float]]:
    done = hp_train_here(*BASE, f"train.run_dir={run_dir}", *overrides)
    assert done.returncode == 0, done.stderr
    return [(r["loss"], r["grad_norm"]) for r in records(run_dir)]


def _as_before_the_keys(checkpoint) -> None:
    """Rewrite a checkpoint's recorded config as an hp before NEW_KEYS wrote it."""
    path = str(checkpoint / "meta.json")
    meta = storage.read_json(path)
    lines = meta["config"].splitlines()
    kept = [line for line in lines if line.lstrip("# ").split(" ")[0] not in NEW_KEYS]
    assert len(kept) == len(lines) - len(NEW_KEYS)
    meta["config"] = "\n".join(kept) + "\n"
    storage.write_json(path, meta)


@pytest.mark.parametrize("old", [False, True], ids=["this-hp", "before-the-keys"])
def test_a_resume_may_change_the_kernel_and_the_chunking(tmp_path, old):
    first = ["model.attention=sdpa", "train.loss_chunk_tokens=0"]
    whole = _run(tmp_path / "whole", "train.steps=5", *first)
    run = tmp_path / "run"
    _run(run, "train.steps=3", *first)
    if old:
        _as_before_the_keys(run / "checkpoints" / "step-0000003")
    resumed = _run(run, "train.steps=5", "model.attention=segments", "train.loss_chunk_tokens=6")
    assert len(resumed) == len(whole) == 5
    np.testing.assert_allclose(resumed, whole, rtol=1e-5, atol=0)


def test_a_refused_resume_leaves_the_runs_own_config(tmp_path):
    """The run directory's config.toml says how its checkpoints were trained: a resume that
    is refused (another global batch) writes nothing over it."""
    run = tmp_path / "run"
    _run(run, "train.steps=3")
    before = (run / "config.toml").read_bytes()
    done = hp_train_here(*BASE, f"train.run_dir={run}", "train.steps=4",
                         "train.global_batch_size=8")  # fmt: skip
    assert done.returncode == 1 and "train.global_batch_size=8" in done.stderr, done.stderr
    assert (run / "config.toml").read_bytes() == before
