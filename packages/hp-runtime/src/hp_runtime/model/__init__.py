"""The Llama-style model, free of parallelism. Names are imported on first use (PEP 562):
the config and presets need no torch."""

from typing import TYPE_CHECKING

from hp_runtime.faces import lazy_names

if TYPE_CHECKING:
    from hp_runtime.model.config import PRESETS, ModelConfig, preset
    from hp_runtime.model.llama import Transformer, initial_tensor

_HOMES = {
    "PRESETS": "hp_runtime.model.config",
    "ModelConfig": "hp_runtime.model.config",
    "preset": "hp_runtime.model.config",
    "Transformer": "hp_runtime.model.llama",
    "initial_tensor": "hp_runtime.model.llama",
}
__getattr__ = lazy_names(__name__, _HOMES)

__all__ = ["PRESETS", "ModelConfig", "Transformer", "initial_tensor", "preset"]
