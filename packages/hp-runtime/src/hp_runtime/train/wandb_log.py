"""Weights & Biases: the same train and validation fields as `metrics.jsonl`, by step.

Rank 0 only. The W&B run's id is kept in `RUN_DIR/wandb/hp-run-id`, so that a resumed run
continues the same W&B run (its curves do not split at every restart). `mode = "offline"`
writes under `RUN_DIR/wandb/` for `wandb sync` later: no network, no account needed.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from hp_data.fs import write_text

from hp_runtime.train.config import WandbConfig

LOGGED = ("train", "validation", "downstream")  # metrics.jsonl's kinds that are curves


class WandbLog:
    def __init__(self, config: WandbConfig, run_dir: str, settings: dict[str, Any]) -> None:
        import wandb  # hp-runtime[wandb]; MetricsLog says so when it is missing

        directory = os.path.join(run_dir, "wandb")
        os.makedirs(directory, exist_ok=True)
        id_path = os.path.join(directory, "hp-run-id")
        if os.path.exists(id_path):
            with open(id_path) as handle:
                run_id = handle.read().strip()
        else:
            run_id = secrets.token_hex(8)  # W&B ids: letters and digits
            write_text(id_path, run_id)
        self._run = wandb.init(
            project=config.project,
            name=config.name or os.path.basename(os.path.abspath(run_dir)),
            mode=config.mode,
            dir=run_dir,
            id=run_id,
            resume="allow",
            config=settings,
        )

    def log(self, record: dict[str, Any]) -> None:
        if record.get("kind") not in LOGGED:
            return
        values = {
            key: value
            for key, value in record.items()
            if key not in ("kind", "step") and isinstance(value, int | float)
            and not isinstance(value, bool)
        }  # fmt: skip
        for key, value in record.items():  # per-layer lists as one curve a layer
            if isinstance(value, list) and all(isinstance(v, int | float) for v in value):
                values.update({f"{key}/{i}": v for i, v in enumerate(value)})
        self._run.log(values, step=record["step"])

    def close(self) -> None:
        """Finish the W&B run and stop wandb's service, which writes the run file: only then
        is every record in it (an offline run read at once may miss its last ones)."""
        import wandb

        self._run.finish()
        wandb.teardown()
