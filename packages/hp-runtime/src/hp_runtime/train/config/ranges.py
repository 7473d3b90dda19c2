"""Each key's own allowed values, checked as the key is read: a range a number
(`RANGES`, one row a key) and a form for the text keys that have one (`FORMS`). Relations
between keys are `checks.py`'s."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hp_data.errors import HpDataError
from hp_data.gpt import MAX_SEQ_LENGTH

from hp_runtime.train.config.messages import _shown
from hp_runtime.train.errors import ConfigError

INT_MAX = 2**31 - 1  # counts and sizes: a C int (torch threads, kernels' indices); more is a typo
SEED_MAX = 2**32 - 1  # as hp-data's (and numpy's) seeds


@dataclass(frozen=True)
class Range:
    """The values a numeric key allows: from `low` to `high`, each bound included unless
    marked open."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        low, high = _bound(self.low), _bound(self.high)
        if self.high == math.inf:
            return f"more than {low}" if self.low_open else f"at least {low}"
        if isinstance(self.low, int) and isinstance(self.high, int):
            return f"from {low} to {high}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{low}, {high}{right}"


def _bound(value: float) -> str:
    names = {
        INT_MAX: "2**31 - 1",
        MAX_SEQ_LENGTH: "2**31 - 2",
        SEED_MAX: "2**32 - 1",
        2**24: "2**24",
        2**62: "2**62",
    }
    return names.get(value, repr(value)) if isinstance(value, int) else f"{value:g}"


def _ints(low: int, high: int = INT_MAX) -> Range:
    return Range(low, high)


POSITIVE, NON_NEGATIVE = Range(0.0, low_open=True), Range(0.0)
BELOW_ONE = Range(0.0, 1.0, high_open=True)  # betas, momentum
UP_TO_ONE = Range(0.0, 1.0, low_open=True)

