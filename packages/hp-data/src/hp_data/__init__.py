"""hp-data: Megatron-format token files for LLM pre-training."""

from typing import Any

from hp_data.dataset import IndexedDataset
from hp_data.errors import HpDataError, IndexedDatasetError, PreprocessError
from hp_data.format import IndexedDatasetBuilder, optimal_dtype
from hp_data.index import build_blending_indices, build_sample_index
from hp_data.merge import merge_datasets
from hp_data.version import __version__

# The Python API of `hp-data preprocess`, imported on first use: the pipeline brings
# tokenizers and multiprocessing, which the other commands never need.
_PIPELINE = ("preprocess", "PreprocessOptions", "PreprocessSummary")
# Data-mixture phases, likewise on first use (they bring the GPT and blend modules).
_PHASES = ("Phase", "PhasedDataset", "build_phased", "plan_phases")


def __getattr__(name: str) -> Any:
    if name in _PIPELINE:
        from hp_data import pipeline

        return getattr(pipeline, name)
    if name in _PHASES:
        from hp_data import phases

        return getattr(phases, name)
    if name == "mix_report":
        from hp_data.phase_report import mix_report

        return mix_report
    raise AttributeError(f"module 'hp_data' has no attribute {name!r}")


__all__ = [
    "HpDataError",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "Phase",
    "PhasedDataset",
    "PreprocessError",
    "PreprocessOptions",
    "PreprocessSummary",
    "__version__",
    "build_blending_indices",
    "build_phased",
    "build_sample_index",
    "merge_datasets",
    "mix_report",
    "optimal_dtype",
    "plan_phases",
    "preprocess",
]
