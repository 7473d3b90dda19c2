"""`hp-train eval CHECKPOINT --tasks ...`: a hp-train checkpoint (a directory, or a URL that
`checkpoint.dir` takes) on the layout the overrides give, its model's tensors alone read (no
optimizer state), lm-eval's tasks run on it (`train/downstream.py`), lm-eval's results JSON
written. Launched as a run is: torchrun with the layout's world size.

The config is the checkpoint's own (meta.json keeps it) with the overrides on top: the model
as it was trained, the layout, device and precision as the command line says.
"""

from __future__ import annotations

import json
import os
import tomllib
from typing import Any

from hp_data.fs import write_text

from hp_runtime.train.checkpoint_format import CheckpointError, read_meta
from hp_runtime.train.checkpoint_remote import opened
from hp_runtime.train.config import Config, config_with
from hp_runtime.train.errors import ConfigError, TrainError
from hp_runtime.train.launch import Runtime, agree


def stored_config(checkpoint: str, overrides: list[str]) -> Config:
    """The checkpoint's config, `overrides` on top (`parallel.tp=2`, `eval.tasks=[...]`)."""
    try:
        meta = read_meta(opened(checkpoint)[0])
        tree = tomllib.loads(meta["config"])
    except (CheckpointError, OSError) as exc:
        raise TrainError(f"{checkpoint}: {exc}") from None
    except (KeyError, TypeError, tomllib.TOMLDecodeError):
        raise TrainError(f"{checkpoint}/meta.json: holds no readable config") from None
    try:
        return config_with(tree, overrides)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc} (the config stored in {checkpoint}, with the overrides)"
        ) from None


def checkpoint_model(checkpoint: str, config: Config, runtime: Runtime) -> Any:
    """`checkpoint`'s model on `config`'s layout as lm-eval's model (`HpLM`): its model's
    tensors alone read, every file checked first."""
    import torch

    from hp_runtime.parallel import assemble
    from hp_runtime.train.checkpoint_load import load_model
    from hp_runtime.train.lm_eval_model import HpLM
    from hp_runtime.train.setup import precision

    param_dtype, autocast_dtype = precision(config, runtime.device)
    torch.manual_seed(config.train.seed)
    assembly = assemble(
        config.model,
        config.parallel,
        runtime.device,
        seed=config.train.seed,
        options=config.parallel,
        param_dtype=param_dtype,
        float8=config.train.float8,
    )
    failure = None
    try:
        local, listing = opened(checkpoint)
        load_model(local, assembly.modules, read_meta(local), config.model, listing)
    except CheckpointError as exc:
        failure = exc
    agree(failure, runtime)
    assembly.weights_changed()  # float8's all-gather scales, of the loaded weights
    return HpLM.of(assembly, autocast_dtype, config)


def evaluate_checkpoint(
    checkpoint: str, config: Config, runtime: Runtime, key: str, bootstrap_iters: int
) -> dict[str, Any]:
    """lm-eval's results of `config.eval.tasks` on `checkpoint`'s model, on every rank: the
    tasks loaded (and refused) before the model is built."""
    from hp_runtime.train.downstream import Tasks, run

    tasks = Tasks.agreed(config.eval.tasks, config.eval.include, key, runtime)
    lm = checkpoint_model(checkpoint, config, runtime)
    tasks.check_length(lm.max_length, key)
    return run(lm, tasks, config.eval.limit, bootstrap_iters, runtime.device)


def check_output(out: str) -> None:
    """`--output` can take a file: not a directory, its parent there."""
    if os.path.isdir(out):
        raise TrainError(f"--output {out}: is a directory; give the JSON file's path")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise TrainError(f"--output {out}: {parent} is not a directory")


def write_results(results: dict[str, Any], out: str) -> None:
    """lm-eval's results JSON at `out`, whole or not at all (written beside it, renamed)."""
    from lm_eval.utils import handle_non_serializable

    check_output(out)
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    try:
        write_text(out, text + "\n")
    except OSError as exc:
        raise TrainError(f"--output {out}: {exc.strerror or exc}") from None
