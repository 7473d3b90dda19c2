"""Context parallelism (`parallel/cp.py`): the rows a rank keeps, the gather of the whole
sequence and its backward, the `parallel.cp` key, and the trainer at cp 2 x pp 2 against one
process on packed documents whose loss tokens differ between the cp ranks.

The layouts' parity with one process (cp 2, cp 4, dp_shard 2 x cp 2, cp 2 x tp 2, cp 2 x pp 2,
each with and without document masking) is in test_parity.py; resuming across cp in
train/test_checkpoint.py (`test_resume_on_another_layout`: cp 2 to one process, one process to
HSDP (2 replicas) x cp 2, the trainer's losses after the resume those of the first layout).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hp_runtime.parallel import ParallelDims
from hp_runtime.parallel.cp import chunk_rows
from hp_runtime.train.config import ConfigError, load_config

from tests.helpers.distributed import run_ranks
from tests.helpers.train import corpus_overrides, corpus_samples, hp_train_here, train_ranks


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_each_rank_keeps_two_mirrored_chunks_of_equal_work(size):
    seq = 2 * size * 3
    chunks = torch.arange(seq).chunk(2 * size)
    kept = [chunk_rows(seq, rank, size) for rank in range(size)]
    for rank, rows in enumerate(kept):
        want = torch.cat((chunks[rank], chunks[2 * size - 1 - rank]))
        assert rows.tolist() == want.tolist()
    assert sorted(torch.cat(kept).tolist()) == list(range(seq))  # every row once
    work = {int((rows + 1).sum()) for rows in kept}  # keys a causal row attends
    assert len(work) == 1


def test_a_sequence_that_does_not_split_into_2n_chunks_is_refused():
    with pytest.raises(ValueError, match="a sequence of 12 does not divide into 2 x cp = 8"):
        chunk_rows(12, 0, 4)


def _gathered(rank: int, world: int) -> dict[str, Any]:
    """Shard a known batch and tensor on this rank, gather the tensor back, and backpropagate
    a weighted sum through the gather."""
    from hp_runtime.model.attention import Layout, attend
    from hp_runtime.parallel.cp import ContextParallel, GatheredKV
    from torch.distributed.device_mesh import init_device_mesh

    plan = ContextParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(2, 3, 16, 4, generator=generator)  # (b, heads, s, d)
    weight = torch.randn(full.shape, generator=generator)
    rows = plan.rows(16, torch.device("cpu"))
    local = full[:, :, rows].clone().requires_grad_(True)
    whole = plan.gather(local, dim=2)
    (whole * weight).sum().backward()
    batch = {
        "tokens": torch.arange(32).view(2, 16),
        "labels": torch.arange(32).view(2, 16) + 1,
        "loss_mask": torch.ones(2, 16),
        "position_ids": torch.arange(16).repeat(2, 1),
    }
    shard = plan.shard(batch)
    try:  # a forward that does not say which rows it holds
        GatheredKV(attend, plan)(full, full, full, Layout())
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {
        "refused": refused,
        "whole": whole.detach().numpy(),
        "full": full.numpy(),
        "grad": local.grad.numpy(),
        "want_grad": (world * weight[:, :, rows]).numpy(),  # every rank's sum, onto the owner
        "rows": rows.numpy(),
        "shard": {k: v.numpy() for k, v in shard.items()},
    }


def test_the_gather_puts_every_row_back_and_its_backward_sums_onto_the_owner():
    world = 2  # 4 ranks' order: the cp 4 parity layouts
    for rank, got in enumerate(run_ranks(_gathered, world)):
        np.testing.assert_array_equal(got["whole"], got["full"])
        np.testing.assert_allclose(got["grad"], got["want_grad"], rtol=1e-6)
        rows, shard = got["rows"], got["shard"]
        np.testing.assert_array_equal(rows, chunk_rows(16, rank, world).numpy())
        np.testing.assert_array_equal(shard["tokens"], np.arange(32).reshape(2, 16)[:, rows])
        np.testing.assert_array_equal(shard["labels"], np.arange(32).reshape(2, 16)[:, rows] + 1)
        assert shard["loss_mask"].shape == (2, 16 // world)
        assert shard["position_ids"].shape == (2, 16)  # whole: documents span every row
        np.testing.assert_array_equal(shard["rows"], rows)
        assert (
            got["refused"] == "context parallelism: call the model with the rows it holds (rows=)"
        )


BASE = ["data.type=dummy", "data.seq_length=32", "train.steps=3"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.cp=0"], "parallel.cp: must be from 1 to 2**31 - 1, got 0"),
        (["parallel.cp=-2"], "parallel.cp: must be from 1 to 2**31 - 1, got -2"),
        (["parallel.cp=2.0"], "parallel.cp: expected an integer, got 2.0 (float)"),
        (["parallel.cp=true"], "parallel.cp: expected an integer, got True (bool)"),
        (["parallel.cp=two"], "parallel.cp: expected an integer, got 'two'"),
        (
            ["parallel.cp=3"],
            "data.seq_length=32 does not divide into 2 x parallel.cp = 6 equal chunks",
        ),
        (
            ["parallel.cp=16", "data.seq_length=48"],
            "data.seq_length=48 does not divide into 2 x parallel.cp = 32 equal chunks "
            "(context parallelism gives each rank two); make it a multiple of 32",
        ),
        (
            ["parallel.cp=2", "parallel.tp=4", "data.seq_length=12"],
            "data.seq_length=12 / parallel.cp=2 = 6 rows a context-parallel rank, not divisible "
            "by parallel.tp=4 (sequence parallel splits them); make data.seq_length a multiple "
            "of 8",
        ),
    ],
)
def test_a_bad_cp_is_one_line_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, *overrides])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cp_that_does_not_fit_the_world_is_refused_by_hp_train():
    done = hp_train_here(*BASE, "parallel.cp=2", "train.run_dir=/nonexistent/never")
    assert done.returncode == 2, done.stdout
    assert done.stderr.splitlines() == [
        "hp-train: error: parallel: dp_replicate*dp_shard*cp*tp*pp = 1*1*2*1*1 = 2, but the "
        "world size is 1 (set parallel.dp_shard, cp, tp, pp, dp_replicate)"
    ]


def test_the_layout_counts_cp_in_the_world_and_in_the_gradient_average():
    dims = ParallelDims(dp_replicate=2, dp_shard=3, cp=2, tp=2)
    assert (dims.world_size, dims.dp_size, dims.dp_cp_size) == (24, 6, 12)
    assert load_config(None, [*BASE, "parallel.cp=4"]).parallel.cp == 4
    assert load_config(None, BASE).parallel.cp == 1


STEPS = 4


@pytest.fixture(scope="module")
def documents(example_corpus, example_tokenizer, tmp_path_factory) -> list[str]:
    """The shipped corpus packed into 32-token samples, attention masked to its documents and
    the loss to the tokens before an end of document: cp ranks then hold different numbers of
    loss tokens."""
    cache = tmp_path_factory.mktemp("cache")
    return [
        *corpus_overrides(example_corpus, example_tokenizer, cache),
        "model.max_seq_len=64",
        "data.seq_length=32",
        "data.eod_mask_loss=true",
        "data.document_masking=true",
        f"train.steps={STEPS}",
        "train.micro_batch_size=1",
        "train.global_batch_size=4",
        "optim.name=sgd",
        "optim.lr=0.5",
        "optim.decay_style=constant",
        "train.eval_interval=2",
        "train.eval_iters=1",
        "data.split=90,10,0",
        f"train.run_dir={tmp_path_factory.mktemp('run')}",
    ]


def _loss_tokens_per_rank(overrides: list[str], size: int) -> set[tuple[float, ...]]:
    """The loss tokens each of `size` cp ranks holds, per training sample."""
    dataset = corpus_samples(
        overrides, 4 * STEPS, seq_length=32, eod_mask_loss=True, split="90,10,0"
    )
    counts = set()
    for i in range(4 * STEPS):
        mask = torch.as_tensor(dataset[i]["loss_mask"])
        counts.add(tuple(float(mask[chunk_rows(32, r, size)].sum()) for r in range(size)))
    return counts


@pytest.mark.slow
def test_the_trainer_at_cp_2_x_pp_2_equals_one_process_on_packed_documents(documents):
    """The pipeline's path through the trainer, the cp ranks' rows found at every stage; the
    path without a pipeline is the one the resharded resumes of test_checkpoint.py run."""
    one = train_ranks(1, documents)[0]
    pp = train_ranks(4, [*documents, "parallel.cp=2", "parallel.pp=2"])  # documents carried
    assert any(len(set(c)) > 1 for c in _loss_tokens_per_rank(documents, 2))
    assert len(one["losses"]) == STEPS and one["losses"][-1] < one["losses"][0]
    assert sorted(one["val_losses"]) == [2, 4]
    for rank in pp:
        np.testing.assert_allclose(rank["losses"], one["losses"], rtol=1e-5, atol=0)
        np.testing.assert_allclose(rank["grad_norms"], one["grad_norms"], rtol=1e-5, atol=0)
        for step, loss in one["val_losses"].items():
            assert rank["val_losses"][step] == pytest.approx(loss, rel=1e-5)
