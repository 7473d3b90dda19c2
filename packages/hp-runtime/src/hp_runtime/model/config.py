"""The model's shape: a typed config with presets, its parameter count and FLOPs per token."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, get_args

AttentionMode = Literal["auto", "sdpa", "flex", "segments"]  # model.attention: stable names
RouterKind = Literal["softmax", "sigmoid"]  # model.moe.router: stable names
LoadBalance = Literal["aux_loss", "bias"]  # model.moe.load_balance: stable names
AttentionKind = Literal["gqa", "mla"]  # model.attention_kind: stable names
MODES: tuple[str, ...] = get_args(AttentionMode)
CHUNK_TOKENS = 1024  # the loss head's tokens a chunk (model/loss.py): 0.5 GiB of fp32 logits


class FieldError(ValueError):
    """A value one field of a model config cannot take. The field is named apart from the
    problem, so that each caller names it in its own terms (`model.rope_scaling.factor` in
    config.toml, `rope_scaling.factor` in an HF `config.json`)."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        super().__init__(f"{field}={value!r} {problem}")
        self.field, self.value, self.problem = field, value, problem


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


RopeKind = Literal["llama3", "yarn"]  # model.rope_scaling.type: stable names
_LLAMA3_FIELDS = ("low_freq_factor", "high_freq_factor")
_YARN_FIELDS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling that lets a model trained on `original_max_seq_len` positions read
    `factor` times as many. Each type takes its own fields; the other type's stay none.

    `type = "llama3"` (Llama 3.1): wavelengths longer than `original_max_seq_len /
    low_freq_factor` are stretched `factor` times, those shorter than `original_max_seq_len /
    high_freq_factor` are kept, and those between interpolate. Both factors are required: a
    checkpoint is only right under the numbers it was trained with.

    `type = "yarn"` (YaRN: DeepSeek-V3, Kimi K2, Qwen3's long context): the frequencies that
    turn fewer than `beta_slow` times over the original length are stretched `factor` times,
    those turning more than `beta_fast` times kept, a linear ramp between (transformers'
    `rope_type = "yarn"`, bounds rounded outwards); cos and sin are multiplied by
    `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` where both are given (nonzero),
    else by `mscale(factor, 1)`, with `mscale(f, m) = 0.1 m ln f + 1`. Latent attention
    (`model.attention_kind = "mla"`) also multiplies its softmax scale by
    `mscale(factor, mscale_all_dim)²` where `mscale_all_dim` is given. Left out: beta_fast
    32, beta_slow 1, mscale and mscale_all_dim none, as transformers reads them."""

    type: RopeKind
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_seq_len: int = None  # type: ignore[assignment]  # required: checked below
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.type not in get_args(RopeKind):
            raise FieldError(
                "type", self.type, 'is not a scaling hp implements; use "llama3" or "yarn"'
            )
        if not _number(self.factor):
            raise FieldError("factor", self.factor, "must be a number")
        if self.factor < 1:
            raise FieldError("factor", self.factor, "must be at least 1")
        length = self.original_max_seq_len
        if length is None:
            raise FieldError("original_max_seq_len", length, f"required with type {self.type!r}")
        if not isinstance(length, int) or isinstance(length, bool):
            raise FieldError("original_max_seq_len", length, "must be an integer")
        if length < 1:
            raise FieldError("original_max_seq_len", length, "must be at least 1")
        mine, others = (
            (_LLAMA3_FIELDS, _YARN_FIELDS)
            if self.type == "llama3"
            else (_YARN_FIELDS, _LLAMA3_FIELDS)
        )
        for name in others:
            if getattr(self, name) is not None:
                raise FieldError(name, getattr(self, name), f"is not a field of type {self.type!r}")
        for name in mine:
            value = getattr(self, name)
            if value is None and self.type == "llama3":
                raise FieldError(name, value, "required with type 'llama3'")
            if value is not None and not _number(value):
                raise FieldError(name, value, "must be a number")
        if self.type == "llama3":
            self._check_llama3()
        else:
            self._check_yarn()

    def _check_llama3(self) -> None:
        assert self.low_freq_factor is not None and self.high_freq_factor is not None
        if self.low_freq_factor <= 0:
            raise FieldError("low_freq_factor", self.low_freq_factor, "must be more than 0")
        if self.high_freq_factor <= self.low_freq_factor:
            raise FieldError(
                "high_freq_factor",
                self.high_freq_factor,
                f"must be more than low_freq_factor={self.low_freq_factor!r}",
            )

    def _check_yarn(self) -> None:
        for name in ("beta_fast", "beta_slow"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise FieldError(name, value, "must be more than 0")
        if self.fast_rotations < self.slow_rotations:  # equal: a step (Kimi K2's 1 and 1)
            raise FieldError(
                "beta_fast",
                self.fast_rotations,
                f"must be at least beta_slow={self.slow_rotations!r}",
            )
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise FieldError(name, value, "must be at least 0")

    @property
    def fast_rotations(self) -> float:
        """YaRN's beta_fast (32 where not given)."""
        return 32.0 if self.beta_fast is None else self.beta_fast

    @property
    def slow_rotations(self) -> float:
        """YaRN's beta_slow (1 where not given)."""
        return 1.0 if self.beta_slow is None else self.beta_slow

    def attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 for llama3)."""
        if self.type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor, 1.0)

    def softmax_factor(self) -> float:
        """What latent attention multiplies its softmax scale by: DeepSeek's
        mscale(factor, mscale_all_dim)² under YaRN where mscale_all_dim is given, else 1."""
        if self.type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: 0.1 · mscale · ln(factor) + 1 (1 where factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MoEConfig:
    """A routed feed-forward (`model/moe.py`): each token goes to its `top_k` of `experts`
    SwiGLU experts of width `expert_ffn_hidden`, and to `shared_experts` always-active ones
    (one SwiGLU of width `shared_experts * expert_ffn_hidden`). Dropless: no capacity, no
    token dropped.

    `router = "softmax"` (Mixtral, Qwen3-MoE, OLMoE): softmax over all experts, top-k, the
    k weights renormalised to sum to 1 when `renormalize`. `router = "sigmoid"`
    (DeepSeek-V3): sigmoid scores, top-k (chosen by score + the balancing bias), the k scores
    normalised when `renormalize`. Both then scaled by `route_scale`.

    `load_balance = "aux_loss"`: the Switch/Qwen auxiliary loss, `aux_loss_coef` times its
    sum over the MoE layers, added to the training loss. `"bias"`: DeepSeek-V3's
    auxiliary-loss-free balancing: a per-expert bias, added to the scores only to choose the
    experts, moved by `bias_update_rate` after each step towards the mean global load.
    The first `first_dense_layers` layers keep the dense feed-forward (`ffn_hidden`).

    Group-limited routing (DeepSeek-V3's node-limited routing; DeepSeek-V2's
    `group_limited_greedy`): the experts are `groups` equal groups in index order; each token
    ranks the groups and chooses its top-k only among the experts of its best `topk_groups`.
    A group's rank: the sum of its two best scores (sigmoid router; with the balancing bias
    where it chooses), or its best score (softmax). `groups = topk_groups` (the default, 1)
    routes over every expert."""

    experts: int
    top_k: int
    expert_ffn_hidden: int
    shared_experts: int = 0
    router: RouterKind = "softmax"
    renormalize: bool = True
    route_scale: float = 1.0
    first_dense_layers: int = 0
    load_balance: LoadBalance = "aux_loss"
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 1e-3
    groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "expert_ffn_hidden", "groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise FieldError(name, value, "must be an integer of at least 1")
        for name in ("shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise FieldError(name, value, "must be an integer of at least 0")
        if self.top_k > self.experts:
            raise FieldError("top_k", self.top_k, f"is more than experts={self.experts}")
        if self.router not in get_args(RouterKind):
            raise FieldError("router", self.router, 'must be "softmax" or "sigmoid"')
        if self.load_balance not in get_args(LoadBalance):
            raise FieldError("load_balance", self.load_balance, 'must be "aux_loss" or "bias"')
        if not isinstance(self.renormalize, bool):
            raise FieldError("renormalize", self.renormalize, "must be true or false")
        for name in ("route_scale", "aux_loss_coef", "bias_update_rate"):
            if not _number(getattr(self, name)) or getattr(self, name) < 0:
                raise FieldError(name, getattr(self, name), "must be a number of at least 0")
        if self.route_scale == 0:
            raise FieldError("route_scale", self.route_scale, "must be more than 0")
        self._check_groups()

    def _check_groups(self) -> None:
        if self.experts % self.groups:
            raise FieldError("groups", self.groups, f"must divide experts={self.experts}")
        if self.topk_groups > self.groups:
            raise FieldError("topk_groups", self.topk_groups, f"is more than groups={self.groups}")
        per_group = self.experts // self.groups
        if self.top_k > self.topk_groups * per_group:
            raise FieldError(
                "topk_groups",
                self.topk_groups,
                f"keeps {self.topk_groups * per_group} experts (groups={self.groups} of "
                f"{per_group} experts each), fewer than top_k={self.top_k}",
            )
        if self.router == "sigmoid" and self.groups > 1 and per_group < 2:
            raise FieldError(
                "groups",
                self.groups,
                f"leaves {per_group} expert a group; the sigmoid router ranks a group by its "
                "two best",
            )

    @property
    def shared_hidden(self) -> int:
        """The width of the always-active SwiGLU (0: none)."""
        return self.shared_experts * self.expert_ffn_hidden


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight; `model/mla.py`).
    The keys and values of all heads come from one `kv_lora_rank`-wide latent (normed), the
    queries from a `q_lora_rank`-wide one (normed; none: a full-rank projection). A head's
    query and key are `qk_nope_head_dim` columns without rotary plus `qk_rope_head_dim`
    rotated ones, the rotated key shared by every head; its value is `v_head_dim` wide."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    order = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, name)
            if value is None and name == "q_lora_rank":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise FieldError(name, value, "must be an integer of at least 1")
        nope = self.qk_nope_head_dim
        if not isinstance(nope, int) or isinstance(nope, bool) or nope < 0:
            raise FieldError("qk_nope_head_dim", nope, "must be an integer of at least 0")
        if self.qk_rope_head_dim % 2:
            raise FieldError("qk_rope_head_dim", self.qk_rope_head_dim, "must be even for rotary")

    @property
    def qk_head_dim(self) -> int:
        """A query's (and key's) width: the part without rotary and the rotated part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def num_params(self, dim: int, heads: int) -> int:
        """One layer's attention parameters (projections and the latents' norms)."""
        q = dim * heads * self.qk_head_dim
        if self.q_lora_rank is not None:
            q = (
                dim * self.q_lora_rank
                + self.q_lora_rank
                + self.q_lora_rank * heads * self.qk_head_dim
            )
        kv = dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * dim


