"""The loss is normalised by the loss tokens of the whole global batch, so accumulation and
layout do not change it: one process with 4 accumulation steps, FSDP 2 with 2, FSDP 2 x PP 2
(tied embeddings across the stages), TP 2 and PP 3 (whose middle stage reads no data) give
the same per-step losses and gradient norms (fp32, CPU, SGD).

`eod_mask_loss` makes the number of loss tokens differ between micro-batches; a trainer that
averaged per micro-batch (or per rank) would fail this test."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.train import corpus_overrides, corpus_samples, records, train_ranks

STEPS = 6


@pytest.fixture(scope="module")
def overrides(example_corpus, example_tokenizer, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return [
        *corpus_overrides(example_corpus, example_tokenizer, cache),
        "model.tie_embeddings=true",
        "model.n_layers=3",
        "model.max_seq_len=64",
        "data.seq_length=32",
        "data.eod_mask_loss=true",
        f"train.steps={STEPS}",
        "train.micro_batch_size=1",
        "train.global_batch_size=4",
        "train.max_norm=1.0",
        "optim.name=sgd",
        "optim.lr=0.5",
        "optim.decay_style=constant",
        f"train.run_dir={tmp_path_factory.mktemp('run')}",
    ]


def _loss_tokens_differ(overrides: list[str]) -> bool:
    dataset = corpus_samples(overrides, 4 * STEPS, seq_length=32, eod_mask_loss=True)
    counts = [float(dataset[i]["loss_mask"].sum()) for i in range(4 * STEPS)]
    return len(set(counts)) > 1


@pytest.mark.slow
def test_accumulation_and_layouts_give_the_same_losses(overrides, tmp_path):
    one = train_ranks(1, overrides)[0]
    assert _loss_tokens_differ(overrides)  # so that the normalisation is really exercised
    fsdp = train_ranks(2, [*overrides, "parallel.dp_shard=2"])
    fsdp_pp = train_ranks(
        4,
        [*overrides, "parallel.dp_shard=2", "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    )
    tp = train_ranks(2, [*overrides, "parallel.tp=2"])
    pp3 = train_ranks(3, [*overrides, "parallel.pp=3"])  # 4 micro-batches, one schedule step
    reference = np.array(one["losses"])
    assert len(reference) == STEPS and reference[-1] < reference[0]
    for results in (fsdp, fsdp_pp, tp, pp3):
        for rank in results:
            np.testing.assert_allclose(rank["losses"], reference, rtol=1e-5, atol=0)
            np.testing.assert_allclose(rank["grad_norms"], one["grad_norms"], rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("reset", ["true", "false"])
def test_document_masking_through_a_pipeline_gives_the_same_losses(overrides, reset):
    """PP 3 (the middle stage reads no data: the position ids and documents reach it with the
    activations) equals one process with packed documents masked, the positions restarting at
    each document or not; without the masking the run differs."""
    documents = [
        *overrides,
        "data.seq_length=64",
        f"data.reset_position_ids={reset}",
        "data.document_masking=true",
    ]
    one = train_ranks(1, documents)[0]
    unmasked = train_ranks(1, [*documents, "data.document_masking=false"])[0]
    assert np.abs(np.array(one["losses"]) / unmasked["losses"] - 1).max() > 1e-4
    for rank in train_ranks(3, [*documents, "parallel.pp=3"]):
        np.testing.assert_allclose(rank["losses"], one["losses"], rtol=1e-5, atol=0)
        np.testing.assert_allclose(rank["grad_norms"], one["grad_norms"], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_a_moe_model_through_fsdp_and_a_pipeline_gives_the_same_losses_and_figures(
    overrides, tmp_path
):
    """FSDP 2 x PP 2 (a dense first layer and a MoE one on the first stage, a MoE one on the
    second) and TP 2 (both tp ranks route every token) equal one process: the auxiliary loss
    weighs each micro-batch alike on every rank, and each layer's expert load and auxiliary
    loss reach the log from its stage once, not once per tp rank."""
    moe = [
        *overrides,
        "model.moe={experts = 4, top_k = 2, expert_ffn_hidden = 32, first_dense_layers = 1, "
        "aux_loss_coef = 0.1}",
        "train.steps=3",
    ]
    one = train_ranks(1, [*moe, f"train.run_dir={tmp_path / 'one'}"])[0]
    layout = ["parallel.dp_shard=2", "parallel.pp=2", "parallel.pp_schedule=gpipe"]
    split = train_ranks(4, [*moe, *layout, f"train.run_dir={tmp_path / 'split'}"])
    tp = train_ranks(2, [*moe, "parallel.tp=2", f"train.run_dir={tmp_path / 'tp'}"])
    for rank in [*split, *tp]:
        np.testing.assert_allclose(rank["losses"], one["losses"], rtol=1e-5, atol=0)
        np.testing.assert_allclose(rank["grad_norms"], one["grad_norms"], rtol=1e-5, atol=0)
    want = records(tmp_path / "one")
    assert len(want) == 3 and all(len(r["moe_load_max_over_mean"]) == 2 for r in want)
    for got in (records(tmp_path / "split"), records(tmp_path / "tp")):
        for key in ("moe_load_max_over_mean", "moe_aux_loss"):
            np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-5)
