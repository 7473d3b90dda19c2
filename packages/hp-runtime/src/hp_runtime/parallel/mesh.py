"""ParallelDims: the layout of ranks, checked, turned into a named DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hp_runtime.model.config import ModelConfig


@dataclass(frozen=True)
class ParallelDims:
    """Replicated data parallel, sharded data parallel, tensor parallel and pipeline degrees.

    `dp_replicate > 1` with `dp_shard > 1` is HSDP; `dp_shard > 1` alone is FSDP.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    def validate(self, world_size: int, model: ModelConfig | None = None) -> None:
        """Raise ValueError naming what does not fit."""
        for name in ("dp_replicate", "dp_shard", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.world_size != world_size:
            raise ValueError(
                f"dp_replicate*dp_shard*tp*pp = {self.dp_replicate}*{self.dp_shard}*{self.tp}*"
                f"{self.pp} = {self.world_size}, but the world size is {world_size}"
            )
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

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: dp_replicate * dp_shard."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """A mesh with dims named pp, dp_replicate, dp_shard, tp (sizes of 1 included)."""
        self.validate(world_size)
        names = ("pp", "dp_replicate", "dp_shard", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """dp_replicate x dp_shard of `mesh` as one 1-D mesh: the ranks that batches are split
    over and losses reduced over. It creates process groups, so every rank calls it once, at
    the same point; keep the result (torch deprecates slicing it back out of the root mesh)."""
    # The one private call: torch has no public way to flatten mesh dims yet.
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")
