"""The presets: named `ModelConfig`s, published shapes (Llama 3.x, Qwen3-MoE, OLMoE, the
DeepSeek-V3 family) and small ones for tests and examples."""

from __future__ import annotations

from dataclasses import replace

from hp_runtime.model.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig, RopeScaling

# Meta's scaling of Llama 3.1 (8B, 70B, 405B) and of Llama 3.2 (1B, 3B).
LLAMA_31_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
LLAMA_32_SCALING = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)


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
