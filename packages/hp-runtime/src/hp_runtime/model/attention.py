"""Causal attention that stays inside documents, and the one rule every kernel implements.

Query row i (the sequence's row `rows[i]`, or i when all rows are local) attends key j when
j <= rows[i] and both lie in the same document. Documents are numbered from position ids that
restart at 0 at each document start (`document_ids`); without them a sample is one document.
`rows` exists for context parallelism, where a rank holds some query rows and every key.

Kernels (`model.attention`): with nothing to mask (no documents, no rows) every mode runs
causal SDPA. Else "sdpa" hands SDPA the rule as a dense (rows x keys) mask, O(s²) memory;
"segments" runs causal SDPA per document (short neighbours packed into one small masked call),
exact, with no mask over the sequence, but it reads the document boundaries on the host;
"flex" runs FlexAttention on a block mask built from the boundaries on the device (compiled on
CUDA; on CPU torch has its forward only, eager); "auto" is flex on CUDA, segments elsewhere.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hp_runtime.model.config import MODES  # noqa: F401  (the names, kept torch-free there)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

# segments: documents up to this many rows are packed into one SDPA call with a mask of its
# own; longer ones run alone, causal, without a mask. Bounds both the calls and the masks.
SEGMENT_ROWS = 256
FLEX_BLOCK = 128  # FlexAttention's tile: a block mask marks (FLEX_BLOCK x FLEX_BLOCK) tiles


@dataclass(frozen=True)
class Layout:
    """What attention needs of a batch besides q, k and v. `positions` (b or 1, r) rotate q
    and k; `documents` (b, s) number the document of every key (None: one document a sample);
    `rows` (r,) are the global rows of the local queries (None: all s rows, in order). Fields
    left None are filled where the sequence is whole (inside attention, after SP gathers)."""

    mode: str = "auto"
    positions: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    rows: torch.Tensor | None = None


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) the number of the document each token lies in, from position ids restarting at 0
    at every document start. A row's first document may continue from the previous sample
    (it starts above 0): it is still a document of its own."""
    return (position_ids == 0).cumsum(dim=-1)


def documents_after_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(b, s) document numbers where a document ends at each `eod` token (which belongs to the
    document it ends): Megatron's `reset_attention_mask`, whatever the position ids."""
    ends = tokens == eod
    return ends.cumsum(dim=-1) - ends.long()


def dense_mask(documents: torch.Tensor | None, rows: torch.Tensor, keys: int) -> torch.Tensor:
    """The rule as a boolean (b or 1, 1, len(rows), keys) mask, True = attend: the reference
    every kernel is tested against. O(rows x keys) memory."""
    causal = torch.arange(keys, device=rows.device).unsqueeze(0) <= rows.unsqueeze(1)
    if documents is None:
        return causal[None, None]
    same = documents[:, rows].unsqueeze(-1) == documents.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


