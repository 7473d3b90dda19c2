"""The model's shape: a typed config with presets, its parameter count and FLOPs per token."""

from __future__ import annotations

import math
from dataclasses import dataclass
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


def _integers(owner: object, names: tuple[str, ...], least: int) -> None:
    """Each field `names` of `owner` an integer of at least `least`, else a FieldError."""
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise FieldError(name, value, f"must be an integer of at least {least}")


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
        _integers(self, ("experts", "top_k", "expert_ffn_hidden", "groups", "topk_groups"), 1)
        _integers(self, ("shared_experts", "first_dense_layers"), 0)
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
        _integers(self, ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"), 1)
        if self.q_lora_rank is not None:  # none: a full-rank query projection
            _integers(self, ("q_lora_rank",), 1)
        _integers(self, ("qk_nope_head_dim",), 0)
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
        _integers(self, ("depth",), 1)
        if not _number(self.loss_weight) or self.loss_weight < 0:
            raise FieldError("loss_weight", self.loss_weight, "must be a number of at least 0")


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
    def mtp_depth(self) -> int:
        """The multi-token prediction modules (0 without `mtp`)."""
        return self.mtp.depth if self.mtp is not None else 0

    @property
    def total_layers(self) -> int:
        """The blocks the model holds: its `n_layers`, then one a multi-token prediction
        module (module k is `layers.{n_layers + k - 1}`, DeepSeek's checkpoints' index too)."""
        return self.n_layers + self.mtp_depth

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
        total += self.mtp_depth * mtp * (2 * self.dim * self.dim + 3 * self.dim)
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
        attention = 6 * self.total_layers * width * seq_len
        heads = self.mtp_depth * self.vocab_size * self.dim  # each MTP module runs the head
        return 6 * (active + heads) + attention
