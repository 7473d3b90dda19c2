"""Latent attention (MLA) trains like one process on every layout (CPU, gloo, real process
groups): ten SGD steps with clipping, losses and gradient norms within 1e-5 relative, final
parameters within 1e-5 (the rule `test_parity.py` states). YaRN's softmax factor is on, so the
scale every kernel is handed is exercised too; a MoE variant runs at ep 2."""

from __future__ import annotations

import pytest
from hp_runtime.model.config import MLAConfig, MoEConfig, RopeScaling

from tests.helpers.distributed import run_ranks
from tests.runtime.parallel.test_parity import _compare
from tests.runtime.parity import train

# q from a latent (wq_a, q_norm, wq_b), v wider than q·k's nope part, YaRN's mscale on
MLA = {
    "n_kv_heads": 4,
    "attention_kind": "mla",
    "mla": MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                     q_lora_rank=24),
    "rope_scaling": RopeScaling("yarn", 4.0, original_max_seq_len=8, mscale_all_dim=0.8),
}  # fmt: skip
# a full-rank query (wq), v narrower than q
FULL_Q = {**MLA, "mla": MLAConfig(16, 8, 4, 6)}
MOE = {
    **MLA,
    "moe": MoEConfig(8, 2, 16, shared_experts=1, router="sigmoid", route_scale=2.5,
                     first_dense_layers=1, load_balance="aux_loss", groups=4, topk_groups=2),
}  # fmt: skip
# name: (world size, ParallelDims, model overrides, pipeline options, documents)
LAYOUTS = {
    "fsdp2": (2, {"dp_shard": 2}, MLA, None, None),
    "tp2": (2, {"tp": 2}, MLA, None, None),
    "tp2-full-q": (2, {"tp": 2}, FULL_Q, None, None),
    "pp2": (2, {"pp": 2}, MLA, {"schedule": "1f1b"}, "mask"),
    "cp2-mask": (2, {"cp": 2}, MLA, None, "mask"),
    "ep2": (2, {"dp_shard": 2, "ep": 2}, MOE, None, None),
    "tp2-ac-selective": (2, {"tp": 2}, MLA, {"ac": "selective"}, None),
    "fsdp2-compile": (2, {"dp_shard": 2}, MLA, {"compile": True}, None),
}


_single: dict[str, dict] = {}


def single(overrides: dict, documents: str | None, accumulate: int) -> dict:
    """One process's run (cached), of `accumulate` micro-batches a step: the auxiliary loss
    is computed per micro-batch, so the reference of ep 2 (two data-parallel ranks) runs two."""
    key = repr((sorted(overrides.items()), documents, accumulate))
    if key not in _single:
        options = {"accumulate": accumulate}
        _single[key] = train(0, 1, None, "sgd", overrides, options, documents)
    return _single[key]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mla_layout_matches_one_process(layout):
    world, dims, overrides, pipeline, documents = LAYOUTS[layout]
    results = run_ranks(train, world, dims, "sgd", overrides, pipeline, documents)
    accumulate = 2 if "moe" in overrides else 1
    _compare(results, single(overrides, documents, accumulate), 1e-5, 1e-5)
