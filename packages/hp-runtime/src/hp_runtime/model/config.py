"""The model's shape: a typed config with presets, its parameter count and FLOPs per token."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, get_args

AttentionMode = Literal["auto", "sdpa", "flex", "segments"]  # model.attention: stable names
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


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary scaling (`type = "llama3"`): wavelengths longer than
    `original_max_seq_len / low_freq_factor` are stretched `factor` times, those shorter
    than `original_max_seq_len / high_freq_factor` are kept, and those between interpolate,
    so that a model trained on `original_max_seq_len` positions reads `factor` times as many.
    Every field is required: a checkpoint is only right under the numbers it was trained
    with."""

    type: Literal["llama3"]
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    def __post_init__(self) -> None:
        if self.type != "llama3":
            raise FieldError("type", self.type, 'is not a scaling hp implements; use "llama3"')
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if not _number(getattr(self, name)):
                raise FieldError(name, getattr(self, name), "must be a number")
        if self.factor < 1:
            raise FieldError("factor", self.factor, "must be at least 1")
        if self.low_freq_factor <= 0:
            raise FieldError("low_freq_factor", self.low_freq_factor, "must be more than 0")
        if self.high_freq_factor <= self.low_freq_factor:
            raise FieldError(
                "high_freq_factor",
                self.high_freq_factor,
                f"must be more than low_freq_factor={self.low_freq_factor!r}",
            )
        length = self.original_max_seq_len
        if not isinstance(length, int) or isinstance(length, bool):
            raise FieldError("original_max_seq_len", length, "must be an integer")
        if length < 1:
            raise FieldError("original_max_seq_len", length, "must be at least 1")


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
    ffn_hidden: int = 172
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain rotary
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Which attention kernel runs (see `attention.py`); "auto" picks by batch and device.
    attention: AttentionMode = "auto"

    def __post_init__(self) -> None:
        if self.attention not in MODES:
            raise ValueError(f"attention={self.attention!r}; choose one of {', '.join(MODES)}")
        if not isinstance(self.rope_scaling, RopeScaling | None):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} is not a RopeScaling or None")
        sizes = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")
        for name in (*sizes, "max_seq_len"):  # a zero would divide by zero below
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for rotary")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameters, counting a tied embedding once."""
        kv = self.n_kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + 2 * self.dim * kv  # wq, wo, wk, wv
        mlp = 3 * self.dim * self.ffn_hidden
        block = attention + mlp + 2 * self.dim  # two RMSNorm weights
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        total = self.n_layers * block + self.dim + embeddings  # + final norm
        if not include_embeddings:
            total -= self.vocab_size * self.dim
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 N (without the input embedding lookup) plus attention's
        12 · layers · dim · seq_len (forward and backward), as in the PaLM/Megatron estimates."""
        return (
            6 * self.num_params(include_embeddings=False) + 12 * self.n_layers * self.dim * seq_len
        )


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
}


def preset(name: str, **overrides: object) -> ModelConfig:
    """A preset by name, with fields overridden."""
    try:
        return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
