"""The model on its own: shapes, parameter counts, masking, seeded initialisation."""

from __future__ import annotations

import pytest
import torch
from hp_runtime.model import PRESETS, Transformer, preset
from hp_runtime.model.attention import document_ids
from hp_runtime.model.config import ModelConfig
from hp_runtime.parallel import ParallelDims, init_weights


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_counts_the_real_parameters(name):
    config = PRESETS[name]
    with torch.device("meta"):
        model = Transformer(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_preset_sizes_are_what_their_names_say():
    assert 15e6 < PRESETS["small"].num_params() < 30e6
    assert 100e6 < PRESETS["125m"].num_params() < 170e6
    assert 0.9e9 < PRESETS["1b"].num_params() < 1.6e9
    assert 7e9 < PRESETS["8b"].num_params() < 8.5e9


def test_flops_per_token_is_6n_plus_attention():
    config = PRESETS["125m"]
    dense = 6 * (config.num_params() - config.vocab_size * config.dim)
    assert config.flops_per_token(2048) == dense + 12 * 12 * 768 * 2048


def test_seeded_init_is_reproducible_and_the_model_runs():
    config = preset("tiny", tie_embeddings=True)
    models = []
    for _ in range(2):
        with torch.device("meta"):
            model = Transformer(config)
        model.to_empty(device="cpu")
        init_weights(model, seed=3)
        models.append(model)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert models[0].output.weight is models[0].tok_embeddings.weight
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    assert models[0](tokens).shape == (2, 16, config.vocab_size)


def test_document_masking_keeps_attention_inside_documents():
    config = preset("tiny")
    model = Transformer(config)
    init_weights(model, seed=1)
    tokens = torch.randint(0, config.vocab_size, (1, 12))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])  # two documents
    changed = tokens.clone()
    changed[0, :5] = (changed[0, :5] + 1) % config.vocab_size  # edit the first document only
    with torch.no_grad():
        documents = document_ids(positions)
        before = model(tokens, positions, documents)
        after = model(changed, positions, documents)
        unmasked_after = model(changed, positions)
        unmasked_before = model(tokens, positions)
    torch.testing.assert_close(before[0, 5:], after[0, 5:])  # second document untouched
    assert not torch.allclose(unmasked_before[0, 5:], unmasked_after[0, 5:])


def _megatron_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """megatron-core's reset_attention_mask, as its loop writes it: causal, and for each EOD
    token at index i no query after i sees a key at or before i. (b, 1, s, s), True = attend."""
    batch, seq = tokens.shape
    mask = torch.ones(batch, seq, seq, dtype=torch.bool).tril()
    for b in range(batch):
        for i in (tokens[b] == eod).nonzero().flatten().tolist():
            mask[b, i + 1 :, : i + 1] = False
    return mask.unsqueeze(1)


def test_documents_after_eod_mask_as_megatron_without_resetting_positions():
    """Document masking with positions 0..s-1 (no reset_position_ids): the documents end at
    each EOD token, as megatron-core's reset_attention_mask; outputs and gradients equal the
    model run with Megatron's mask written by its loop, and differ from no masking."""
    from hp_runtime.model.attention import documents_after_eod

    config = preset("tiny")
    eod = 3
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(4, config.vocab_size, (2, 24), generator=generator)
    tokens[0, [0, 6, 7, 15]] = eod  # an EOD first, two in a row, one mid-sample
    tokens[1, 23] = eod  # the last token: no document after it
    reference = _megatron_mask(tokens, eod)

    def run(documents: torch.Tensor | None, mask: torch.Tensor | None):
        model = Transformer(config)
        init_weights(model, seed=1)
        if mask is not None:
            for block in model.layers.values():

                def kernel(q, k, v, layout):
                    repeat = q.shape[1] // k.shape[1]
                    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

                block.attention.kernel = kernel
        out = model(tokens, documents=documents)
        out.square().mean().backward()
        return out, [p.grad for p in model.parameters()]

    got, got_grads = run(documents_after_eod(tokens, eod), None)
    want, want_grads = run(None, reference)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    plain, _ = run(None, None)
    assert not torch.allclose(plain, want, atol=1e-4)


@pytest.mark.parametrize(
    ("dims", "world", "message"),
    [
        (ParallelDims(dp_shard=2, tp=2), 8, "= 4, but the world size is 8"),
        (ParallelDims(tp=3), 3, "n_heads=4 is not divisible by tp=3"),
        (ParallelDims(tp=4), 4, "n_kv_heads=2 is not divisible by tp=4"),
        (ParallelDims(pp=3), 3, "n_layers=2 is fewer than pp=3 stages"),
        (ParallelDims(dp_shard=0), 0, "dp_shard=0 must be at least 1"),
    ],
)
def test_parallel_dims_explain_what_does_not_fit(dims, world, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        dims.validate(world, preset("tiny"))


def test_config_checks():
    with pytest.raises(ValueError, match="not divisible by n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")


def test_pipeline_splits_and_micro_batches_are_checked():
    from hp_runtime.parallel.pp import layers_per_stage, pipeline_step

    assert layers_per_stage(7, 3) == [3, 2, 2]
    assert layers_per_stage(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(ValueError, match="must be 2 positive counts adding up to 4"):
        layers_per_stage(4, 2, [2, 3])
    with pytest.raises(ValueError, match="fewer than the 4 pipeline stages"):
        layers_per_stage(2, 4)
    with pytest.raises(ValueError, match="a batch of 3 does not divide into 2 micro-batches"):
        pipeline_step(None, [0], 2, torch.zeros(3, 8), torch.zeros(3, 8), 2)  # type: ignore[arg-type]
