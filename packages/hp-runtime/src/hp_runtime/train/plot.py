"""`hp-train plot RUN_DIR`: loss (train and validation), learning rate, tokens/s and gradient
norm from `RUN_DIR/metrics.jsonl`, for a MoE model the expert load of each layer (and the
auxiliary loss), and `[eval]`'s downstream results, drawn into `RUN_DIR/metrics.png` (needs
matplotlib: the `hp-runtime[plot]` extra)."""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

from hp_data.fs import AtomicFile, directory_problem, writable_dir_problem

from hp_runtime.train.errors import TrainError


def read_records(run_dir: str) -> list[dict[str, Any]]:
    """The records of `RUN_DIR/metrics.jsonl`. A last line without its newline that does not
    parse was cut by a kill while it was written (a resume drops it too) and is left out; a
    bad line anywhere else is an error naming it."""
    problem = directory_problem(run_dir)
    if problem is not None:
        raise TrainError(f"{problem}; give a hp-train run directory")
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8", errors="replace") as stream:
            lines = stream.readlines()
    except FileNotFoundError:
        raise TrainError(f"{path}: no such file; is {run_dir} a hp-train run directory?") from None
    except OSError as exc:
        raise TrainError(f"{path}: cannot be read ({exc.strerror})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                break  # cut by a kill mid-write
            raise TrainError(f"{path}:{number}: not a JSON record") from None
        if not isinstance(record, dict):
            raise TrainError(f"{path}:{number}: not a JSON record")
        records.append(record)
    return records


def _number(value: Any) -> float:
    """A logged value, or NaN (a gap in the curve) where there is none."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return math.nan


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: str) -> bool:
    """Whether `path` is a regular file that starts as a PNG does (never opens a FIFO or a
    device, which could block or be something of the user's)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as stream:
            return stream.read(len(PNG_MAGIC)) == PNG_MAGIC
    except OSError:
        return False


def _check_out(out: str, label: str) -> None:
    """The PNG's path must be a file in a writable directory, and what is there already a PNG
    (a previous plot, replaced): anything else is the user's and is never overwritten.
    Checked before drawing."""
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise TrainError(f"{label}: is a directory; give a file path such as {out}/loss.png")
    if os.path.lexists(out) and not _is_png(out):
        raise TrainError(
            f"{label}: exists and is not a PNG; give a new file path (only a PNG is replaced)"
        )
    problem = writable_dir_problem(parent)
    if problem is not None:
        raise TrainError(f"{label}: {problem}")


def _write_png(figure: Any, out: str, label: str) -> None:
    """Through a temporary file of a unique name beside `out`, then one rename (`AtomicFile`)."""
    directory = os.path.dirname(os.path.abspath(out))
    try:
        atomic = AtomicFile(out)
    except OSError as exc:
        raise TrainError(f"{label}: cannot write in {directory} ({exc.strerror})") from None
    try:
        with atomic:
            figure.savefig(atomic.file, dpi=100, format="png")
    except OSError as exc:
        raise TrainError(f"{label}: cannot be written ({exc.strerror})") from None


def _moe_panels(axes: Any, steps: list[Any], train: list[dict[str, Any]]) -> None:
    """The expert load, max / mean tokens per expert, one line a MoE layer (the worst bold),
    and beside it the auxiliary loss where the run logged one."""
    load, aux = axes
    ratios = [r.get("moe_load_max_over_mean") for r in train]
    layers = max((len(r) for r in ratios if isinstance(r, list)), default=0)
    for layer in range(layers):
        values = [
            _number(r[layer]) if isinstance(r, list) and layer < len(r) else math.nan
            for r in ratios
        ]
        load.plot(steps, values, linewidth=0.8, alpha=0.6)
    worst = [_number(r.get("moe_load_max_over_mean_worst")) for r in train]
    load.plot(steps, worst, color="black", linewidth=1.6, label="worst layer")
    load.axhline(1.0, color="gray", linestyle=":", linewidth=0.8)  # an even load
    load.set_title("expert load: max / mean tokens per expert, each MoE layer")
    load.legend()
    load.grid(alpha=0.3)
    if any("moe_aux_loss" in r for r in train):
        aux.plot(steps, [_number(r.get("moe_aux_loss")) for r in train])
        aux.set_title("MoE auxiliary loss (mean over layers)")
        aux.grid(alpha=0.3)
    else:  # bias balancing: no auxiliary loss
        aux.set_axis_off()


def _downstream_panel(axes: Any, downstream: list[dict[str, Any]]) -> None:
    """`[eval]`'s results: one line a task's metric (`eval/TASK/METRIC`), against the step."""
    curves, other = axes
    steps = [r["step"] for r in downstream]
    names = sorted({k for r in downstream for k in r if k.startswith("eval/")})
    for name in names:
        curves.plot(steps, [_number(r.get(name)) for r in downstream], "o-", label=name[5:])
    curves.set_title("downstream tasks (lm-eval)")
    curves.legend(fontsize="small")
    curves.grid(alpha=0.3)
    other.set_axis_off()


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Draw the run's curves; returns the PNG's path. Only `out` (default
    RUN_DIR/metrics.png) is written, through a hidden temporary file of a unique name."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TrainError("plotting needs matplotlib: pip install 'hp-runtime[plot]'") from None
    records = read_records(run_dir)
    label = f"--out {out}" if out else os.path.join(run_dir, "metrics.png")
    out = out or os.path.join(run_dir, "metrics.png")
    _check_out(out, label)
    train = [
        r
        for r in records
        if r.get("kind", "train") == "train"
        and "loss" in r
        and not math.isnan(_number(r.get("step")))
    ]
    valid = [r for r in records if "val_loss" in r and not math.isnan(_number(r.get("step")))]
    if not train:
        raise TrainError(f"{run_dir}/metrics.jsonl: no training steps logged yet")
    steps = [r["step"] for r in train]
    moe = any("moe_load_max_over_mean" in r for r in train)
    downstream = [
        r for r in records
        if r.get("kind") == "downstream" and not math.isnan(_number(r.get("step")))
    ]  # fmt: skip
    rows = 2 + moe + bool(downstream)
    figure, axes = plt.subplots(rows, 2, figsize=(11, 3.5 * rows), sharex=True)
    panels = [
        (axes[0][0], "loss", "loss"),
        (axes[0][1], "lr", "learning rate"),
        (axes[1][0], "tokens_per_s", "tokens/s"),
        (axes[1][1], "grad_norm", "gradient norm"),
    ]
    for axis, key, title in panels:
        values = [_number(r.get(key)) for r in train]
        axis.plot(steps, values, label="train" if key == "loss" else None)
        axis.set_title(title)
        axis.grid(alpha=0.3)
    if valid:
        axes[0][0].plot(
            [r["step"] for r in valid], [_number(r["val_loss"]) for r in valid], "o-",
            label="validation",
        )  # fmt: skip
    axes[0][0].legend()
    if moe:
        _moe_panels(axes[2], steps, train)
    if downstream:
        _downstream_panel(axes[-1], downstream)
    for axis in axes[-1]:
        axis.set_xlabel("step")
    figure.suptitle(os.path.abspath(run_dir))
    figure.tight_layout()
    try:
        _write_png(figure, out, label)
    finally:
        plt.close(figure)
    return out
