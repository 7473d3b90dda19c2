"""The chunked cross-entropy (`model/loss.py`) against the computation it replaces: the whole
micro-batch's logits upcast to fp32 and `F.cross_entropy(..., reduction="sum")` on them.

Losses and every gradient within 1e-6 relative (fp32) on one process and PP 2 (the head's
gradients made in the forward), TP 2 with and without `loss_parallel` (recomputed), PP 2 with
tied embeddings, each on labels with IGNOREd tokens and chunks
that do not divide the sequence; the trainer's own losses (`eod_mask_loss`, the global-token
normalisation, validation) the same chunked and unchunked on one process and PP 2; and no
tensor with the vocabulary as its last dimension larger than one chunk, forward or backward.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hp_runtime.model import Transformer, preset
from hp_runtime.model.loss import IGNORE
from hp_runtime.parallel import ParallelDims, ParallelOptions, assemble, canonical_name
from hp_runtime.parallel.init import init_weights
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.distributed import run_ranks
from tests.helpers.train import corpus_overrides, train_ranks

BATCH, SEQ = 2, 24
RTOL = 1e-6


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (b, s) and labels with IGNORE at about a quarter of the positions."""
    generator = torch.Generator().manual_seed(5)
    data = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
    labels = data[:, 1:].clone()
    labels[torch.rand(BATCH, SEQ, generator=generator) < 0.25] = IGNORE
    labels[0, :3] = IGNORE
    return data[:, :-1], labels


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Today's loss: the whole micro-batch's logits in fp32, summed over the loss tokens."""
    return F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=IGNORE
    )


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _grads(modules: list[torch.nn.Module]) -> dict[str, np.ndarray]:
    return {
        canonical_name(name): _full(p.grad).detach().float().numpy().copy()
        for module in modules
        for name, p in module.named_parameters()
    }


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _assert_equal(got: tuple[float, dict], want: tuple[float, dict]) -> None:
    assert got[0] == pytest.approx(want[0], rel=RTOL)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert _relative(got[1][name], want[1][name]) < RTOL, name


def _step(model: torch.nn.Module, tokens, labels, chunk: int | None) -> tuple[float, dict]:
    """(loss, gradients) of one forward and backward: today's (chunk None) or chunked."""
    model.zero_grad(set_to_none=True)
    if chunk is None:
        loss = _reference(model(tokens), labels)
    else:
        loss = model(tokens, labels=labels, loss_chunk_tokens=chunk).sum()
    loss = _full(loss)
    loss.backward()
    return float(loss.detach()), _grads([model])


def _model(**overrides) -> Transformer:
    model = Transformer(preset("tiny", **overrides))
    init_weights(model, seed=3)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_one_process_equals_the_whole_sequence(tied):
    model = _model(tie_embeddings=tied)
    tokens, labels = _batch(model.config.vocab_size)
    want = _step(model, tokens, labels, None)
    for chunk in (0, 1, 10, 16, BATCH * SEQ, 10_000):  # 10: 5 positions, uneven; 1: one each
        _assert_equal(_step(model, tokens, labels, chunk), want)


def test_the_head_gradient_needs_one_weight_for_every_loss_token():
    """The head's gradient is made in the forward for a unit weight per token and scaled in
    the backward: a loss that weighs its tokens unevenly gets a NaN head gradient (which the
    step's non-finite check stops on), never a wrong one; the gradients below the head are
    exact; uneven weights on IGNOREd tokens (which have no gradient) change nothing."""
    model = _model()
    tokens, labels = _batch(model.config.vocab_size)
    ignored = labels == IGNORE
    for weights, fine in (
        (torch.where(ignored, 7.0, 0.5), True),  # even on the loss tokens
        (torch.linspace(0.5, 2.0, labels.numel()).view(labels.shape), False),
    ):
        model.zero_grad(set_to_none=True)
        (model(tokens, labels=labels, loss_chunk_tokens=10) * weights).sum().backward()
        got = _grads([model])
        model.zero_grad(set_to_none=True)
        logits = model(tokens).float()
        losses = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE
        )
        (losses.view(labels.shape) * weights).sum().backward()
        want = _grads([model])
        assert np.isnan(got["output.weight"]).all() != fine
        for name in want:
            if name != "output.weight" or fine:
                assert _relative(got[name], want[name]) < RTOL, name