def kernel_name(layout: Layout, device: torch.device) -> str:
    """The kernel `attend` runs: "causal" where there is nothing to mask, else the mode, with
    "auto" resolved by device (segments reads the host, which a compiled graph cannot: the
    dense mask there)."""
    if layout.documents is None and layout.rows is None:
        return "causal"
    if layout.mode != "auto":
        return layout.mode
    if device.type == "cuda":
        return "flex"
    return "sdpa" if torch.compiler.is_compiling() else "segments"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """softmax(q kᵀ / √d) v under the rule above; q (b, h, r, d), k and v (b, h_kv, s, d)
    with h a multiple of h_kv (grouped-query attention: kernels share k and v as they can)."""
    name = kernel_name(layout, q.device)
    if name == "flex":
        return flex(q, k, v, layout)
    if name == "segments":
        return segments(q, k, v, layout)
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if name == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = layout.rows if layout.rows is not None else torch.arange(q.shape[2], device=q.device)
    mask = dense_mask(layout.documents, rows, k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# --- segments: causal SDPA per document, planned on the host ---


def _runs(rows: torch.Tensor | None, count: int) -> list[tuple[int, int]]:
    """(first, end) global rows of each contiguous run of the `count` query rows, in order."""
    if rows is None:
        return [(0, count)]
    breaks = (torch.nonzero(rows[1:] != rows[:-1] + 1).flatten() + 1).tolist()  # host sync
    bounds = [0, *breaks, count]
    firsts = rows[bounds[:-1]].tolist()
    return [
        (first, first + stop - start)
        for start, stop, first in zip(bounds[:-1], bounds[1:], firsts, strict=True)
    ]


def _starts(documents: torch.Tensor | None, keys: int) -> list[int]:
    """The rows where a document starts in one sample's (s,) document ids, and `keys`."""
    if documents is None:
        return [0, keys]
    changes = torch.nonzero(documents[1:] != documents[:-1]).flatten() + 1
    return [0, *changes.tolist(), keys]  # host sync


def _blocks(
    starts: list[int], runs: list[tuple[int, int]], bottom_right: bool = False
) -> list[tuple[int, int, int, bool]]:
    """SDPA calls covering the query rows in local order: (first row, end row, first key,
    causal), global rows; a call's keys run from its first key to its end row. `causal`: one
    document, its rows the last of its keys, no mask needed: square, from the document's
    start, or with `bottom_right` also a document continuing into the run (`_BottomRight`);
    else the call takes a mask."""
    blocks = []
    for row, stop in runs:
        doc = bisect.bisect_right(starts, row) - 1  # the document holding `row`
        while row < stop:
            while starts[doc + 1] <= row:
                doc += 1
            begin, end = starts[doc], min(starts[doc + 1], stop)
            if (begin == row or bottom_right) and end - row > SEGMENT_ROWS:
                blocks.append((row, end, begin, True))
                row = end
                continue
            last, cut = doc, min(end, row + SEGMENT_ROWS)
            while cut == starts[last + 1] < stop:  # pack the next documents that fit
                after = min(starts[last + 2], stop)
                if after - row > SEGMENT_ROWS:
                    break
                last, cut = last + 1, after
            blocks.append((row, cut, begin, begin == row and last == doc and cut == end))
            row = cut
    return blocks


def _spans(x: torch.Tensor, bounds: list[int]) -> Callable[[int, int], torch.Tensor]:
    """A function giving rows [start, stop) of x (dim 2), both among `bounds`: x is split
    there once, not sliced per call, so the backward writes each row's gradient once."""
    sizes = [stop - start for start, stop in itertools.pairwise(bounds)]
    pieces, index = x.split(sizes, dim=2), {bound: i for i, bound in enumerate(bounds)}

    def span(start: int, stop: int) -> torch.Tensor:
        inside = pieces[index[start] : index[stop]]
        return inside[0] if len(inside) == 1 else torch.cat(inside, dim=2)

    return span


class _BottomRight(torch.autograd.Function):
    """Causal attention of rows that are the last of their keys (b, h, r, d) over (b, h_kv,
    n, d): row i sees keys up to n - r + i, as in a document that continues into a run of
    rows. Without a mask (CPU): the keys before the first row, seen by every row, and the
    square after it, causal, in two flash calls merged by their logsumexps; the backward
    gives each part the merged output and logsumexp, which is exact (the ring-attention
    identity). torch's SDPA returns no logsumexp, hence its CPU flash kernels (the ones SDPA
    itself runs here, and torch's own context-parallel attention calls)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        repeat, past = q.shape[1] // k.shape[1], k.shape[2] - q.shape[2]
        kr, vr = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        seen, seen_lse = flash(q, kr[:, :, :past], vr[:, :, :past])
        square, square_lse = flash(q, kr[:, :, past:], vr[:, :, past:], is_causal=True)
        lse = torch.logaddexp(seen_lse, square_lse)
        weights = (seen_lse - lse).exp().unsqueeze(-1), (square_lse - lse).exp().unsqueeze(-1)
        out = (seen * weights[0] + square * weights[1]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        repeat, past = q.shape[1] // k.shape[1], k.shape[2] - q.shape[2]
        kr, vr = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        parts = [
            backward(grad, q, kr[:, :, cut], vr[:, :, cut], out, lse, 0.0, causal)
            for cut, causal in ((slice(None, past), False), (slice(past, None), True))
        ]
        grad_q = parts[0][0] + parts[1][0]
        grad_k, grad_v = (torch.cat([p[i] for p in parts], dim=2) for i in (1, 2))
        fold = (k.shape[0], k.shape[1], repeat, *k.shape[2:])  # each kv head's query heads
        return grad_q, grad_k.view(fold).sum(2), grad_v.view(fold).sum(2)


def _segment_sample(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None,
    runs: list[tuple[int, int]],
) -> torch.Tensor:
    """`segments` for one sample's q, k, v (1, ., ., d) and (s,) document ids, or for a whole
    batch without documents."""
    keys = k.shape[2]
    blocks = _blocks(_starts(documents, keys), runs, bottom_right=q.device.type == "cpu")
    bounds = sorted({0, keys, *(b for _, end, begin, _ in blocks for b in (begin, end))})
    k_span, v_span = _spans(k, bounds), _spans(v, bounds)
    queries = q.split([end - row for row, end, _, _ in blocks], dim=2)  # blocks tile q's rows
    outs = []
    for (row, end, begin, causal), query in zip(blocks, queries, strict=True):
        key, value = k_span(begin, end), v_span(begin, end)
        if causal and begin == row:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        elif causal:
            out = _BottomRight.apply(query, key, value)
        else:
            block_documents = None if documents is None else documents[None, begin:end]
            rows = torch.arange(row - begin, end - begin, device=q.device)
            mask = dense_mask(block_documents, rows, end - begin)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The rule without a mask over the sequence: causal SDPA per document, short neighbours
    packed into calls of up to SEGMENT_ROWS rows with a mask of their own, a longer document
    that continues into a run of rows from before it (context parallelism's rows) in one call
    without a mask on CPU (`_BottomRight`), in calls of that many masked rows elsewhere. Reads
    document and row boundaries on the host (a sync per call on a GPU): the CPU path."""
    runs = _runs(layout.rows, q.shape[2])
    if layout.documents is None:
        return _segment_sample(q, k, v, None, runs)
    samples = zip(q.split(1), k.split(1), v.split(1), layout.documents, strict=True)
    return torch.cat([_segment_sample(*sample, runs) for sample in samples])


# --- flex: FlexAttention on a block mask built on the device ---


def _tiles(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of `size` along the last dim: (min, max); the last tile padded with its own
    last value, so padding changes neither."""
    pad = -x.shape[-1] % size
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    x = x.unflatten(-1, (-1, size))
    return x.amin(-1), x.amax(-1)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (b, 1, q tiles, kv tiles) boolean tile mask as BlockMask's (counts, indices)."""
    dense = blocks.to(torch.int32)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1).to(torch.int32), order.to(torch.int32)


def block_mask(
    documents: torch.Tensor | None, rows: torch.Tensor | None, keys: int, device: torch.device
) -> BlockMask:
    """The rule as a FlexAttention BlockMask over (len(rows), keys), built from per-tile
    minima and maxima of rows and document ids: O(s) work and O((s/128)²) tiles, no dense
    mask, no host sync. Document ids never decrease along the keys, so a tile pair whose id
    ranges overlap shares a document; a tile is full when every key precedes every row and
    all ids are one."""
    from torch.nn.attention.flex_attention import BlockMask

    key_index = torch.arange(keys, device=device)
    query_rows = rows if rows is not None else key_index
    count = query_rows.shape[0]
    row_min, row_max = _tiles(query_rows, FLEX_BLOCK)
    key_min, key_max = _tiles(key_index, FLEX_BLOCK)
    some = key_min[None, :] <= row_max[:, None]
    full = key_max[None, :] <= row_min[:, None]
    whole_rows = torch.arange(row_min.shape[0], device=device) < count // FLEX_BLOCK
    whole_keys = torch.arange(key_min.shape[0], device=device) < keys // FLEX_BLOCK
    full = full & whole_rows[:, None] & whole_keys[None, :]  # padded tiles stay partial
    if documents is None:
        some, full = some[None], full[None]
    else:
        doc_min, doc_max = _tiles(documents if rows is None else documents[:, rows], FLEX_BLOCK)
        key_doc_min, key_doc_max = _tiles(documents, FLEX_BLOCK)
        lo, hi = doc_min[:, :, None], doc_max[:, :, None]
        key_lo, key_hi = key_doc_min[:, None, :], key_doc_max[:, None, :]
        some = some & (lo <= key_hi) & (key_lo <= hi)
        full = full & (lo == hi) & (key_lo == key_hi) & (lo == key_lo)

    def mask_mod(b, h, q_idx, kv_idx):  # torch's signature: index tensors
        row = q_idx if rows is None else rows[q_idx]
        allowed = kv_idx <= row
        if documents is not None:
            allowed = allowed & (documents[b, row] == documents[b, kv_idx])
        return allowed

    partial_counts, partial_order = _ordered((some & ~full)[:, None])
    full_counts, full_order = _ordered(full[:, None])
    return BlockMask.from_kv_blocks(
        partial_counts,
        partial_order,
        full_counts,
        full_order,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(count, keys),
    )


_compiled_flex = None


def _flex_attention(device: torch.device) -> Callable[..., torch.Tensor]:
    """flex_attention: compiled once on CUDA (torch.compile keeps one graph per shape, so a
    run's fixed shapes compile once and a new shape once more); eager elsewhere and inside a
    graph being compiled (the enclosing compile takes it in)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The rule by FlexAttention. On CPU torch 2.15 has the forward only (inputs must not
    require grad); CUDA has both."""
    mask = block_mask(layout.documents, layout.rows, k.shape[2], q.device)
    kernel = _flex_attention(q.device)
    return kernel(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
