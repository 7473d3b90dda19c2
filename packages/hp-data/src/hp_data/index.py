"""The pure index functions behind GPTDataset and BlendableDataset: arrays in, arrays out.

Each reproduces megatron-core 0.16 exactly (document, sample and shuffle indices from one
`numpy.random.RandomState` used in Megatron's order; the blending rule of
`helpers_cpp.build_blending_indices`) and returns int64 wherever a count can pass 2^31.
The two loops (the sample index, a merge of documents and sample boundaries; the blending
rule, sequential by nature) are compiled by numba on first use and cached, never at import.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hp_data.errors import HpDataError

SPLITS = ("train", "valid", "test")
FINAL_EPOCH_THRESHOLD = 0.80  # Megatron: a final epoch under 80% full is shuffled on its own


class IndexBuildError(HpDataError):
    """Index construction was asked for something impossible (no tokens, bad split, ...)."""


def _require_memory(nbytes: int, what: str) -> None:
    """Refuse, before allocating, index arrays larger than this machine's memory: a typo'd
    sample count would otherwise end in the OOM killer or hours of work."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform: nothing to check
        return
    if nbytes > memory:
        raise IndexBuildError(
            f"{what} need about {nbytes / 2**30:,.1f} GiB of index arrays, more than this "
            f"machine's {memory / 2**30:,.1f} GiB of memory; ask for fewer samples"
        )


# -- splits ---------------------------------------------------------------------------------


def parse_split(split: str | Sequence[float]) -> list[float]:
    """`"969,30,1"` (or numbers) -> normalised train/valid/test shares, as Megatron parses."""
    message = f"split {split!r}: give up to three non-negative shares, not all zero, e.g. 969,30,1"
    if isinstance(split, str):
        # megatron-core reads every run of digits and dots, so that "-1,2,3" is 1,2,3; hp
        # takes the same separators but refuses what is not a plain number.
        pieces = re.split(r"[\s,/]+", split.strip())
        if not all(re.fullmatch(r"\d+\.?\d*|\.\d+", piece) for piece in pieces):
            raise IndexBuildError(message)
    else:
        pieces = list(split)
    try:
        values = [float(v) for v in pieces]
    except (TypeError, ValueError):
        raise IndexBuildError(message) from None
    if (
        len(values) > len(SPLITS)
        or not all(math.isfinite(v) and v >= 0 for v in values)
        or not any(values)
    ):
        raise IndexBuildError(message)
    values += [0.0] * (len(SPLITS) - len(values))
    weights = np.array(values, dtype=np.float64)
    return (weights / weights.sum()).tolist()


def split_ranges(num_elements: int, split: Sequence[float]) -> list[tuple[int, int] | None]:
    """The `[begin, end)` element range of each split (None for a zero share), Megatron's
    book-ends rounded the same way."""
    ranges: list[tuple[int, int] | None] = []
    start = 0.0
    for share in split:
        end = start + share
        if end <= start:
            ranges.append(None)
        else:
            ranges.append((round(start * float(num_elements)), round(end * float(num_elements))))
        start = end
    return ranges


# -- epochs ---------------------------------------------------------------------------------


