"""hp-data: Megatron-format token files for LLM pre-training."""

from typing import Any

from hp_data.errors import HpDataError, IndexedDatasetError, PreprocessError
from hp_data.format import (
    IndexedDataset,
    IndexedDatasetBuilder,
    merge_datasets,
    optimal_dtype,
)
from hp_data.index import build_blending_indices, build_sample_index

__version__ = "0.1.0"

# The Python API of `hp-data preprocess`, imported on first use: the pipeline brings
# tokenizers and multiprocessing, which the other commands never need.
_PIPELINE = ("preprocess", "PreprocessOptions", "PreprocessSummary")


def __getattr__(name: str) -> Any:
    if name in _PIPELINE:
        from hp_data import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'hp_data' has no attribute {name!r}")


__all__ = [
    "HpDataError",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "PreprocessError",
    "PreprocessOptions",
    "PreprocessSummary",
    "__version__",
    "build_blending_indices",
    "build_sample_index",
    "merge_datasets",
    "optimal_dtype",
    "preprocess",
]