@dataclass(frozen=True)
class MTPConfig:
    """DeepSeek-V3's multi-token prediction: `depth` sequential modules after the model's
    layers, module k predicting the token k + 1 ahead of each position from the previous
    module's hidden state (the model's own for the first) and the embedding of the token k
    ahead, through the two RMSNorms, a projection of the two side by side, one transformer
    block and the model's head under a norm of its own. Trained with the model: the loss is
    the main one plus `loss_weight` times the mean of the modules' (each over the same
    tokens' count as the main loss, as the paper's 1/T)."""

    depth: int
    loss_weight: float = 0.3  # DeepSeek-V3's for its first 10T tokens (then 0.1)

    def __post_init__(self) -> None:
        if not isinstance(self.depth, int) or isinstance(self.depth, bool) or self.depth < 1:
            raise FieldError("depth", self.depth, "must be an integer of at least 1")
        if not _number(self.loss_weight) or self.loss_weight < 0:
            raise FieldError("loss_weight", self.loss_weight, "must be a number of at least 0")


# Meta's scaling of Llama 3.1 (8B, 70B, 405B) and of Llama 3.2 (1B, 3B).
LLAMA_31_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
LLAMA_32_SCALING = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder. `ffn_hidden` is the SwiGLU inner width."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # one head's width; None: dim // n_heads (Qwen3 sets it apart)
    ffn_hidden: int = 172
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain rotary
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Which attention kernel runs (see `attention.py`); "auto" picks by batch and device.
    attention: AttentionMode = "auto"
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, OLMoE)
    # "gqa": grouped-query attention (`n_kv_heads`, `head_dim`); "mla": latent attention as
    # `mla` shapes it (its k and v have `n_heads` heads; `n_kv_heads` must equal `n_heads`)
    attention_kind: AttentionKind = "gqa"
    mla: MLAConfig | None = None
    mtp: MTPConfig | None = None  # None: no multi-token prediction modules
    moe: MoEConfig | None = None  # None: every layer's feed-forward is dense

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) routes its feed-forward over experts."""
        return self.moe is not None and layer >= self.moe.first_dense_layers

    def __post_init__(self) -> None:
        if self.attention not in MODES:
            raise ValueError(f"attention={self.attention!r}; choose one of {', '.join(MODES)}")
        if not isinstance(self.moe, MoEConfig | None):
            raise ValueError(f"moe={self.moe!r} is not a MoEConfig or None")
        if not isinstance(self.rope_scaling, RopeScaling | None):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} is not a RopeScaling or None")
        self._check_attention_kind()
        scaling = self.rope_scaling
        if scaling is not None and scaling.type == "yarn" and not self.rope_theta > 1:
            raise ValueError(
                f"rope_theta={self.rope_theta} with rope_scaling type 'yarn': YaRN's ramp needs "
                "a rope_theta above 1"
            )
        if not isinstance(self.mtp, MTPConfig | None):
            raise ValueError(f"mtp={self.mtp!r} is not an MTPConfig or None")
        sizes = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")
        for name in (*sizes, "max_seq_len"):  # a zero would divide by zero below
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.head_dim is not None:
            if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool):
                raise ValueError(f"head_dim={self.head_dim!r} must be an integer (or none)")
            if self.head_dim < 1:
                raise ValueError(f"head_dim={self.head_dim} must be at least 1")
        elif self.dim % self.n_heads:
            raise ValueError(
                f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_size % 2 and self.mla is None:
            width = "head_dim" if self.head_dim is not None else "head dim (dim / n_heads)"
            raise ValueError(f"{width}={self.head_size} must be even for rotary")
        if self.moe is not None and self.moe.first_dense_layers >= self.n_layers:
            raise ValueError(
                f"moe.first_dense_layers={self.moe.first_dense_layers} leaves no MoE layer of "
                f"n_layers={self.n_layers}; lower it, or drop model.moe for a dense model"
            )

    def _check_attention_kind(self) -> None:
        if self.attention_kind not in get_args(AttentionKind):
            raise ValueError(f'attention_kind={self.attention_kind!r}; choose "gqa" or "mla"')
        if not isinstance(self.mla, MLAConfig | None):
            raise ValueError(f"mla={self.mla!r} is not an MLAConfig or None")
        if self.attention_kind == "gqa":
            if self.mla is not None:
                raise ValueError(
                    'mla is set, but attention_kind="gqa"; set attention_kind="mla", or mla = '
                    '"none" for grouped-query attention'
                )
            return
        if self.mla is None:
            raise ValueError('attention_kind="mla" needs mla = {kv_lora_rank, ...}')
        for name, value, wrong in (
            ("n_kv_heads", self.n_kv_heads, self.n_kv_heads != self.n_heads),
            ("head_dim", self.head_dim, self.head_dim is not None),
            ("qk_norm", self.qk_norm, self.qk_norm),
        ):
            if wrong:
                need = {"n_kv_heads": f"n_heads={self.n_heads}", "head_dim": "none"}
                raise ValueError(
                    f'{name}={value!r} with attention_kind="mla": latent attention\'s shapes '
                    f"are mla's; set {name} = {need.get(name, 'false')}"
                )

    @property
    def total_layers(self) -> int:
        """The blocks the model holds: its `n_layers`, then one a multi-token prediction
        module (`layers.{n_layers + k}`, DeepSeek's checkpoints' index for them too)."""
        return self.n_layers + (self.mtp.depth if self.mtp is not None else 0)

    @property
    def rope_dim(self) -> int:
        """The width of a head's rotated part: all of it, or MLA's `qk_rope_head_dim`."""
        return self.head_size if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def head_size(self) -> int:
        """The width of one attention head: `head_dim` where given, else dim // n_heads.
        (`head_dim` itself stays as given, so that a preset's derived width follows an
        overridden `dim` or `n_heads`.)"""
        if self.mla is not None:
            return self.mla.qk_head_dim
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """The width of the queries (and of attention's output), n_heads · head_size: `dim`
        unless `head_dim` sets it apart."""
        return self.n_heads * self.head_size

    def num_params(
        self, include_embeddings: bool = True, active: bool = False, mtp: bool = True
    ) -> int:
        """Parameters, counting a tied embedding once; with `active`, only those one token
        uses (its top-k experts of each MoE layer, not all of them); without `mtp`, those of
        the model alone (as transformers' models hold it), not its prediction modules (which
        share the embedding and the head: their blocks, two norms and a projection each,
        and a norm before the head)."""
        kv = self.n_kv_heads * self.head_size
        attention = 2 * self.dim * self.q_dim + 2 * self.dim * kv  # wq, wo, wk, wv
        attention += 2 * self.head_size * self.qk_norm  # the q and k norms' weights (per head)
        if self.mla is not None:
            attention = self.mla.num_params(self.dim, self.n_heads)
        total = self.dim + self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        layers = self.total_layers if mtp else self.n_layers
        for layer in range(layers):  # + final norm and embeddings, above
            total += attention + self._ffn_params(layer, active) + 2 * self.dim  # two norms
        total += (layers - self.n_layers) * (2 * self.dim * self.dim + 3 * self.dim)
        if not include_embeddings:
            total -= self.vocab_size * self.dim
        return total

    def _ffn_params(self, layer: int, active: bool) -> int:
        if not self.is_moe_layer(layer):
            return 3 * self.dim * self.ffn_hidden
        moe = self.moe
        assert moe is not None
        used = moe.top_k if active else moe.experts
        router = self.dim * moe.experts
        return router + 3 * self.dim * (used * moe.expert_ffn_hidden + moe.shared_hidden)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 N (the active parameters, without the input embedding
        lookup; each multi-token prediction module's run of the head counted too) plus
        attention's 12 · layers · q_dim · seq_len (forward and backward; q_dim is heads x head
        width, `dim` unless `head_dim` sets it apart; latent attention's q·k and v widths
        apart), as in the PaLM/Megatron estimates."""
        active = self.num_params(include_embeddings=False, active=True)
        width = 2 * self.q_dim  # q·k and the weights times v, each q_dim wide a token
        if self.mla is not None:
            width = self.n_heads * (self.mla.qk_head_dim + self.mla.v_head_dim)
        heads = self.total_layers - self.n_layers  # each MTP module runs the head again
        attention = 6 * self.total_layers * width * seq_len
        return 6 * (active + heads * self.vocab_size * self.dim) + attention


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(
        vocab_size=32000,
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=688,
        max_seq_len=1024,
    ),
    "125m": ModelConfig(
        vocab_size=32000,
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_hidden=2048,
        max_seq_len=2048,
    ),
    "1b": ModelConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=4096,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "8b": ModelConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # Meta's published shapes (Llama 3.2 1B and 3B, Llama 3.1 8B, 70B and 405B): the sizes,
    # theta and scaling of their HF config.json, so `model.init_from` of Meta's checkpoint
    # needs no override. max_seq_len is their 131,072 positions (the rotary table, 64 MiB in
    # fp32): the tokens a sample trains on are `data.seq_length`. ("8b" above is Llama 3 8B.)
    **{
        name: ModelConfig(
            vocab_size=128256,
            dim=dim,
            n_layers=layers,
            n_heads=heads,
            n_kv_heads=8,
            ffn_hidden=ffn,
            max_seq_len=131072,
            rope_theta=500000.0,
            rope_scaling=scaling,
            tie_embeddings=tied,
        )
        for name, dim, layers, heads, ffn, scaling, tied in (
            ("llama3-1b", 2048, 16, 32, 8192, LLAMA_32_SCALING, True),
            ("llama3-3b", 3072, 28, 24, 8192, LLAMA_32_SCALING, True),
            ("llama3-8b", 4096, 32, 32, 14336, LLAMA_31_SCALING, False),
            ("llama3-70b", 8192, 80, 64, 28672, LLAMA_31_SCALING, False),
            ("llama3-405b", 16384, 126, 128, 53248, LLAMA_31_SCALING, False),
        )
    },
    # Every layer routed, so that each stage of a two-stage pipeline holds a MoE layer; the
    # softmax router renormalised, without shared experts: Mixtral's form, which exports.
    "moe-tiny": ModelConfig(moe=MoEConfig(experts=8, top_k=2, expert_ffn_hidden=32)),
    # The published shapes of Qwen/Qwen3-30B-A3B's and allenai/OLMoE-1B-7B-0924's config.json
    # (`ffn_hidden` is their `intermediate_size`, which no layer uses: every layer is routed).
    # Qwen3's head width (128) is not dim / heads (64). OLMoE's transformers model norms q
    # and k across all heads (2 x 2048 weights a layer); hp norms them per head (2 x 128),
    # so this preset has OLMoE's shapes but not its q/k norms (61,440 parameters fewer).
    "qwen3-moe-30b-a3b": ModelConfig(
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        ffn_hidden=6144,
        max_seq_len=40960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        moe=MoEConfig(experts=128, top_k=8, expert_ffn_hidden=768),
    ),
    "olmoe-1b-7b": ModelConfig(
        vocab_size=50304,
        dim=2048,
        n_layers=16,
        n_heads=16,
        n_kv_heads=16,
        ffn_hidden=1024,
        max_seq_len=4096,
        rope_theta=10000.0,
        norm_eps=1e-5,
        qk_norm=True,
        moe=MoEConfig(experts=64, top_k=8, expert_ffn_hidden=1024, renormalize=False),
    ),
}


