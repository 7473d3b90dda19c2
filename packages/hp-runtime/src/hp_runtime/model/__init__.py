"""The Llama-style model, free of parallelism."""

from hp_runtime.model.config import PRESETS, ModelConfig, RopeScaling, preset
from hp_runtime.model.llama import Transformer, initial_tensor

__all__ = ["PRESETS", "ModelConfig", "RopeScaling", "Transformer", "initial_tensor", "preset"]
