"""The trainer: config → assembly + data → loop → metrics (`hp-train`).

The names below are imported on first use (PEP 562): `hp-train --help`, `hp-train plot` and a
submodule import (`from hp_runtime.train import rng`) need none of the loop's torch.distributed,
tokenizers or multiprocessing.
"""

from typing import TYPE_CHECKING

from hp_runtime.lazy_names import lazy_names

if TYPE_CHECKING:
    from hp_runtime.train.config import Config, load_config
    from hp_runtime.train.errors import ConfigError
    from hp_runtime.train.loop import RunResult, train

# Each public name and the module that defines it.
_HOMES = {
    "Config": "hp_runtime.train.config",
    "ConfigError": "hp_runtime.train.errors",
    "load_config": "hp_runtime.train.config",
    "RunResult": "hp_runtime.train.loop",
    "train": "hp_runtime.train.loop",
}


lazy_names(__name__, _HOMES)


__all__ = ["Config", "ConfigError", "RunResult", "load_config", "train"]
