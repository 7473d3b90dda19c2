"""The MoE layer on its own, against references written plainly here: the routed output token
by token, the grouped kernel against the loop, ties, the auxiliary loss (and against
transformers'), its gradient, the load under activation checkpointing, per-head q/k norms,
and the presets' parameter counts against transformers' models of the published configs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hp_runtime.model import Transformer, preset
from hp_runtime.model import moe as moe_module
from hp_runtime.model.attention import Layout
from hp_runtime.model.config import ModelConfig, MoEConfig
from hp_runtime.model.llama import Attention
from hp_runtime.model.moe import (
    AddAuxLoss,
    MoE,
    aux_loss,
    expert_ffn,
    grouped_expert_ffn,
    grouped_mm_runs,
)
from hp_runtime.model.rotary import rotary_tables
from hp_runtime.parallel import init_weights

DIM, EXPERTS, HIDDEN = 32, 8, 16


def layer_config(**moe: object) -> ModelConfig:
    fields = {"experts": EXPERTS, "top_k": 2, "expert_ffn_hidden": HIDDEN, **moe}
    return ModelConfig(dim=DIM, n_heads=4, n_kv_heads=2, moe=MoEConfig(**fields))  # type: ignore[arg-type]


def make_layer(seed: int = 0, **moe: object) -> MoE:
    """A MoE layer with every parameter drawn at a scale that keeps outputs near 1."""
    layer = MoE(layer_config(**moe))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return layer


def tokens(count: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, DIM, generator=torch.Generator().manual_seed(seed))


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return w2 @ (F.silu(w1 @ x) * (w3 @ x))


def per_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's rule one token at a time in float64: scores, the top-k by a python sort
    (higher first, ties to the lower index), the weights, each chosen expert's SwiGLU from
    the stacked weights, their weighted sum, plus the shared experts."""
    moe = layer.moe
    gate = layer.router.gate.weight.detach().double()
    bias = layer.router.expert_bias.double()
    w1, w2, w3 = (
        w.detach().double() for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3)
    )
    outs = []
    for token in x.detach().double():
        logits = [float(gate[e] @ token) for e in range(moe.experts)]
        if moe.router == "softmax":
            top = max(logits)
            exps = [math.exp(v - top) for v in logits]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        choice = [s + float(b) for s, b in zip(scores, bias, strict=True)]
        if moe.load_balance != "bias":
            choice = scores
        allowed = _best_groups(moe, choice)
        chosen = sorted(allowed, key=lambda e: (-choice[e], e))[: moe.top_k]
        weights = [scores[e] for e in chosen]
        if moe.renormalize:
            weights = [w / sum(weights) for w in weights]
        out = torch.zeros(DIM, dtype=torch.float64)
        for e, w in zip(chosen, weights, strict=True):
            out += w * moe.route_scale * swiglu(token, w1[e], w2[e], w3[e])
        if layer.shared is not None:
            s = layer.shared
            out += swiglu(token, *(m.weight.detach().double() for m in (s.w1, s.w2, s.w3)))
        outs.append(out)
    return torch.stack(outs)


def _best_groups(moe: MoEConfig, choice: list[float]) -> list[int]:
    """The experts of the token's best `topk_groups` groups (DeepSeek-V3, section 2.1.2 and
    its reference code: a group ranked by the sum of its two best scores; DeepSeek-V2's
    `group_limited_greedy`: by its best), ties to the lower group."""
    size = moe.experts // moe.groups
    members = [list(range(g * size, (g + 1) * size)) for g in range(moe.groups)]
    if moe.router == "sigmoid":
        rank = [sum(sorted((choice[e] for e in group), reverse=True)[:2]) for group in members]
    else:
        rank = [max(choice[e] for e in group) for group in members]
    best = sorted(range(moe.groups), key=lambda g: (-rank[g], g))[: moe.topk_groups]
    return sorted(e for g in best for e in members[g])


