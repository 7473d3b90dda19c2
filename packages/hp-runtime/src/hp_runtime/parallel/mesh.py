"""ParallelDims: the layout of ranks, checked, turned into a named DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from hp_runtime.model.config import ModelConfig

if TYPE_CHECKING:  # torch is imported where a mesh is built: the config needs only the dims
    from torch.distributed.device_mesh import DeviceMesh

# The mesh's dims, outermost first (torchtitan's order): a tensor-parallel group is the closest
# ranks (one node's), a pipeline's stages the farthest apart. Stable names.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
ORDER = ("dp_replicate", "dp_shard", "cp", "tp", "pp")  # as the degrees are written
# The same ranks with dp_shard split in two, (dp_shard / ep, ep): the mesh expert parameters
# live on (`ep.py`). Stable names.
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")


class LayoutProblem(NamedTuple):
    """A layout rule broken: the key at fault, and one line that names it (as the config
    spells it, `parallel.ep`) and says what to do. The config raises the line as its own
    error; `validate` as a ValueError."""

    key: str
    text: str


@dataclass(frozen=True)
class ParallelDims:
    """Replicated data parallel, sharded data parallel, context parallel, tensor parallel and
    pipeline degrees.

    `dp_replicate > 1` with `dp_shard > 1` is HSDP; `dp_shard > 1` alone is FSDP. `cp > 1`
    splits each sample's sequence over `cp` ranks, which read the same samples; FSDP shards
    the parameters over `dp_shard x cp` (torchtitan's `dp_shard_cp`).

    `ep > 1` shards the experts of a MoE model over groups of `ep` ranks carved out of
    `dp_shard` (as torchtitan's `expert_parallel_degree`): it adds no ranks. The expert
    weights are sharded by FSDP over the `dp_shard / ep` ranks left, dense weights over all.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # not a factor of the world: a split of dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def validate(self, world_size: int, model: ModelConfig | None = None) -> None:
        """Raise ValueError naming what does not fit."""
        for name in ORDER:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.world_size != world_size:
            product = "*".join(str(getattr(self, name)) for name in ORDER)
            raise ValueError(
                f"{'*'.join(ORDER)} = {product} = {self.world_size}, but the world size is "
                f"{world_size}"
            )
        problems = self.expert_problems(model)
        if problems:
            raise ValueError(problems[0].text)
        if model is None:
            return
        if model.n_heads % self.tp:
            raise ValueError(f"n_heads={model.n_heads} is not divisible by tp={self.tp}")
        if model.n_kv_heads % self.tp:
            raise ValueError(f"n_kv_heads={model.n_kv_heads} is not divisible by tp={self.tp}")
        if model.ffn_hidden % self.tp:
            raise ValueError(f"ffn_hidden={model.ffn_hidden} is not divisible by tp={self.tp}")
        if model.n_layers < self.pp:
            raise ValueError(f"n_layers={model.n_layers} is fewer than pp={self.pp} stages")

    def expert_problems(self, model: ModelConfig | None = None) -> list[LayoutProblem]:
        """The expert-parallel and MoE layout rules broken, first the one to fix first: their
        one home, which the config's check (at load, for every key) and `validate` (at the
        start, with the world size) both read. With `model` None (not known), only the rules
        of the layout alone."""
        ep, moe = self.ep, None if model is None else model.moe
        if ep < 1:  # before any rule divides by it
            return [LayoutProblem("parallel.ep", f"parallel.ep={ep} must be at least 1")]
        problems = []
        if model is not None and moe is None and ep > 1:
            text = (
                f"parallel.ep={ep} needs a MoE model: set model.moe (expert parallelism shards "
                "the experts), or parallel.ep = 1"
            )
            problems.append(LayoutProblem("parallel.ep", text))
        if moe is not None and moe.experts % ep:
            text = (
                f"model.moe.experts={moe.experts} is not divisible by parallel.ep={ep}: each "
                "expert-parallel rank holds the same number of experts"
            )
            problems.append(LayoutProblem("model.moe.experts", text))
        if self.dp_shard % ep:
            text = (
                f"parallel.ep={ep} does not divide parallel.dp_shard={self.dp_shard}: expert "
                "parallelism splits the sharded data-parallel ranks and adds none; make "
                f"parallel.dp_shard a multiple of {ep}"
            )
            problems.append(LayoutProblem("parallel.ep", text))
        if moe is not None and self.cp > 1:
            text = (
                f"model.moe with parallel.cp={self.cp} is not supported yet: train a MoE model "
                "with parallel.cp = 1"
            )
            problems.append(LayoutProblem("parallel.cp", text))
        return problems

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: dp_replicate * dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp_size(self) -> int:
        """Ranks a global batch's tokens are spread over, and FSDP averages gradients over:
        dp_replicate * dp_shard * cp."""
        return self.dp_size * self.cp

    def build_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """A mesh with dims named as `MESH_DIMS` (sizes of 1 included)."""
        self.validate(world_size)
        shape = tuple(getattr(self, name) for name in MESH_DIMS)
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)

    def build_expert_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """The ranks of `build_mesh` with dims named as `EXPERT_MESH_DIMS`: a rank's dp_shard
        index is `outer * ep + inner` (its dp_shard_mod_ep and ep indices), so an ep group is
        `ep` neighbouring dp_shard ranks (torchtitan's layout). It creates process groups:
        every rank builds it at the same point, and keeps it (FSDP and the expert weights'
        DTensors refer to it)."""
        self.validate(world_size)
        shape = (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp)
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)


def _flatten(mesh: DeviceMesh, names: tuple[str, ...], name: str) -> DeviceMesh:
    """Dims `names` of `mesh` as one 1-D mesh called `name`. It creates process groups, so
    every rank calls it at the same point (again, with the same names, it returns the same
    mesh); keep the result (torch deprecates slicing it back out of the root mesh)."""
    # Private: torch has no public way to flatten mesh dims yet.
    return mesh[names]._flatten(name)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """dp_replicate x dp_shard of `mesh` as one 1-D mesh, "dp": the ranks that batches are
    split over (the ranks of a context-parallel group share a place in it)."""
    return _flatten(mesh, ("dp_replicate", "dp_shard"), "dp")


def dp_cp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """dp_replicate x dp_shard x cp as one 1-D mesh, "dp_cp": the ranks a global batch's loss
    tokens are spread over (without context parallelism, the data-parallel mesh itself)."""
    if dims.cp == 1:
        return data_parallel_mesh(mesh)
    return _flatten(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards parameters over: dp_shard, times cp under context parallelism
    ("dp_shard_cp": the cp ranks' gradients are reduced too), with dp_replicate as the
    leading, replicated dim of HSDP."""
    if dims.cp == 1:
        return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    shard = _flatten(mesh, ("dp_shard", "cp"), "dp_shard_cp")
    if dims.dp_replicate == 1:
        return shard
    # (dp_replicate, dp_shard_cp) on the two meshes' own groups, as fully_shard builds an HSDP
    # mesh itself (private too; slicing a flattened dim out of the root mesh is deprecated).
    return type(mesh)._concatenate([mesh["dp_replicate"], shard])


def expert_fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards expert weights over, on the expert mesh: the dp_shard ranks an ep
    group leaves (dp_shard / ep of them, a 1-rank mesh when ep = dp_shard), with dp_replicate
    as the leading, replicated dim of HSDP. The ep ranks hold different experts already.
    (No cp: `validate` refuses MoE with it, whose ranks would join dp_shard_mod_ep.)"""
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard_mod_ep"]
    return mesh["dp_shard_mod_ep"]
