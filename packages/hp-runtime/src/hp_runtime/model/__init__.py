"""The Llama-style model, free of parallelism.

The names below are imported on first use (PEP 562): the trainer's config reads `ModelConfig`
and the presets, which need no torch, so a bad config is refused before torch loads.
"""

from typing import TYPE_CHECKING

from hp_runtime.lazy_names import lazy_names

if TYPE_CHECKING:
    from hp_runtime.model.config import ModelConfig, RopeScaling
    from hp_runtime.model.llama import Transformer, initial_tensor
    from hp_runtime.model.presets import PRESETS, preset

# Each public name and the module that defines it.
_HOMES = {
    "PRESETS": "hp_runtime.model.presets",
    "ModelConfig": "hp_runtime.model.config",
    "RopeScaling": "hp_runtime.model.config",
    "preset": "hp_runtime.model.presets",
    "Transformer": "hp_runtime.model.llama",
    "initial_tensor": "hp_runtime.model.llama",
}


lazy_names(__name__, _HOMES)


__all__ = ["PRESETS", "ModelConfig", "RopeScaling", "Transformer", "initial_tensor", "preset"]