ROUTERS = {
    "mixtral": {},  # softmax, top-k renormalised
    "olmoe": {"renormalize": False, "top_k": 3},
    "scaled": {"route_scale": 2.5},
    "deepseek": {
        "router": "sigmoid",
        "route_scale": 2.5,
        "load_balance": "bias",
        "shared_experts": 2,
    },
    "sigmoid-raw": {"router": "sigmoid", "renormalize": False},
    "deepseek-v3-groups": {
        "router": "sigmoid",
        "route_scale": 2.5,
        "load_balance": "bias",
        "shared_experts": 1,
        "groups": 4,
        "topk_groups": 2,
        "top_k": 3,
    },
    "deepseek-v2-groups": {"groups": 4, "topk_groups": 1},
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_layer_equals_the_per_token_reference(name):
    layer = make_layer(**ROUTERS[name])
    if layer.moe.load_balance == "bias":  # moves choices, never weights
        layer.router.expert_bias.copy_(torch.linspace(-0.4, 0.4, EXPERTS))
    x = tokens()
    expected = per_token(layer, x)
    with torch.no_grad():
        fp32 = layer(x)  # the default kernel: grouped on CPU in fp32
        fp64 = layer.double()(x.double())  # the loop (no grouped multiply in fp64)
    torch.testing.assert_close(fp64, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fp32.double(), expected, rtol=1e-5, atol=1e-5)
    if layer.moe.load_balance == "bias":  # the bias did change some token's experts
        _, with_bias, _ = layer.router(x.double())
        layer.router.expert_bias.zero_()
        _, without, _ = layer.router(x.double())
        assert not torch.equal(with_bias, without)
    if layer.moe.topk_groups < layer.moe.groups:  # the groups did change some token's experts
        _, limited, _ = layer.router(x)
        layer.router.moe = replace(layer.moe, topk_groups=layer.moe.groups)
        _, free, _ = layer.router(x)
        assert not torch.equal(limited, free)


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_group_limited_routing_equals_transformers_deepseek(version):
    """hp's router against transformers' own: DeepseekV3TopkRouter (sigmoid, the bias, a
    group's two best) and DeepSeek-V2's `group_limited_greedy` (softmax, a group's best), with
    the same weights: the same experts and weights for every token."""
    transformers = pytest.importorskip("transformers")
    sigmoid = version == "v3"
    moe = {"groups": 4, "topk_groups": 2, "top_k": 3, "route_scale": 2.5, "renormalize": sigmoid}
    if sigmoid:
        moe |= {"router": "sigmoid", "load_balance": "bias", "shared_experts": 1}
    layer = make_layer(**moe)
    if sigmoid:
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, EXPERTS).flip(0))
    fields = {"hidden_size": DIM, "n_routed_experts": EXPERTS, "num_experts_per_tok": 3,
              "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}  # fmt: skip
    if sigmoid:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        theirs = DeepseekV3TopkRouter(transformers.DeepseekV3Config(**fields, norm_topk_prob=True))
        theirs.e_score_correction_bias.copy_(layer.router.expert_bias)
    else:  # DeepSeek-V2 weighs by the k probabilities as they are
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        config = transformers.DeepseekV2Config(**fields, topk_method="group_limited_greedy")
        theirs = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        theirs.weight.copy_(layer.router.gate.weight)
        x = tokens(64)
        weights, experts, _ = layer.router(x)
        _, their_weights, their_experts = theirs(x)
    order = their_experts.sort(dim=-1)
    assert torch.equal(experts.sort(dim=-1).values, order.values)
    mine = weights.gather(-1, experts.sort(dim=-1).indices)
    torch.testing.assert_close(mine, their_weights.gather(-1, order.indices), rtol=1e-6, atol=0)
    assert len(set(experts.flatten().tolist())) == EXPERTS  # every expert chosen somewhere


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_ties_go_to_the_lower_expert(router):
    layer = make_layer(router=router, top_k=2)
    x = tokens()
    x[:, 0] = x[:, 0].abs() + 3
    with torch.no_grad():  # experts 6, 2 and 4 score alike, above all others, for every token
        tied = torch.zeros(DIM)
        tied[0] = 5.0
        for e in (6, 2, 4):
            layer.router.gate.weight[e] = tied
    weights, experts, _ = layer.router(x)
    assert experts.tolist() == [[2, 4]] * len(x)
    assert torch.equal(weights[:, 0], weights[:, 1])
    torch.testing.assert_close(layer(x).double(), per_token(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss", ["weighted", "sum"])  # sum: an expanded (stride 0) gradient
@pytest.mark.parametrize(
    "counts",
    [[3, 0, 5, 0, 2, 7, 0, 1], [0, 0, 18, 0, 0, 0, 0, 0], [0] * EXPERTS],
    ids=["some-empty", "all-to-one", "no-tokens"],
)
def test_grouped_kernel_equals_the_loop(counts, loss):
    generator = torch.Generator().manual_seed(2)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), DIM, generator=generator)
    ws = [torch.randn(EXPERTS, HIDDEN, DIM, generator=generator) * 0.3 for _ in range(2)]
    w2 = torch.randn(EXPERTS, DIM, HIDDEN, generator=generator) * 0.3
    results = []
    for kernel in (grouped_expert_ffn, expert_ffn):
        leaves = [t.clone().requires_grad_() for t in (x, ws[0], w2, ws[1])]
        out = kernel(leaves[0], counts, *leaves[1:])
        if loss == "sum":
            out.sum().backward()
        else:
            (out * torch.arange(out.numel()).view(out.shape).sin()).sum().backward()
        results.append([out.detach(), *(t.grad for t in leaves)])
    for grouped, loop in zip(*results, strict=True):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    assert results[0][0].shape == (len(x), DIM)


def test_the_default_kernel_is_grouped_where_it_runs(monkeypatch):
    calls = []
    for name in ("grouped_expert_ffn", "expert_ffn"):
        real = getattr(moe_module, name)
        monkeypatch.setattr(
            moe_module, name, lambda *a, real=real, name=name: calls.append(name) or real(*a)
        )
    assert grouped_mm_runs(torch.device("cpu"), torch.float32)
    assert not grouped_mm_runs(torch.device("cpu"), torch.float64)  # no fp64 grouped multiply
    x = tokens()
    for dtype in (torch.float32, torch.float64):
        make_layer().to(dtype)(x.to(dtype))
    odd = MoE(layer_config(expert_ffn_hidden=12)).to(torch.bfloat16)  # 24 bytes a row
    odd(x.to(torch.bfloat16))
    assert calls == ["grouped_expert_ffn", "expert_ffn", "expert_ffn"]


def test_bf16_routes_in_fp32():
    layer = make_layer()
    x = tokens()
    low = make_layer().to(torch.bfloat16)
    low_weights, _, scores = low.router(x.to(torch.bfloat16))
    assert low_weights.dtype == scores.dtype == torch.float32
    out = low(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), layer(x).detach(), rtol=0.05, atol=0.05)


