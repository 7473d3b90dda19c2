"""Parallelism plans, one file per dimension; `parallelize` applies them in order and
`assemble` builds a rank's whole share of the model."""

from hp_runtime.parallel.assemble import Assembly, ParallelOptions, assemble
from hp_runtime.parallel.mesh import ParallelDims
from hp_runtime.parallel.parallelize import parallelize

__all__ = ["Assembly", "ParallelDims", "ParallelOptions", "assemble", "parallelize"]
