"""ParallelOptions: how each parallel dimension is applied, beyond its degree (`ParallelDims`).

Its fields are the trainer's `[parallel]` keys themselves: the trainer's config section *is*
`ParallelDims` and `ParallelOptions` together (`hp_runtime.train.config.ParallelConfig`), so a
knob is added here, used in `parallelize` or `assemble`, and documented, and nothing copies it
on the way. Plain values only (no torch types): the config reads and writes them as TOML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    pp_schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = "1f1b"
    # Micro-batches per schedule step. None: one here; the trainer makes it all the
    # accumulation steps of an optimizer step.
    pp_microbatches: int | None = None
    pp_virtual_stages: int = 1
    tp_reduce_dtype: Literal["float32", "bfloat16"] | None = None  # see `tp.py`
    loss_parallel: bool = False
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    ac_every: int = 2
    compile: bool = False  # torch.compile each block
    # FSDP frees each block's gathered parameters after its forward ("always") or keeps them
    # for the backward ("never": one all-gather a step instead of two, more memory).
    fsdp_reshard_after_forward: Literal["always", "never"] = "always"