def test_aux_loss_matches_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(40, EXPERTS, generator=torch.Generator().manual_seed(3))
    top_k = 2
    probs = logits.softmax(-1)
    chosen = probs.topk(top_k, dim=-1).indices.flatten().tolist()
    counts = torch.tensor([chosen.count(e) for e in range(EXPERTS)])
    # transformers divides the counts by the T tokens, hp by the T·k routed slots: theirs is
    # k times hp's (k at an even load, hp's 1), so hp's coefficient is k times theirs.
    theirs = load_balancing_loss_func((logits,), EXPERTS, top_k)
    torch.testing.assert_close(aux_loss(probs, counts, top_k) * top_k, theirs)
    even = torch.full((EXPERTS * 5, EXPERTS), 1.0 / EXPERTS)
    assert aux_loss(even, torch.full((EXPERTS,), 10), top_k).item() == pytest.approx(1.0)


def plain_aux(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """hp's auxiliary loss of `x` from its definition: E · Σ_e (slots to e / (T·k)) · mean P,
    P a token's probabilities: the softmax, or the sigmoid scores over their sum."""
    logits = x @ layer.router.gate.weight.t()
    scores = logits.softmax(-1) if layer.moe.router == "softmax" else logits.sigmoid()
    chosen = scores.detach().topk(layer.moe.top_k, dim=-1).indices.flatten().tolist()
    share = torch.tensor([chosen.count(e) for e in range(EXPERTS)]) / len(chosen)
    probs = scores / scores.sum(-1, keepdim=True)
    return EXPERTS * (share * probs.mean(0)).sum()


def test_the_aux_gradient_keeps_its_precision_under_bf16_activations():
    x = torch.ones(4, 8, dtype=torch.bfloat16, requires_grad=True)
    aux = torch.zeros((), requires_grad=True)
    scale = torch.tensor(0.001234)  # not a bf16 value
    AddAuxLoss.apply(x, aux, scale).sum().backward()
    assert aux.grad == scale and torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_loss_reaches_the_gate_with_its_scale(router):
    layer = make_layer(router=router)
    layer.aux_scale.fill_(0.37)
    x = tokens().requires_grad_()
    layer(x).sum().backward()
    got = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    layer.eval()  # no auxiliary loss in the layer: the test adds its own
    out = layer(x)
    out.sum().backward(retain_graph=True)
    without = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    (out.sum() + 0.37 * plain_aux(layer, x)).backward()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert (got["router.gate.weight"] - without).abs().max() > 1e-3  # the aux loss counted


def test_a_plain_layer_is_initialised_and_weighs_its_aux_loss_by_the_coefficient():
    """Outside the trainer (no init_weights, no Balance): the experts hold numbers in a
    Linear's range, not torch.empty's, and one forward's aux loss weighs aux_loss_coef."""
    torch.manual_seed(0)
    layer = MoE(layer_config(aux_loss_coef=0.25))
    for name in ("w1", "w2", "w3"):
        weight = getattr(layer.experts, name)
        bound = 1 / weight.shape[-1] ** 0.5  # nn.Linear's default over the input width
        assert weight.isfinite().all() and weight.abs().max() <= bound, name
        assert weight.std() > bound / 4, name  # drawn, not zeros
    x = tokens().requires_grad_()
    layer(x).sum().backward()
    got = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    layer.eval()
    (layer(x).sum() + 0.25 * plain_aux(layer, x)).backward()
    torch.testing.assert_close(got, layer.router.gate.weight.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("early_stop", [True, False])  # False: the recompute runs to the end
def test_the_load_is_counted_once_per_forward_even_when_recomputed(early_stop):
    layer = make_layer()
    x = tokens().requires_grad_()
    _, experts, _ = layer.router(x)
    counts = torch.tensor([experts.flatten().tolist().count(e) for e in range(EXPERTS)])
    aux = plain_aux(layer, x).detach()
    with torch.no_grad():  # evaluation counts nothing
        layer(x)
    assert layer.load.sum() == 0 and layer.aux_total == 0
    layer(x)
    layer(x)
    torch.testing.assert_close(layer.load, 2 * counts.float())
    torch.testing.assert_close(layer.aux_total, 2 * aux)
    layer(x).square().sum().backward()
    plain = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer.reset_buffers()
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)  # as ac.py's
        out.square().sum().backward()  # the recompute runs here
    torch.testing.assert_close(layer.load, counts.float())  # and did not count again
    torch.testing.assert_close(layer.aux_total, aux)
    for before, param in zip(plain, layer.parameters(), strict=True):
        torch.testing.assert_close(param.grad, before)


def plain_attention(attention: Attention, x: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Causal GQA attention with per-head RMSNorm of q and k before rotary, plainly."""
    batch, seq, _ = x.shape
    width = config.head_size

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, -1, width)

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + config.norm_eps) * weight

    def rotate(t: torch.Tensor) -> torch.Tensor:
        half = width // 2
        freq = config.rope_theta ** (-torch.arange(half) / half)
        angle = torch.arange(seq)[:, None] * freq  # (s, half)
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        a, b = t[..., :half], t[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    q = rotate(rms(heads(x @ attention.wq.weight.t()), attention.q_norm.weight))
    k = rotate(rms(heads(x @ attention.wk.weight.t()), attention.k_norm.weight))
    v = heads(x @ attention.wv.weight.t())
    group = config.n_heads // config.n_kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(width)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), -math.inf)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(batch, seq, -1)
    return out @ attention.wo.weight.t()


def test_qk_norm_is_a_per_head_rmsnorm_and_head_dim_sets_the_width():
    config = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True)
    attention = Attention(config)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in attention.parameters():  # the norms' weights too, not ones
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3 + 0.1)
    assert attention.wq.weight.shape == (64, 32) and attention.q_norm.weight.shape == (16,)
    x = torch.randn(2, 12, 32, generator=generator)
    with torch.no_grad():
        got = attention(x, rotary_tables(config), Layout(mode="sdpa"))
    torch.testing.assert_close(got, plain_attention(attention, x, config), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "qk_norm": True,
            "head_dim": 32,
            "moe": MoEConfig(
                experts=8,
                top_k=2,
                expert_ffn_hidden=32,
                shared_experts=1,
                router="sigmoid",
                load_balance="bias",
                route_scale=2.0,
                first_dense_layers=1,
            ),
        },
    ],
    ids=["moe-tiny", "sigmoid-shared-dense-first"],
)
def test_the_moe_transformer_trains_every_parameter(overrides):
    config = preset("moe-tiny", **overrides)
    model = Transformer(config)
    init_weights(model, seed=5)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    kinds = [type(block.feed_forward).__name__ for block in model.layers.values()]
    assert kinds == ["FeedForward" if config.moe.first_dense_layers else "MoE", "MoE"]
    batch = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    loss = model(batch, labels=batch).mean()
    loss.backward()
    assert torch.isfinite(loss)
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


# The published config.json fields of Qwen/Qwen3-30B-A3B and allenai/OLMoE-1B-7B-0924 that
# shape the parameters.
QWEN3_30B_A3B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
OLMOE_1B_7B = {
    "vocab_size": 50304,
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
}


def hf_counts(model: torch.nn.Module, experts: int, top_k: int) -> tuple[int, int]:
    """(total, active) parameters of a transformers MoE: active drops the E - k experts of
    each layer a token does not use, sized from the experts' own tensors."""
    total = sum(p.numel() for p in model.parameters())
    unused = 0
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            unused += param.numel() // experts * (experts - top_k)
    return total, total - unused


@pytest.mark.parametrize(
    "name, published, totals",
    [
        ("qwen3-moe-30b-a3b", QWEN3_30B_A3B, (30.5e9, 3.3e9)),
        ("olmoe-1b-7b", OLMOE_1B_7B, (6.9e9, 1.3e9)),
    ],
)
def test_preset_counts_equal_transformers_models_of_the_published_config(name, published, totals):
    import transformers

    config = preset(name)
    if name.startswith("qwen3"):
        hf_config = transformers.Qwen3MoeConfig(**published)
        architecture = transformers.Qwen3MoeForCausalLM
    else:
        hf_config = transformers.OlmoeConfig(**published)
        architecture = transformers.OlmoeForCausalLM
    with torch.device("meta"):
        model = architecture(hf_config)
    total, active = hf_counts(model, published["num_experts"], published["num_experts_per_tok"])
    # OLMoE's transformers model norms q and k across all heads (2 x 2048 weights a layer);
    # hp norms each head (2 x 128, shared by the heads).
    full_width = 2 * config.dim - 2 * config.head_size if name.startswith("olmoe") else 0
    assert config.num_params() + full_width * config.n_layers == total
    assert config.num_params(active=True) + full_width * config.n_layers == active
    assert total == pytest.approx(totals[0], rel=0.01)
    assert active == pytest.approx(totals[1], rel=0.03)
    assert (
        config.flops_per_token(4096)
        == 6 * (config.num_params(active=True) - config.vocab_size * config.dim)
        + 12 * config.n_layers * config.n_heads * config.head_size * 4096
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"head_dim": 0}, "head_dim=0 must be at least 1"),
        ({"head_dim": 2.5}, "head_dim=2.5 must be an integer"),
        ({"head_dim": True}, "head_dim=True must be an integer"),
        ({"head_dim": 7}, "head_dim=7 must be even"),
        ({"dim": 24, "n_heads": 8, "n_kv_heads": 8}, r"head dim \(dim / n_heads\)=3 must be even"),
        ({"dim": 30}, "dim=30 is not divisible by n_heads=4; set head_dim"),
        ({"moe": MoEConfig(8, 2, 16, first_dense_layers=2)}, "first_dense_layers=2 leaves no"),
    ],
)
def test_model_config_refuses_bad_head_dims_and_all_dense_moe(overrides, message):
    with pytest.raises(ValueError, match=message):
        preset("moe-tiny", **overrides)


def test_head_dim_follows_dim_unless_given():
    assert preset("moe-tiny", dim=128).head_size == 32  # the derived width follows dim
    assert preset("qwen3-moe-30b-a3b", dim=1024).head_size == 128  # a given one stays
    assert replace(preset("tiny"), n_heads=8).head_size == 8


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"groups": 3}, "groups=3 must divide experts=8"),
        ({"groups": 0}, "groups=0 must be an integer of at least 1"),
        ({"groups": 2, "topk_groups": 3}, "topk_groups=3 is more than groups=2"),
        ({"groups": 4, "topk_groups": 1, "top_k": 4}, "topk_groups=1 keeps 2 experts"),
        ({"groups": 8, "topk_groups": 8, "router": "sigmoid"}, "groups=8 leaves 1 expert"),
    ],
)
def test_group_fields_that_cannot_route_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{"experts": 8, "top_k": 2, "expert_ffn_hidden": 16, **fields})
