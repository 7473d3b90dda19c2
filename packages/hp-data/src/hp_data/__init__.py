"""hp-data: Megatron-format token files for LLM pre-training."""

from hp_data.errors import HpDataError, IndexedDatasetError, PreprocessError
from hp_data.format import (
    IndexedDataset,
    IndexedDatasetBuilder,
    merge_datasets,
    optimal_dtype,
)

__version__ = "0.1.0"

__all__ = [
    "HpDataError",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "PreprocessError",
    "__version__",
    "merge_datasets",
    "optimal_dtype",
]
