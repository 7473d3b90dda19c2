"""Multi-token prediction (`model.mtp`) trains like one process on every layout it runs on:
hp-train of `deepseek-v3-tiny` (latent attention, grouped routing, one MTP module) on the
shipped corpus, packed, attention masked to its documents and the loss to the tokens before
an end of document, so that the prediction module's targets and masks cross documents and
context-parallel ranks. Losses, gradient norms and the logged `mtp_loss` within 1e-5."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.train import corpus_overrides, records, train_ranks

STEPS = 10
DENSE = ["model.moe=none"]  # context parallelism does not take MoE models yet
# name: (world, layout, model overrides)
LAYOUTS = {
    "fsdp2": (2, ["parallel.dp_shard=2"], []),
    "tp2": (2, ["parallel.tp=2"], []),
    "ep2": (2, ["parallel.dp_shard=2", "parallel.ep=2"], []),
    "cp2-dense": (2, ["parallel.cp=2"], DENSE),
    # the modules on the last stage, with a copy of the embedding kept equal to the first's
    "pp2": (2, ["parallel.pp=2", "parallel.pp_microbatches=2"], []),
    "tp2xpp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.pp_microbatches=2"], []),
    # FSDP's shards of the two copies summed; the head tied to the last stage's copy too
    "fsdp2xpp2-tied": (
        4,
        ["parallel.dp_shard=2", "parallel.pp=2", "parallel.pp_microbatches=2"],
        ["model.tie_embeddings=true"],
    ),
}


@pytest.fixture(scope="module")
def run(example_corpus, example_tokenizer, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    common = [
        *corpus_overrides(example_corpus, example_tokenizer, cache),
        "model.preset=deepseek-v3-tiny", "model.vocab_size=8192", "model.max_seq_len=64",
        "data.seq_length=32", "data.eod_mask_loss=true", "data.document_masking=true",
        f"train.steps={STEPS}", "train.micro_batch_size=1", "train.global_batch_size=4",
        "optim.name=sgd", "optim.lr=0.5", "optim.decay_style=constant", "data.split=90,10,0",
        "metrics.log_interval=1",
    ]  # fmt: skip

    def go(world: int, layout: list[str]) -> tuple[dict, list[float]]:
        directory = tmp_path_factory.mktemp("run")
        result = train_ranks(world, [*common, *layout, f"train.run_dir={directory}"])[0]
        return result, [r["mtp_loss"] for r in records(directory)]

    cached: dict[str, tuple[dict, list[float]]] = {}

    def once(world: int, layout: list[str]) -> tuple[dict, list[float]]:
        key = repr((world, layout))
        if key not in cached:
            cached[key] = go(world, layout)
        return cached[key]

    return once


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mtp_layout_matches_one_process(run, layout):
    world, dims, model = LAYOUTS[layout]
    want, want_mtp = run(1, model)
    assert len(want_mtp) == STEPS and all(m > 0 for m in want_mtp)
    got, got_mtp = run(world, [*dims, *model])
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got_mtp, want_mtp, rtol=1e-5, atol=0)
