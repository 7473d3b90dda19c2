"""Parallelism plans, one file per dimension; `parallelize` applies them in order and
`assemble` builds a rank's whole share of the model.

The names below are imported on first use (PEP 562): the trainer's config reads
`ParallelDims` and `ParallelOptions`, which need no torch. `assemble` is both a submodule and
a function; the package keeps the function under that name even after the submodule loads
(the import system would otherwise set the module there).
"""

from typing import TYPE_CHECKING

from hp_runtime.lazy_names import lazy_names

if TYPE_CHECKING:
    from hp_runtime.parallel.assemble import Assembly, assemble
    from hp_runtime.parallel.init import copy_full_, init_weights
    from hp_runtime.parallel.mesh import ParallelDims
    from hp_runtime.parallel.options import ParallelOptions
    from hp_runtime.parallel.parallelize import canonical_name, parallelize

# Each public name and the module that defines it.
_HOMES = {
    "Assembly": "hp_runtime.parallel.assemble",
    "assemble": "hp_runtime.parallel.assemble",
    "copy_full_": "hp_runtime.parallel.init",
    "init_weights": "hp_runtime.parallel.init",
    "ParallelDims": "hp_runtime.parallel.mesh",
    "ParallelOptions": "hp_runtime.parallel.options",
    "canonical_name": "hp_runtime.parallel.parallelize",
    "parallelize": "hp_runtime.parallel.parallelize",
}


lazy_names(__name__, _HOMES)

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