# DeepSeek-V3's YaRN: 4,096 positions read 40 times as far, the softmax scaled by mscale².
DEEPSEEK_V3_YARN = RopeScaling(
    "yarn", 40.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
    mscale_all_dim=1.0,
)  # fmt: skip
# The DeepSeek-V3 family (`DeepseekV3ForCausalLM`): latent attention, sigmoid routing with
# the balancing bias over shared and routed experts, a few dense layers first. The shapes of
# deepseek-ai/DeepSeek-V3's (with its one multi-token prediction module),
# moonshotai/Moonlight-16B-A3B's and moonshotai/Kimi-K2-Base's config.json (neither has MTP
# layers); "deepseek-v3-tiny" has every feature on at CPU size.
_DEEPSEEK_MLA = MLAConfig(512, 128, 64, 128, q_lora_rank=1536)
PRESETS.update({
    "deepseek-v3-tiny": ModelConfig(
        vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=4, ffn_hidden=128,
        max_seq_len=256, norm_eps=1e-6, attention_kind="mla",
        mla=MLAConfig(32, 16, 8, 16, q_lora_rank=48),
        rope_scaling=RopeScaling("yarn", 4.0, original_max_seq_len=64, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        moe=MoEConfig(experts=8, top_k=2, expert_ffn_hidden=32, shared_experts=1,
                      router="sigmoid", route_scale=2.5, first_dense_layers=1,
                      load_balance="bias", groups=4, topk_groups=2),
        mtp=MTPConfig(depth=1, loss_weight=0.3),
    ),
    "deepseek-v3-671b": ModelConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
        ffn_hidden=18432, max_seq_len=163840, rope_theta=10000.0,
        rope_scaling=DEEPSEEK_V3_YARN, norm_eps=1e-6, attention_kind="mla", mla=_DEEPSEEK_MLA,
        moe=MoEConfig(experts=256, top_k=8, expert_ffn_hidden=2048, shared_experts=1,
                      router="sigmoid", route_scale=2.5, first_dense_layers=3,
                      load_balance="bias", groups=8, topk_groups=4),
        mtp=MTPConfig(depth=1, loss_weight=0.3),  # its one MTP module (λ 0.3, then 0.1)
    ),
    "moonlight-16b-a3b": ModelConfig(
        vocab_size=163840, dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, ffn_hidden=11264,
        max_seq_len=8192, rope_theta=50000.0, norm_eps=1e-5, attention_kind="mla",
        mla=MLAConfig(512, 128, 64, 128),
        moe=MoEConfig(experts=64, top_k=6, expert_ffn_hidden=1408, shared_experts=2,
                      router="sigmoid", route_scale=2.446, first_dense_layers=1,
                      load_balance="bias"),
    ),
    "kimi-k2-1t": ModelConfig(
        vocab_size=163840, dim=7168, n_layers=61, n_heads=64, n_kv_heads=64, ffn_hidden=18432,
        max_seq_len=131072, rope_theta=50000.0,
        rope_scaling=RopeScaling("yarn", 32.0, original_max_seq_len=4096, beta_fast=1.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        norm_eps=1e-6, attention_kind="mla", mla=_DEEPSEEK_MLA,
        moe=MoEConfig(experts=384, top_k=8, expert_ffn_hidden=2048, shared_experts=1,
                      router="sigmoid", route_scale=2.827, first_dense_layers=1,
                      load_balance="bias"),
    ),
})  # fmt: skip


def preset(name: str, **overrides: object) -> ModelConfig:
    """A preset by name, with fields overridden."""
    try:
        return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
