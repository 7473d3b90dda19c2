"""ParallelOptions: how each parallel dimension is applied, beyond its degree (`ParallelDims`).

Its fields are the trainer's `[parallel]` keys themselves: the trainer's config section *is*
`ParallelDims` and `ParallelOptions` together (`hp_runtime.train.config.ParallelConfig`), so a
knob is added here, used in `parallelize` or `assemble`, and documented, and nothing copies it
on the way. Plain values only (no torch types): the config reads and writes them as TOML.

`Float8` is `train.float8`'s table: which linears run in float8 and how (`float8.py` applies
it, first in `parallelize`). `FaultTolerance` is `parallel.fault_tolerance`'s: replica groups
(torchft) across which the gradients are averaged, one torchrun job each (`train/replicas.py`).
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
    # Replica groups that drop out and heal without a restart (torchft); none: one job.
    fault_tolerance: FaultTolerance | None = None


@dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    """`parallel.fault_tolerance = {replica_group, groups, lighthouse, min_replicas,
    quorum_timeout_s}`: this job is replica group `replica_group` of `groups`, each one
    torchrun job holding a whole copy of the model (its own dp_shard x tp inside). Across the
    groups the gradients are averaged through torchft's managed process group; the groups in
    each step's quorum are the lighthouse's (`lighthouse`: its URL; none: $TORCHFT_LIGHTHOUSE)
    answer. A step commits with at least `min_replicas` groups; a quorum that cannot form in
    `quorum_timeout_s` stops the job in one line. Group g trains the same share of every
    step's global batch (data-parallel ranks g x dp .. (g + 1) x dp - 1); a group missing
    from a step's quorum leaves its share untrained, recorded (`train/replicas.py`)."""

    replica_group: int = 0
    groups: int = 2
    lighthouse: str | None = None
    min_replicas: int = 1
    quorum_timeout_s: float = 60.0


Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"]
# Each recipe's matmuls take dims that are multiples of this: torch._scaled_mm's rule for
# float8 operands (16); MX formats scale blocks of 32 values.
MULTIPLE = {"tensorwise": 16, "rowwise": 16, "rowwise_with_gw_hp": 16, "mxfp8": 32}


@dataclass(frozen=True, kw_only=True)
class Float8:
    """`train.float8 = {recipe, fsdp_all_gather, round_scales_to_power_of_2, skip}`.

    `recipe`: torchao's recipe name: `tensorwise` (one scale a tensor, the fastest),
    `rowwise` (one scale a row: more accurate, a little slower), `rowwise_with_gw_hp` (rowwise
    with the weight gradient in high precision), `mxfp8` (a scale per 32 values; Blackwell).
    `fsdp_all_gather`: FSDP gathers the converted weights in float8 (half bf16's traffic), their
    scales precomputed after each optimizer step; tensorwise only, and only with FSDP.
    `round_scales_to_power_of_2`: each scale rounded down to a power of two (None: the
    recipe's choice, which is true for the rowwise ones), so scaling is exact in binary and a
    layout's other order of partial sums cannot move a value across a float8 rounding; not
    with `fsdp_all_gather`, whose precomputed scales torchao does not round.
    `skip`: module-name patterns (`fnmatch`; a pattern also matches a name's last parts, so
    `"wo"` is every block's `attention.wo`) whose linears stay in high precision too."""

    recipe: Recipe = "tensorwise"
    fsdp_all_gather: bool = False
    round_scales_to_power_of_2: bool | None = None
    skip: tuple[str, ...] = ()
