"""Megatron's IndexedDataset v1 format: dtypes, header, reader, builder, checks and merge."""

from hp_data.format.builder import IndexedDatasetBuilder
from hp_data.format.dtypes import DTYPE_CODES, optimal_dtype
from hp_data.format.header import bin_path, idx_path, prefix_of
from hp_data.format.merge import expand_prefixes, merge_datasets
from hp_data.format.reader import IndexedDataset

__all__ = [
    "DTYPE_CODES",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "bin_path",
    "expand_prefixes",
    "idx_path",
    "merge_datasets",
    "optimal_dtype",
    "prefix_of",
]
