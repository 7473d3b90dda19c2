"""Parallelism plans, one file per dimension; `parallelize` applies them in order."""

from hp_runtime.parallel.mesh import ParallelDims
from hp_runtime.parallel.parallelize import parallelize

__all__ = ["ParallelDims", "parallelize"]
