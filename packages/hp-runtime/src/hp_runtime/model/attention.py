"""Causal attention that stays inside documents, and the one rule every kernel implements.

Query row i (the sequence's row `rows[i]`, or i when all rows are local) attends key j when
j <= rows[i] and both lie in the same document. Documents are numbered from position ids that
restart at 0 at each document start (`document_ids`); without them a sample is one document.
`rows` exists for context parallelism, where a rank holds some query rows and every key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hp_runtime.model.config import MODES  # noqa: F401  (the names, kept torch-free there)


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


def dense_mask(documents: torch.Tensor | None, rows: torch.Tensor, keys: int) -> torch.Tensor:
    """The rule as a boolean (b or 1, 1, len(rows), keys) mask, True = attend: the reference
    every kernel is tested against. O(rows x keys) memory."""
    causal = torch.arange(keys, device=rows.device).unsqueeze(0) <= rows.unsqueeze(1)
    if documents is None:
        return causal[None, None]
    same = documents[:, rows].unsqueeze(-1) == documents.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """softmax(q kᵀ / √d) v under the rule above; q (b, h, r, d), k and v (b, h, s, d)."""
    if layout.documents is None and layout.rows is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = layout.rows
    if rows is None:
        rows = torch.arange(q.shape[2], device=q.device)
    mask = dense_mask(layout.documents, rows, k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