def test_without_gradients_the_losses_are_the_same():
    """Validation and replay (no graph) take the same losses, and make no gradient."""
    model = _model(vocab_size=1000)
    tokens, labels = _batch(1000)
    with_graph = model(tokens, labels=labels, loss_chunk_tokens=8)
    with torch.no_grad(), _LogitsSized(model.config) as seen:
        without = model(tokens, labels=labels, loss_chunk_tokens=8)
    assert torch.equal(with_graph.detach(), without)
    assert seen.largest == 8 * 1000


def test_every_label_ignored_gives_zero_loss_and_gradients():
    model = _model()
    tokens, labels = _batch(model.config.vocab_size)
    loss, grads = _step(model, tokens, torch.full_like(labels, IGNORE), 8)
    assert loss == 0.0 and all(not g.any() for g in grads.values())


class _LogitsSized(TorchDispatchMode):
    """The largest tensor any op makes with the vocabulary as its last dimension, the head's
    weight seen transposed (dim, vocab) aside."""

    def __init__(self, config) -> None:
        super().__init__()
        self.vocab, self.weight = config.vocab_size, (config.dim, config.vocab_size)
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else (out,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
            if len(shape) > 1 and shape[-1] == self.vocab and shape != self.weight:
                self.largest = max(self.largest, value.numel())
        return out


def test_no_tensor_holds_more_than_one_chunk_of_logits():
    """Forward and backward (the recompute included); the whole-sequence loss is the control."""
    model = _model(vocab_size=1000)
    tokens, labels = _batch(1000)
    for chunk, bound in ((8, 8 * 1000), (None, BATCH * SEQ * 1000)):
        with _LogitsSized(model.config) as seen:
            _step(model, tokens, labels, chunk)
        assert seen.largest == bound, chunk


def test_bf16_logits_are_upcast_per_chunk():
    """bf16 parameters (FSDP's param dtype on GPU): the per-token losses are fp32 and equal
    today's bf16 loss; the gradients below the head are today's; the head's own gradient,
    summed over chunks in bf16, stays within bf16 rounding of the fp32 one."""
    fp32 = _model(vocab_size=1000)
    model = _model(vocab_size=1000).to(torch.bfloat16)
    tokens, labels = _batch(1000)
    truth = _step(fp32, tokens, labels, None)
    want = _step(model, tokens, labels, None)
    losses = model(tokens, labels=labels, loss_chunk_tokens=8)
    assert losses.dtype == torch.float32
    got = _step(model, tokens, labels, 8)
    assert got[0] == pytest.approx(want[0], rel=RTOL)
    for name, value in got[1].items():
        if name == "output.weight":
            assert _relative(value, truth[1][name]) < 2e-2
        else:
            assert _relative(value, want[1][name]) < RTOL, name


# --- TP 2 and PP 2 (warm gloo ranks) ------------------------------------------------------


def _tp_rank(rank: int, world: int, loss_parallel: bool, tied: bool) -> tuple:
    from torch.distributed.tensor.parallel import loss_parallel as vocabulary_parallel

    config = preset("tiny", tie_embeddings=tied)
    options = ParallelOptions(loss_parallel=loss_parallel)
    assembly = assemble(config, ParallelDims(tp=2), torch.device("cpu"), seed=3, options=options)
    tokens, labels = _batch(config.vocab_size)
    context = vocabulary_parallel() if loss_parallel else contextlib.nullcontext()
    with context:  # the backward too: loss_parallel's gradients
        return _step(assembly.model, tokens, labels, None), _step(
            assembly.model, tokens, labels, 10
        )


@pytest.mark.parametrize(("loss_parallel", "tied"), [(False, False), (True, False), (True, True)])
def test_tensor_parallel_equals_the_whole_sequence(loss_parallel, tied):
    for want, got in run_ranks(_tp_rank, 2, loss_parallel, tied):
        _assert_equal(got, want)


def _pp_rank(rank: int, world: int) -> tuple:
    from hp_runtime.parallel.pp import pipeline_step
    from hp_runtime.train.step import TokenLoss

    chunked = TokenLoss(torch.device("cpu"))

    def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Logits (b, s, vocab) without labels in the forward, per-token losses (b, s) with.
        return _reference(output, labels) if output.dim() == 3 else chunked(output, labels)

    config = preset("tiny", tie_embeddings=True)
    options = ParallelOptions(pp_schedule="1f1b", pp_microbatches=2)
    assembly = assemble(
        config, ParallelDims(pp=2), torch.device("cpu"), seed=3, options=options, loss_fn=loss_fn
    )
    tokens, labels = _batch(config.vocab_size)
    results = []
    for kwargs in (None, {"labels": labels, "loss_chunk_tokens": 10}):
        for module in assembly.modules:
            module.zero_grad(set_to_none=True)
        first, last = assembly.has_first_stage, assembly.has_last_stage
        loss = pipeline_step(
            assembly.schedule,
            assembly.stage_ids,
            assembly.total_stages,
            tokens if first else None,
            labels if last else None,
            2,
            kwargs=kwargs if last else None,
        )
        loss_value = float(loss) if loss is not None else 0.0
        results.append((loss_value, _grads(assembly.modules)))
    return tuple(results)


def test_pipeline_with_tied_embeddings_equals_the_whole_sequence():
    """Both stages' gradients (the tied head's on the last), before the tied copies' sum."""
    ranks = run_ranks(_pp_rank, 2)
    assert ranks[1][0][0] > 0  # the last stage reports the loss
    for want, got in ranks:
        _assert_equal(got, want)


# --- the trainer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_overrides(example_corpus, example_tokenizer, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return [
        *corpus_overrides(example_corpus, example_tokenizer, cache),
        "model.tie_embeddings=true",
        "model.max_seq_len=64",
        "data.seq_length=32",
        "data.eod_mask_loss=true",
        "data.split=80,20,0",
        "train.steps=3",
        "train.eval_interval=3",
        "train.eval_iters=1",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "optim.name=sgd",
        "optim.lr=0.5",
        "optim.decay_style=constant",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [[], ["parallel.pp=2", "parallel.pp_schedule=gpipe"], ["parallel.dp_shard=2"]],
    ids=["one-process", "pp2", "fsdp2"],
)
def test_the_trainer_gives_the_same_losses_chunked(trainer_overrides, layout, tmp_path):
    """Chunks of 6 tokens (3 positions of each of 2 samples: 11 chunks a micro-batch) against
    the whole micro-batch at once: train and validation losses, gradient norms. Under FSDP the
    head's weight is gathered for the forward, freed, and gathered again for the backward,
    whose recompute must find it."""
    runs = []
    for chunk in (0, 6):
        run_dir = tmp_path / f"run{chunk}"
        overrides = [
            *trainer_overrides,
            *layout,
            f"train.loss_chunk_tokens={chunk}",
            f"train.run_dir={run_dir}",
        ]
        runs.append(train_ranks(2 if layout else 1, overrides)[-1])
    whole, chunked = runs
    assert len(whole["losses"]) == 3 and whole["val_losses"]
    np.testing.assert_allclose(chunked["losses"], whole["losses"], rtol=RTOL, atol=0)
    np.testing.assert_allclose(chunked["grad_norms"], whole["grad_norms"], rtol=RTOL, atol=0)
    for step, value in whole["val_losses"].items():
        assert chunked["val_losses"][step] == pytest.approx(value, rel=RTOL)
