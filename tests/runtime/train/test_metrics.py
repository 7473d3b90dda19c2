"""metrics.jsonl: the stable fields, full-precision losses, and MFU from an independent FLOP
count; no MFU for a device whose peak is unknown."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hp_runtime.model import Transformer, preset
from hp_runtime.train.metrics import peak_for_name

from tests.helpers.train import hp_train_here, records, train_ranks

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


def _plot(*args: object):
    from hp_runtime.train.cli import plot_command

    return CliRunner().invoke(plot_command, [str(a) for a in args])


def _copy_run(tiny_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tiny_run / "metrics.jsonl", run / "metrics.jsonl")
    return run


def test_plot_ignores_a_last_line_cut_by_a_kill(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    from hp_runtime.train.plot import read_records

    run = _copy_run(tiny_run, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) >= 4
    (run / "metrics.jsonl").write_text("".join(lines[:-1]) + lines[-1][:9])  # no newline
    assert read_records(str(run)) == [json.loads(line) for line in lines[:-1]]
    (run / "metrics.png.tmp.png").write_bytes(b"the user's")  # the name plot used to take
    done = _plot(run)
    assert done.exit_code == 0, done.stderr
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "metrics.png.tmp.png").read_bytes() == b"the user's"
    assert sorted(os.listdir(run)) == ["metrics.jsonl", "metrics.png", "metrics.png.tmp.png"]
    # a line cut anywhere else is damage, not a kill: refused by its number
    (run / "metrics.jsonl").write_text(lines[0] + lines[1][:9] + "\n" + "".join(lines[2:]))
    done = _plot(run)
    assert done.exit_code == 1
    assert done.stderr.splitlines() == [
        f"hp-train: error: {run / 'metrics.jsonl'}:2: not a JSON record"
    ]


def test_plot_replaces_only_a_png(tiny_run, tmp_path):
    """--out naming a file that is not a PNG (the run's metrics, a config, a file cut short of
    the PNG signature, a FIFO) is refused and left as it was; a previous plot is replaced."""
    pytest.importorskip("matplotlib")
    run = _copy_run(tiny_run, tmp_path)
    (tmp_path / "cfg.toml").write_text("[train]\nsteps = 3\n")
    (tmp_path / "short.png").write_bytes(b"\x89PNG\r\n\x1a")  # 7 of the 8 signature bytes
    os.mkfifo(tmp_path / "pipe.png")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for out in (run / "metrics.jsonl", tmp_path / "cfg.toml", tmp_path / "short.png",
                tmp_path / "pipe.png"):  # fmt: skip
        done = hp_train_here("plot", run, "--out", out)
        assert done.returncode == 1, out
        assert done.stderr.splitlines() == [
            f"hp-train: error: --out {out}: exists and is not a PNG; give a new file path "
            "(only a PNG is replaced)"
        ]
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    stale = b"\x89PNG\r\n\x1a\n" + b"an older plot"
    (tmp_path / "old.png").write_bytes(stale)
    (run / "metrics.png").write_bytes(stale)
    assert hp_train_here("plot", run, "--out", tmp_path / "old.png").returncode == 0
    assert hp_train_here("plot", run).returncode == 0  # the default path, rewritten each run
    for png in (tmp_path / "old.png", run / "metrics.png"):
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and data != stale


def test_plot_bad_targets_are_one_line(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    run = _copy_run(tiny_run, tmp_path)
    (tmp_path / "file.txt").write_text("a file")
    cases = [
        ([run, "--out", tmp_path], f"--out {tmp_path}: is a directory; give a file path such "
         f"as {tmp_path}/loss.png"),
        ([run, "--out", tmp_path / "no" / "x.png"], f"--out {tmp_path / 'no' / 'x.png'}: "
         f"{tmp_path / 'no'} does not exist"),
        ([run, "--out", tmp_path / "file.txt" / "x.png"],
         f"--out {tmp_path / 'file.txt' / 'x.png'}: {tmp_path / 'file.txt'} is not a directory"),
        ([tmp_path / "file.txt"], f"{tmp_path / 'file.txt'} is not a directory; give a hp-train "
         "run directory"),
        ([tmp_path / "none"], f"{tmp_path / 'none'} does not exist; give a hp-train run "
         "directory"),
    ]  # fmt: skip
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o555)
        out = tmp_path / "locked" / "x.png"
        cases.append(([run, "--out", out], f"--out {out}: cannot write in {out.parent} "
                      "(permission denied)"))  # fmt: skip
    before = sorted(tmp_path.rglob("*"))
    for args, message in cases:
        done = _plot(*args)
        assert done.exit_code == 1, args
        assert done.stderr.splitlines() == [f"hp-train: error: {message}"]
    assert sorted(tmp_path.rglob("*")) == before
