"""tools/gpu/check.py, the prepared first-GPU-hour script, kept in working order on the CPU:
every part runs with tiny shapes and passes against its fp32 CPU reference (the compile parts
aside: 30 s of inductor on two cores; per-block compile is checked on CPU by test_parity's
fsdp2-compile layout), and one part's failure is reported while the others still run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu" / "check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_part_runs_on_the_cpu(tmp_path):
    out = tmp_path / "cpu.json"
    parts = [
        "fp32_fused_adamw", "bf16_autocast", "fsdp_world1_bf16", "activation_checkpointing",
        "document_masking", "chunked_loss", "muon", "speed_1b", "speed_8b_shaped",
        "float8_curve", "speed_8b_shaped_float8", "checkpoint_sync", "checkpoint_async",
        "downstream",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out),
         "--only", ",".join(parts)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["torch"]
    assert list(report["parts"]) == parts
    for name, part in report["parts"].items():
        assert part["ok"], (name, part)
    for name in [*parts[:6], "muon"]:  # each path against its own CPU fp32 run, not itself
        part = report["parts"][name]
        assert part["losses"] and len(part["losses"]) == len(part["reference_losses"])
        assert part["max_rel_error"] <= part["tolerance"]
    assert report["parts"]["fp32_fused_adamw"]["max_rel_error"] == 0.0  # the CPU is the CPU
    assert report["parts"]["speed_1b"]["tokens_per_s"] > 0
    curve = report["parts"]["float8_curve"]  # each recipe against bf16, and not bf16 itself
    assert set(curve["end_rel_errors"]) == {"tensorwise", "rowwise", "rowwise_with_gw_hp"}
    assert all(0 < error <= 1e-2 for error in curve["end_rel_errors"].values())
    saved = report["parts"]["checkpoint_async"]
    assert saved["resume_bit_identical"] and len(saved["save_seconds"]) == 2
    scored = report["parts"]["downstream"]  # the CPU against the CPU: the same numbers
    assert scored["fp32_max_rel_error"] == 0.0 and scored["fp32_greedy_agreement"] == 1.0
    assert f"{len(parts)} of {len(parts)} parts passed" in done.stdout


def test_a_failing_part_is_reported_and_the_others_run(tmp_path):
    check = _module()

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    failed = check.run_part("broken", broken, "cpu")
    assert failed["ok"] is False and failed["error"].startswith("RuntimeError: CUDA error")
    assert "\n" not in failed["error"] and "Traceback" in failed["traceback"]
    assert check.run_part("fine", lambda: {"ok": True}, "cpu")["ok"] is True


def test_an_unknown_part_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path / "x.json"),
         "--only", "bf16_autocas"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "--only bf16_autocas: choose from fp32_fused_adamw, bf16_autocast" in done.stderr
