"""Every attention kernel against the rule, written here from position ids with plain loops.

Outputs and the q, k, v gradients of `attend` in each mode equal a softmax over the masked
scores in plain torch (fp32, within 1e-5) on packed batches: many short documents, one
document spanning the sample, documents of length 1, a first document continuing from the
previous sample, and query rows in runs (context parallelism). GQA throughout (4 query
heads on 2 key/value heads). `segments` runs with its packing bound at the default and at 8
rows, so that at these tiny lengths it takes every branch (long causal documents, packed short
ones, a long document continuing into a run of rows: one call without a mask on CPU).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hp_runtime.model import Transformer, attention, preset
from hp_runtime.model.attention import Layout, attend, block_mask, dense_mask, document_ids

HEADS, KV_HEADS, DIM = 4, 2, 8


@functools.cache
def _rule(position_ids: tuple[tuple[int, ...], ...], rows: tuple[int, ...]) -> torch.Tensor:
    mask = torch.zeros(len(position_ids), 1, len(rows), len(position_ids[0]), dtype=torch.bool)
    for b, sample in enumerate(position_ids):
        for i, row in enumerate(rows):
            start = row  # back to the row's document start: a 0, or the sample's first token
            while start > 0 and sample[start] != 0:
                start -= 1
            mask[b, 0, i, start : row + 1] = True
    return mask


def rule(position_ids: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """(b, 1, len(rows), s): key j is seen by row r when j <= r and no document starts in
    (j, r] (a position id of 0 starts one)."""
    return _rule(tuple(map(tuple, position_ids.tolist())), tuple(rows))


def reference(q, k, v, mask):
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def positions(lengths: list[list[int]], first: int = 0) -> torch.Tensor:
    """Position ids of samples packed from documents of these lengths; the first document of
    each sample starts at position `first` (above 0: it continues from the previous one)."""
    rows = []
    for sample in lengths:
        ids = [torch.arange(n) + (first if i == 0 else 0) for i, n in enumerate(sample)]
        rows.append(torch.cat(ids))
    return torch.stack(rows)


SEQ = 48
CASES = {
    "many-short": positions([[3, 1, 5, 2, 7, 4, 1, 6, 3, 9, 2, 5], [6, 6, 6, 6, 6, 6, 6, 6]]),
    "one-document": positions([[SEQ], [SEQ]]),
    "length-one": positions([[1] * SEQ, [1, 1, 30, 1, 1, 14]]),
    "continues": positions([[20, 1, 27], [40, 8]], first=17),
    "long-and-short": positions([[30, 1, 1, 2, 14], [2, 44, 2]]),
}
TWO_CHUNKS = list(range(6, 18)) + list(range(30, 42))  # runs starting inside documents
# The query rows a rank holds: None (all, in order); chunks as context parallelism gives them
# (rank 0 of 2: the first and the last of 4 chunks); and runs in other orders.
ROWS = {
    "all-rows": None,
    "two-chunks": TWO_CHUNKS,
    "cp-rank-0": list(range(0, 12)) + list(range(36, 48)),
    "reversed": list(range(30, 42)) + list(range(6, 18)),
}


def _inputs(batch: int, rows: int, generator: torch.Generator):
    q = torch.randn(batch, HEADS, rows, DIM, generator=generator)
    k = torch.randn(batch, KV_HEADS, SEQ, DIM, generator=generator)
    v = torch.randn(batch, KV_HEADS, SEQ, DIM, generator=generator)
    grad = torch.randn(batch, HEADS, rows, DIM, generator=generator)
    return q, k, v, grad


def _run(fn, q, k, v, grad):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.fixture(params=[attention.SEGMENT_ROWS, 8], ids=["segment-256", "segment-8"])
def segment_rows(request, monkeypatch):
    monkeypatch.setattr(attention, "SEGMENT_ROWS", request.param)
    return request.param


@pytest.mark.parametrize("mode", ["segments", "sdpa", "auto"])
@pytest.mark.parametrize("held", list(ROWS))
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_equal_the_rule_with_gradients(mode, held, case, segment_rows):
    position_ids = CASES[case]
    rows = ROWS[held] or list(range(SEQ))
    q, k, v, grad = _inputs(position_ids.shape[0], len(rows), torch.Generator().manual_seed(0))
    mask = rule(position_ids, rows)
    layout = Layout(
        mode=mode,
        documents=document_ids(position_ids),
        rows=None if ROWS[held] is None else torch.tensor(rows),
    )
    got, got_grads = _run(lambda q, k, v: attend(q, k, v, layout), q, k, v, grad)
    want, want_grads = _run(lambda q, k, v: reference(q, k, v, mask), q, k, v, grad)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("mode", ["segments", "sdpa", "auto"])
def test_rows_without_documents_are_causal_on_global_rows(mode, segment_rows):
    """Context parallelism without document masking: row r sees keys 0..r, not 0..i."""
    q, k, v, grad = _inputs(2, len(TWO_CHUNKS), torch.Generator().manual_seed(1))
    mask = rule(torch.arange(SEQ).expand(2, SEQ), TWO_CHUNKS)
    layout = Layout(mode=mode, rows=torch.tensor(TWO_CHUNKS))
    got, got_grads = _run(lambda q, k, v: attend(q, k, v, layout), q, k, v, grad)
    want, want_grads = _run(lambda q, k, v: reference(q, k, v, mask), q, k, v, grad)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("held", list(ROWS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_equals_the_rule_on_cpu(held, case):
    """CPU FlexAttention has no backward in torch 2.15 (inputs must not require grad): the
    forward only, eager."""
    position_ids = CASES[case]
    rows = ROWS[held] or list(range(SEQ))
    q, k, v, _ = _inputs(position_ids.shape[0], len(rows), torch.Generator().manual_seed(2))
    layout = Layout(
        mode="flex",
        documents=document_ids(position_ids),
        rows=None if ROWS[held] is None else torch.tensor(rows),
    )
    want = reference(q, k, v, rule(position_ids, rows))
    torch.testing.assert_close(attend(q, k, v, layout), want, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_without_documents_is_causal_on_global_rows():
    q, k, v, _ = _inputs(2, len(TWO_CHUNKS), torch.Generator().manual_seed(5))
    want = reference(q, k, v, rule(torch.arange(SEQ).expand(2, SEQ), TWO_CHUNKS))
    got = attend(q, k, v, Layout(mode="flex", rows=torch.tensor(TWO_CHUNKS)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dense_mask_is_the_rule():
    """The reference the other tests of the runtime use, against the loops above."""
    for position_ids in CASES.values():
        for rows in (list(range(SEQ)), TWO_CHUNKS):
            got = dense_mask(document_ids(position_ids), torch.tensor(rows), SEQ)
            assert torch.equal(got, rule(position_ids, rows))


@pytest.mark.parametrize("held", list(ROWS))
def test_block_mask_tiles_are_exact(monkeypatch, held):
    """Full tiles hold only allowed pairs, skipped tiles none, partial tiles some: the block
    mask skips every tile it can and never one it must not (tiles of 4 at this length)."""
    monkeypatch.setattr(attention, "FLEX_BLOCK", 4)
    position_ids = torch.cat([CASES["many-short"], CASES["continues"], CASES["length-one"]])
    rows = ROWS[held] or list(range(SEQ))
    mask = rule(position_ids, rows)[:, 0]
    made = block_mask(
        document_ids(position_ids),
        None if ROWS[held] is None else torch.tensor(rows),
        SEQ,
        torch.device("cpu"),
    )
    partial = _tile_set(made.kv_num_blocks, made.kv_indices)
    full = _tile_set(made.full_kv_num_blocks, made.full_kv_indices)
    tiles = mask.unflatten(1, (-1, 4)).unflatten(3, (-1, 4)).transpose(2, 3)  # b, qt, kt, 4, 4
    assert full.any() and partial.any()
    assert not (full & partial).any()
    assert torch.equal(tiles.all(-1).all(-1), full)
    assert torch.equal(tiles.any(-1).any(-1), full | partial)


def _tile_set(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    batch, _, q_tiles, k_tiles = indices.shape
    out = torch.zeros(batch, q_tiles, k_tiles, dtype=torch.bool)
    for b in range(batch):
        for i in range(q_tiles):
            out[b, i, indices[b, 0, i, : counts[b, 0, i]].long()] = True
    return out


def test_segments_builds_no_mask_over_the_sequence(monkeypatch):
    """Masks only for packed calls: at most SEGMENT_ROWS rows each, never rows x s."""
    monkeypatch.setattr(attention, "SEGMENT_ROWS", 8)
    shapes = []
    real = attention.dense_mask

    def recording(documents, rows, keys):
        shapes.append((rows.shape[0], keys))
        return real(documents, rows, keys)

    monkeypatch.setattr(attention, "dense_mask", recording)
    position_ids = torch.cat([CASES["long-and-short"], CASES["one-document"]])
    q, k, v, _ = _inputs(4, SEQ, torch.Generator().manual_seed(3))
    attend(q, k, v, Layout(mode="segments", documents=document_ids(position_ids)))
    assert shapes and max(r for r, _ in shapes) <= 8 and max(c for _, c in shapes) <= 16


def test_auto_picks_by_batch_and_device(monkeypatch):
    documents = document_ids(CASES["many-short"])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention.kernel_name(Layout(), cpu) == "causal"
    assert attention.kernel_name(Layout(mode="flex"), cuda) == "causal"
    assert attention.kernel_name(Layout(documents=documents), cpu) == "segments"
    assert attention.kernel_name(Layout(rows=torch.arange(4)), cuda) == "flex"
    assert attention.kernel_name(Layout(mode="sdpa", documents=documents), cuda) == "sdpa"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert attention.kernel_name(Layout(documents=documents), cpu) == "sdpa"


@pytest.mark.parametrize("mode", ["segments", "auto"])
def test_model_gradients_equal_the_dense_mask(mode, segment_rows):
    """Every parameter's gradient through the Transformer (GQA, document masking, a document
    continuing from the previous sample) equals the dense-mask run's."""
    position_ids = torch.cat([CASES["continues"], CASES["many-short"]])
    tokens = torch.randint(0, 256, position_ids.shape, generator=torch.Generator().manual_seed(4))
    grads = {}
    for name in (mode, "sdpa"):
        torch.manual_seed(0)
        model = Transformer(preset("tiny", attention=name))
        model(tokens, position_ids, document_ids(position_ids)).square().mean().backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    for n, want in grads["sdpa"].items():
        torch.testing.assert_close(grads[mode][n], want, atol=1e-5, rtol=1e-5, msg=n)