def num_epochs_for(
    tokens_per_epoch: int, num_samples: int | None, seq_length: int, add_extra_token: int
) -> int:
    """The fewest epochs that hold `num_samples` samples (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise IndexBuildError("the split holds no tokens; it cannot give any samples")
    needed = num_samples * seq_length + add_extra_token
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(
    num_epochs: int,
    tokens_per_epoch: int,
    num_samples: int | None,
    seq_length: int,
    add_extra_token: int,
) -> tuple[bool, int]:
    """Whether the last epoch is shuffled apart from the others (Megatron's 80% rule), and the
    number of samples before it."""
    if num_epochs == 1 or num_samples is None:
        return False, 0
    before = ((num_epochs - 1) * tokens_per_epoch - add_extra_token) // seq_length
    from_final = num_samples - before
    per_epoch = (tokens_per_epoch - add_extra_token) // seq_length
    return from_final < int(FINAL_EPOCH_THRESHOLD * per_epoch), before


# -- the three GPT indices ------------------------------------------------------------------


def build_document_index(
    documents: np.ndarray,
    num_epochs: int,
    rng: np.random.RandomState,
    separate_final_epoch: bool,
) -> np.ndarray:
    """`documents` repeated `num_epochs` times and shuffled (the last epoch apart when asked)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(np.asarray(documents, dtype=np.int64), num_epochs)
        rng.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def num_samples_in(
    num_epochs: int,
    tokens_per_epoch: int,
    seq_length: int,
    drop_last_partial_sequence: bool,
    add_extra_token: int,
) -> int:
    """How many samples the sample index holds, exactly as megatron-core's C++ counts them
    (including its float32 rounding when the partial last sample is kept)."""
    tokens = num_epochs * tokens_per_epoch - add_extra_token
    if tokens <= 0:
        return 0  # C++ integer division truncates (-1 / L == 0); Python's would floor
    if drop_last_partial_sequence:
        return tokens // seq_length
    return math.ceil(np.float32(np.float32(tokens) / np.float32(seq_length)))


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: int = 1,
) -> np.ndarray:
    """The (samples + 1, 2) int64 index of (position in document_index, token offset) where
    each sample starts; same arguments and numbers as megatron-core's `build_sample_idx`.

    Sample k spans flat tokens [k L, (k+1) L + extra) of the documents laid end to end in
    `document_index` order; its end is recorded in the document that holds its last token.
    One merge-like pass over documents and samples (numba); numpy's cumsum + searchsorted
    gives the same numbers but, in several passes, ran 3x slower than megatron's C++ loop.
    """
    if seq_length <= 1 or num_epochs <= 0:
        raise IndexBuildError(
            f"need seq_length > 1 and num_epochs > 0 (got {seq_length}, {num_epochs})"
        )
    extra = int(add_extra_token)
    count = num_samples_in(
        num_epochs, tokens_per_epoch, seq_length, drop_last_partial_sequence, extra
    )
    index = np.empty((count + 1, 2), dtype=np.int64)
    index[0] = 0
    _kernel(_sample_index_loop)(
        np.asarray(sizes), np.asarray(document_index), seq_length, extra, count, index
    )
    return index


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """`[0, num_samples)` shuffled, then `[num_samples, total_size)` shuffled apart (int64)."""
    first = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sizes: np.ndarray,
    documents: np.ndarray,
    seq_length: int,
    num_samples: int | None,
    seed: int,
    add_extra_token: bool = True,
    drop_last_partial_sequence: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle indices of one GPTDataset split, in Megatron's order.

    `sizes` are the sequence lengths of the corpus, `documents` the sequence ids of the split,
    `num_samples` None for one epoch.
    """
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.asarray(sizes)[documents].sum(dtype=np.int64))
    epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length, extra)
    samples = epochs * tokens_per_epoch // seq_length + 1
    _require_memory(
        epochs * len(documents) * 8 + samples * 24,
        f"{num_samples or samples:,} samples ({epochs:,} epochs of {len(documents):,} documents)",
    )
    separate, before = separate_final_epoch(
        epochs, tokens_per_epoch, num_samples, seq_length, extra
    )
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(
        sizes,
        document_index,
        seq_length,
        epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        extra,
    )
    total = len(sample_index) - 1
    shuffle_index = build_shuffle_index(before if separate else total, total, rng)
    return document_index, sample_index, shuffle_index


# -- blending -------------------------------------------------------------------------------

_kernels: dict[Any, Any] = {}


def _kernel(function: Callable[..., None]) -> Callable[..., None]:
    """`function` compiled by numba the first time it is needed (and cached on disk)."""
    if function not in _kernels:
        import numba

        _kernels[function] = numba.njit(cache=True, nogil=True)(function)
    return _kernels[function]


def _sample_index_loop(sizes, document_index, seq_length, extra, count, out):  # pragma: no cover
    k = 1
    start = 0  # flat position of the current document's first token
    for position in range(len(document_index)):
        if k > count:
            break
        end = start + sizes[document_index[position]]
        # Sample k ends here when its last token, k L + extra - 1, lies before `end`.
        while k <= count and k * seq_length + extra <= end:
            out[k, 0] = position
            out[k, 1] = k * seq_length - start
            k += 1
        start = end
    if k <= count:  # a kept partial sample runs out of documents: megatron's end marker
        last = sizes[document_index[len(document_index) - 1]] - extra
        while k <= count:
            out[k, 0] = len(document_index) - 1
            out[k, 1] = last
            k += 1


def _blend_loop(weights, size, dataset_index, dataset_sample_index):  # pragma: no cover
    # Counts kept as float64 (exact below 2^53) spare a conversion per comparison.
    counts = np.zeros(len(weights), dtype=np.float64)
    for i in range(size):
        scale = max(float(i), 1.0)
        best = 0
        best_error = weights[0] * scale - counts[0]
        for k in range(1, len(weights)):
            error = weights[k] * scale - counts[k]
            if error > best_error:
                best_error = error
                best = k
        dataset_index[i] = best
        dataset_sample_index[i] = np.int64(counts[best])
        counts[best] += 1.0


def build_blending_indices(
    weights: Sequence[float] | np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(dataset_index int16, dataset_sample_index int64)` of `size` blended samples.

    Megatron's largest-error rule: sample i goes to the first dataset with the largest
    `w_k * max(i, 1) - count_k`; per-dataset sample ids run 0, 1, 2, ... . The weights are used
    as given (float64), as `helpers_cpp.build_blending_indices` uses them.
    """
    weights_array = np.ascontiguousarray(weights, dtype=np.float64)
    if weights_array.ndim != 1 or not 0 < len(weights_array) < 32767:
        raise IndexBuildError(f"need between 1 and 32766 weights, got {weights_array.shape}")
    _require_memory(size * 10, f"{size:,} blended samples")
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    if size:
        _kernel(_blend_loop)(weights_array, size, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index
