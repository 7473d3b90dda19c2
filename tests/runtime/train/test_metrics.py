"""metrics.jsonl: the stable fields, full-precision losses, and MFU from an independent FLOP
count; no MFU for a device whose peak is unknown."""

from __future__ import annotations

import pytest
import torch
from hp_runtime.model import Transformer, preset
from hp_runtime.train.metrics import peak_for_name

from tests.helpers.train import records, train_ranks

FIELDS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "consumed_samples"}


def _flops_per_token(config, seq: int) -> int:
    """6 x the matmul parameters (all but the input embedding, counted from the real modules)
    plus attention's 12 x layers x dim x seq."""
    with torch.device("meta"):
        model = Transformer(config)
    matmul = sum(p.numel() for n, p in model.named_parameters() if n != "tok_embeddings.weight")
    return 6 * matmul + 12 * config.n_layers * config.dim * seq


@pytest.mark.slow
def test_jsonl_fields_and_mfu(tmp_path):
    run = tmp_path / "run"
    overrides = [
        "data.type=dummy",
        "data.seq_length=32",
        "train.steps=4",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.eval_interval=2",
        "train.eval_iters=1",
        "metrics.peak_tflops=0.5",
        f"train.run_dir={run}",
    ]
    result = train_ranks(1, overrides)[0]
    steps = records(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        assert set(record) >= FIELDS
        assert record["consumed_samples"] == 4 * record["step"]
        mfu = record["tokens_per_s_per_device"] * _flops_per_token(preset("tiny"), 32) / 0.5e12
        assert record["mfu"] == pytest.approx(mfu, rel=1e-9)
        assert 0 <= record["data_wait_pct"] <= 100 and record["peak_memory_gib"] > 0
    # every step's loss at full precision: the float the run computed, not a rounded print
    assert [r["loss"] for r in steps] == result["losses"]
    assert any(len(repr(r["loss"])) > 10 for r in steps)
    valid = records(run, "validation")
    assert [r["step"] for r in valid] == [2, 4] and all(r["val_loss"] > 0 for r in valid)
    assert records(run, "end")[0]["status"] == "completed"

    train_ranks(1, [*overrides[:-2], f"train.run_dir={tmp_path / 'cpu'}"])
    assert all(r["mfu"] is None for r in records(tmp_path / "cpu"))  # CPU: no known peak


def test_peak_table():
    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_for_name("NVIDIA H100 PCIe") == 756.0
    assert peak_for_name("NVIDIA H200") == 989.4
    assert peak_for_name("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_for_name("Tesla T4") is None
