"""`hp-train plot RUN_DIR`: loss (train and validation), learning rate, tokens/s and gradient
norm from `RUN_DIR/metrics.jsonl`, drawn into `RUN_DIR/metrics.png` (needs matplotlib: the
`hp-runtime[plot]` extra)."""

from __future__ import annotations

import json
import os
from typing import Any

from hp_runtime.train.launch import TrainError


def read_records(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    records = []
    try:
        with open(path, encoding="utf-8") as stream:
            for number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise TrainError(f"{path}:{number}: not a JSON record") from None
    except FileNotFoundError:
        raise TrainError(f"{path}: no such file; is {run_dir} a hp-train run directory?") from None
    return records


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Draw the run's curves; returns the PNG's path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TrainError("plotting needs matplotlib: pip install 'hp-runtime[plot]'") from None
    records = read_records(run_dir)
    train = [r for r in records if r.get("kind", "train") == "train" and "loss" in r]
    valid = [r for r in records if "val_loss" in r]
    if not train:
        raise TrainError(f"{run_dir}/metrics.jsonl: no training steps logged yet")
    steps = [r["step"] for r in train]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [
        (axes[0][0], "loss", "loss"),
        (axes[0][1], "lr", "learning rate"),
        (axes[1][0], "tokens_per_s", "tokens/s"),
        (axes[1][1], "grad_norm", "gradient norm"),
    ]
    for axis, key, title in panels:
        axis.plot(steps, [r[key] for r in train], label="train" if key == "loss" else None)
        axis.set_title(title)
        axis.grid(alpha=0.3)
    if valid:
        axes[0][0].plot(
            [r["step"] for r in valid], [r["val_loss"] for r in valid], "o-", label="validation"
        )
    axes[0][0].legend()
    for axis in axes[1]:
        axis.set_xlabel("step")
    figure.suptitle(os.path.abspath(run_dir))
    figure.tight_layout()
    out = out or os.path.join(run_dir, "metrics.png")
    tmp = out + ".tmp.png"
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    os.replace(tmp, out)
    return out