# Every numeric key's range, one row a key (none, where a key allows it, is always allowed).
RANGES: dict[str, Range] = {
    "model.vocab_size": _ints(1),
    "model.dim": _ints(1),
    "model.n_layers": _ints(1, 4096),  # the model is built layer by layer: bounded time
    "model.n_heads": _ints(1),
    "model.n_kv_heads": _ints(1),
    "model.head_dim": _ints(1),  # none: dim / n_heads
    "model.ffn_hidden": _ints(1),
    "model.max_seq_len": _ints(1, 2**24),  # rotary positions are exact in float32 below 2**24
    "model.rope_theta": POSITIVE,
    "model.norm_eps": UP_TO_ONE,
    "model.init_std": UP_TO_ONE,
    # model.moe's fields (a table: `MoEConfig` then checks how they relate)
    "model.moe.experts": _ints(1),
    "model.moe.top_k": _ints(1),
    "model.moe.expert_ffn_hidden": _ints(1),
    "model.moe.shared_experts": _ints(0),
    "model.moe.route_scale": POSITIVE,
    "model.moe.first_dense_layers": _ints(0),
    "model.moe.aux_loss_coef": NON_NEGATIVE,
    "model.moe.bias_update_rate": NON_NEGATIVE,
    "model.moe.groups": _ints(1),
    "model.moe.topk_groups": _ints(1),
    # model.mla's and model.mtp's (tables: `MLAConfig` checks the rope width's parity)
    "model.mla.q_lora_rank": _ints(1),
    "model.mla.kv_lora_rank": _ints(1),
    "model.mla.qk_nope_head_dim": _ints(0),
    "model.mla.qk_rope_head_dim": _ints(1),
    "model.mla.v_head_dim": _ints(1),
    "model.mtp.depth": _ints(1, 64),  # each a block: built, like the layers, one at a time
    "model.mtp.loss_weight": NON_NEGATIVE,
    # hp-data's GPTDataset: a sample predicts at least one token; its L + 1 tokens count in int32
    "data.seq_length": _ints(2, MAX_SEQ_LENGTH),
    "data.seed": _ints(0, SEED_MAX),
    "data.eod_token": _ints(0),
    "data.num_workers": _ints(0, 1024),  # processes per rank
    "data.prefetch_factor": _ints(1, 1024),
    "data.remote_chunk_mb": Range(1 / 256, 4096.0),  # a 4 KiB page (tests) to 4 GiB
    "data.remote_cache_gb": POSITIVE,
    "data.remote_timeout_s": POSITIVE,
    "parallel.dp_replicate": _ints(1),
    "parallel.dp_shard": _ints(1),
    "parallel.cp": _ints(1),
    "parallel.tp": _ints(1),
    "parallel.pp": _ints(1),
    "parallel.ep": _ints(1),
    "parallel.pp_microbatches": _ints(1),
    "parallel.pp_virtual_stages": _ints(1),
    "parallel.ac_every": _ints(1),
    "parallel.fault_tolerance.replica_group": _ints(0, 65535),
    "parallel.fault_tolerance.groups": _ints(1, 65536),
    "parallel.fault_tolerance.min_replicas": _ints(1, 65536),
    "parallel.fault_tolerance.quorum_timeout_s": Range(0.0, 86400.0, low_open=True),
    "train.steps": _ints(1),
    "train.micro_batch_size": _ints(1),
    "train.global_batch_size": _ints(1),
    "train.batch_ramp.start": _ints(1),
    "train.batch_ramp.increment": _ints(1),
    "train.batch_ramp.samples": _ints(0, 2**62),  # 0: refused by BatchRamp, with its reason
    "train.seed": _ints(0, SEED_MAX),
    "train.max_norm": NON_NEGATIVE,
    "train.eval_interval": _ints(0),
    "train.eval_iters": _ints(1),
    "train.cpu_threads": _ints(0, 1024),  # threads per rank
    "train.spike_window": _ints(1),
    "train.spike_sigma": POSITIVE,
    "train.time_limit": NON_NEGATIVE,
    "train.hang_timeout_s": NON_NEGATIVE,
    "train.collective_timeout_s": POSITIVE,
    "train.loss_chunk_tokens": _ints(0),
    "optim.lr": POSITIVE,
    "optim.min_lr": NON_NEGATIVE,
    "optim.warmup_steps": _ints(0),
    "optim.decay_steps": _ints(1),
    "optim.wsd_decay_fraction": UP_TO_ONE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.beta1": BELOW_ONE,
    "optim.beta2": BELOW_ONE,
    "optim.eps": POSITIVE,
    "optim.momentum": BELOW_ONE,
    "optim.muon.lr": POSITIVE,
    "optim.muon.momentum": BELOW_ONE,
    "optim.muon.ns_steps": _ints(1, 99),  # torch.optim.Muon refuses 100 and more
    "optim.muon.weight_decay": NON_NEGATIVE,
    "checkpoint.interval": _ints(0),
    "checkpoint.keep": _ints(0),
    "checkpoint.upload_concurrency": _ints(1, 256),
    "metrics.log_interval": _ints(1),
    "metrics.peak_tflops": POSITIVE,
    "metrics.profile_every": _ints(0),
    "eval.interval": _ints(1),
    "eval.limit": _ints(1),
    "eval.batch_size": _ints(1, 4096),  # sequences a forward: more is a typo
}


def _check_split(split: str) -> None:
    from hp_data.index import parse_split

    try:
        parse_split(split)
    except HpDataError:
        raise ConfigError(
            f"data.split: expected up to three non-negative shares, not all zero, such as "
            f'"969,30,1"; got {_shown(split)}'
        ) from None


# Text keys with a form of their own, checked as they are read (as numbers are, by `RANGES`).
def _check_profile(window: tuple[int, int]) -> None:
    first, count = window
    if first < 1 or count < 1:
        raise ConfigError(
            f"metrics.profile_steps: give [first step, steps], both at least 1, got "
            f"[{first}, {count}]"
        )


FORMS: dict[str, Callable[[Any], None]] = {
    "data.split": _check_split,
    "metrics.profile_steps": _check_profile,
}
