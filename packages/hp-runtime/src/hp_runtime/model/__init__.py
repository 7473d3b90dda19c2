"""The Llama-style model, free of parallelism."""

from hp_runtime.model.config import PRESETS, ModelConfig, preset
from hp_runtime.model.llama import Transformer, canonical_name, init_weights

__all__ = ["PRESETS", "ModelConfig", "Transformer", "canonical_name", "init_weights", "preset"]
