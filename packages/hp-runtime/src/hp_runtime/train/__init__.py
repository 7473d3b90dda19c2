"""The trainer: config → assembly + data → loop → metrics (`hp-train`)."""

from hp_runtime.train.config import Config, ConfigError, load_config
from hp_runtime.train.loop import RunResult, train

__all__ = ["Config", "ConfigError", "RunResult", "load_config", "train"]
