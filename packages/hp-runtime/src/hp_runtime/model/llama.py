"""A Llama-style decoder in plain torch. It knows nothing about parallelism: TP, FSDP and PP
plans live in `hp_runtime.parallel` and act on the module names used here."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from hp_runtime.model.attention import Layout, attend
from hp_runtime.model.config import ModelConfig
from hp_runtime.model.ffn import FeedForward
from hp_runtime.model.loss import CHUNK_TOKENS, token_losses, whole
from hp_runtime.model.mla import LatentAttention
from hp_runtime.model.moe import MoE
from hp_runtime.model.norm import RMSNorm
from hp_runtime.model.rotary import apply_rotary, positions_of, rotary_tables


class Attention(nn.Module):
    """Grouped-query attention. Head counts come from the weights' local shapes, so the same
    code runs with the heads split across tensor-parallel ranks."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_size
        kv_dim = config.n_kv_heads * config.head_size
        self.wq = nn.Linear(config.dim, config.q_dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.q_dim, config.dim, bias=False)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # per head, before rotary (Qwen3)
            self.q_norm = RMSNorm(config.head_size, config.norm_eps)
            self.k_norm = RMSNorm(config.head_size, config.norm_eps)
        # (q, k, v, layout) -> output, k and v with n_kv_heads heads; context parallelism
        # wraps it to gather k and v first.
        self.kernel = attend

    def forward(self, x: torch.Tensor, tables: torch.Tensor, layout: Layout) -> torch.Tensor:
        batch, seq = x.shape[:2]
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = positions_of(layout, seq, x.device)
        q, k = apply_rotary(q, tables, positions), apply_rotary(k, tables, positions)
        # k and v keep their own (fewer) heads: the kernel shares them among q's.
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config) if config.mla is None else LatentAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: nn.Module = (
            MoE(config)
            if config.is_moe_layer(layer)
            else FeedForward(config.dim, config.ffn_hidden)
        )

    def forward(
        self,
        x: torch.Tensor,
        tables: torch.Tensor,
        layout: Layout,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), tables, layout)
        return x + self.feed_forward(self.ffn_norm(x))


class MTPLayer(Block):
    """Module k of `model.mtp` (the block `layers.{n_layers + k - 1}`, DeepSeek-V3's MTP
    module): h' = eh_proj([enorm(embedding of the token k ahead); hnorm(h)]), then the block,
    then `head_norm` (DeepSeek's `shared_head.norm`), all inside its forward, where FSDP has
    gathered them. `h` is what the model's head reads (its final norm's output) for the first
    module, the previous module's output for the others, as transformers' `MtpLayer` and
    Megatron chain them."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.enorm = RMSNorm(config.dim, config.norm_eps)
        self.hnorm = RMSNorm(config.dim, config.norm_eps)
        self.eh_proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.head_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, tables: torch.Tensor, layout: Layout, embedded: torch.Tensor
    ) -> torch.Tensor:
        """The head's input, which the next module reads too."""
        h = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(x)), dim=-1))
        return self.head_norm(super().forward(h, tables, layout))


class Transformer(nn.Module):
    """Embedding, blocks, final norm, output head. Layers sit in a ModuleDict keyed by their
    index, so a pipeline stage can drop the ones it does not own and keep the names."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        layers = {str(i): Block(config, i) for i in range(config.n_layers)}
        for i in range(config.n_layers, config.total_layers):  # multi-token prediction
            layers[str(i)] = MTPLayer(config, i)
        self.layers = nn.ModuleDict(layers)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rotary", rotary_tables(config), persistent=False)
        # each prediction module's summed cross-entropy since `Stepper` zeroed it (for the log)
        self.register_buffer("mtp_losses", torch.zeros(config.mtp_depth), persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding with the head, when asked. `to_empty` and `parallelize_module`
        replace parameters one module at a time, which unties them: call this again after."""
        if (
            self.config.tie_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
        ):
            self.output.weight = self.tok_embeddings.weight

    def reset_buffers(self) -> None:
        """Recompute the rotary tables where they are: `to_empty` leaves them uninitialised."""
        self.rotary = rotary_tables(self.config, device=self.rotary.device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_chunk_tokens: int = CHUNK_TOKENS,
        mtp_tokens: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of `tokens` (b, r). `position_ids` (b, s) rotate q and k (None: 0..s-1).
        `documents` (b, s) number each token's document, and attention stays inside them
        (None: a sample is one document; `attention.documents_after_eod` numbers them from the
        EOD tokens, `attention.document_ids` from position ids that restart at 0). `rows` (r,)
        are the rows of the whole sequence that `tokens` are, when they are not all of it
        (context parallelism); `position_ids` and `documents` then cover the whole sequence.
        With `labels` (b, r) the head returns each token's cross-entropy (b, r) instead, its
        logits computed `loss_chunk_tokens` at a time (`loss.token_losses`), never all at
        once; with `mtp_tokens` and `mtp_labels` (b, r, depth: `loss.mtp_inputs`) the
        multi-token prediction modules run too, and each token's loss adds theirs, weighted
        `model.mtp.loss_weight / depth` (without them, as in evaluation, they do not run)."""
        positions = position_ids
        if position_ids is not None and rows is not None:
            positions = position_ids[:, rows]
        layout = Layout(
            mode=self.config.attention,
            positions=positions,
            documents=documents,
            rows=rows,
        )
        # token ids are embedded; a hidden state (a later pipeline stage's input) goes on as it
        # is, also where a stage holds the embedding for its prediction modules
        embed = self.tok_embeddings is not None and not tokens.is_floating_point()
        h = self.tok_embeddings(tokens) if embed else tokens
        predictors = []
        for key, layer in self.layers.items():
            if int(key) < self.config.n_layers:
                h = layer(h, self.rotary, layout)
            else:
                predictors.append(layer)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if labels is None:
            return self.output(h)
        # inside the forward, where FSDP has gathered the head
        losses = token_losses(self.output, h, labels, loss_chunk_tokens)
        if mtp_tokens is None or mtp_labels is None or not predictors:
            return losses
        extra = 0
        for k, layer in enumerate(predictors):
            h = layer(h, self.rotary, layout, self.tok_embeddings(mtp_tokens[..., k]))
            predicted = token_losses(self.output, h, mtp_labels[..., k], loss_chunk_tokens)
            self.mtp_losses[k] += whole(predicted.detach().sum())
            extra = extra + predicted
        mtp = self.config.mtp
        assert mtp is not None
        return losses + extra * (mtp.loss_weight / mtp.depth)


def initial_tensor(config: ModelConfig, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full initial value of parameter `name` (its name in the plain model). Each draws
    from a generator of its own, seeded by `seed` and the name, so the value does not depend
    on which other parameters a process holds or in what order it draws them."""
    if config.tie_embeddings and name == "output.weight":
        name = "tok_embeddings.weight"  # the same value (a pipeline's last stage holds a copy)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("expert_bias"):  # a buffer, the balancing state: starts even
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = config.init_std
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        std = std / (2 * config.n_layers) ** 0.5  # residual projections, GPT-2 style
    return torch.randn(shape, generator=generator) * std
