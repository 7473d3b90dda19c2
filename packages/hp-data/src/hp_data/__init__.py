"""hp-data: Megatron-format token files for LLM pre-training."""

from hp_data.errors import HpDataError, IndexedDatasetError, PreprocessError
from hp_data.format import (
    IndexedDataset,
    IndexedDatasetBuilder,
    merge_datasets,
    optimal_dtype,
)
from hp_data.index import build_blending_indices, build_sample_index

__version__ = "0.1.0"

__all__ = [
    "HpDataError",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "PreprocessError",
    "__version__",
    "build_blending_indices",
    "build_sample_index",
    "merge_datasets",
    "optimal_dtype",
]
