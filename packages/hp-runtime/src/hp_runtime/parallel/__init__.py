"""Parallelism plans, one file per dimension; `parallelize` applies them in order and
`assemble` builds a rank's whole share of the model."""

from hp_runtime.parallel.assemble import Assembly, assemble
from hp_runtime.parallel.init import copy_full_, init_weights
from hp_runtime.parallel.mesh import ParallelDims
from hp_runtime.parallel.options import ParallelOptions
from hp_runtime.parallel.parallelize import canonical_name, parallelize

__all__ = [
    "Assembly",
    "ParallelDims",
    "ParallelOptions",
    "assemble",
    "canonical_name",
    "copy_full_",
    "init_weights",
    "parallelize",
]
