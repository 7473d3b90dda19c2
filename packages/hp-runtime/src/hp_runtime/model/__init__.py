"""The Llama-style model, free of parallelism."""

from hp_runtime.model.config import PRESETS, ModelConfig, preset
from hp_runtime.model.llama import Transformer, init_weights

__all__ = ["PRESETS", "ModelConfig", "Transformer", "init_weights", "preset"]
