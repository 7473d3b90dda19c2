"""The pure index functions behind GPTDataset and BlendableDataset: arrays in, arrays out.

Each reproduces megatron-core 0.16 exactly, values and dtypes (document, sample and shuffle
indices from one `numpy.random.RandomState` used in Megatron's order; the blending rule of
`helpers_cpp.build_blending_indices`): int32/uint32 where the values fit, int64 past that.
Everything is numpy except the blending rule, sequential by nature, which large blends run
compiled by numba (on first use, cached on disk; never at import, never for small blends).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


# -- dtypes ---------------------------------------------------------------------------------
# The arrays are held and saved in megatron-core's dtypes: the narrow one wherever the values
# fit. Values never depend on the dtype; readers take `.item()`/`int()` of them, and any
# arithmetic that can pass 2^31 (flat token positions, offsets times itemsize) is done in
# int64 or Python ints at the point where it happens.

INT32_MAX = int(np.iinfo(np.int32).max)
UINT32_MAX = int(np.iinfo(np.uint32).max)


def document_index_dtype(max_document: int) -> np.dtype:
    """int32 (megatron-core's `astype(numpy.int32)`), or int64 when a document id passes
    2^31 - 1, where megatron's cast would wrap it."""
    return np.dtype(np.int32 if max_document <= INT32_MAX else np.int64)


def sample_index_dtype(document_index_length: int, max_size: int) -> np.dtype:
    """megatron-core's `helpers.build_sample_idx` choice between its int32 and int64 C++
    variants: int32 when `max(len(document_index), sizes.max())` fits."""
    return np.dtype(np.int32 if max(document_index_length, max_size) <= INT32_MAX else np.int64)


def shuffle_index_dtype(total_size: int) -> np.dtype:
    """megatron-core's `_build_shuffle_index`: uint32, int64 from `2**32 - 2` samples on."""
    return np.dtype(np.uint32 if total_size < UINT32_MAX - 1 else np.int64)


def _max_size(sizes: np.ndarray) -> int:
    """An upper bound of `sizes.max()` that is exact enough for the dtype rule: a corpus's
    int32 lengths fit by their dtype, with no pass over them."""
    if np.can_cast(sizes.dtype, np.int32) or len(sizes) == 0:
        return 0
    return int(sizes.max())


# -- the three GPT indices ------------------------------------------------------------------

Documents = np.ndarray | range
CHUNK = 1 << 15  # elements per pass of the chunked loops: a few arrays of it stay in L2


def _as_documents(documents: Documents) -> np.ndarray | range:
    """A unit-step range stays a range (no array of the split's ids is ever made)."""
    if isinstance(documents, range) and documents.step == 1:
        return documents
    return np.asarray(documents)


def _max_document(documents: np.ndarray | range) -> int:
    if len(documents) == 0:
        return 0
    if isinstance(documents, range):
        return documents[-1]
    return int(documents.max())


def _tokens_in(sizes: np.ndarray, documents: Documents) -> int:
    """The tokens of `documents`, summed in int64 without a copy of their sizes."""
    sizes, documents = np.asarray(sizes), _as_documents(documents)
    if isinstance(documents, range):
        return int(sizes[documents.start : documents.stop].sum(dtype=np.int64))
    return sum(
        int(np.take(sizes, documents[a : a + CHUNK]).sum(dtype=np.int64))
        for a in range(0, len(documents), CHUNK)
    )


def build_document_index(
    documents: Documents,
    num_epochs: int,
    rng: np.random.RandomState,
    separate_final_epoch: bool,
) -> np.ndarray:
    """`documents` repeated `num_epochs` times and shuffled (the last epoch apart when asked);
    megatron-core's `_build_document_index`, int32 unless a document id needs int64."""
    documents = _as_documents(documents)
    if not separate_final_epoch or num_epochs == 1:
        dtype = document_index_dtype(_max_document(documents))
        # Filled in place: no int64 grid (megatron's mgrid) and no copy of `documents`.
        document_index = np.empty(num_epochs * len(documents), dtype=dtype)
        if isinstance(documents, range):
            epoch = document_index[: len(documents)]
            for first in range(0, len(epoch), CHUNK):
                part = epoch[first : first + CHUNK]
                part[:] = np.arange(len(part), dtype=dtype)
                part += documents.start + first
            document_index.reshape(num_epochs, len(documents))[1:] = epoch
        else:
            document_index.reshape(num_epochs, len(documents))[:] = documents
        rng.shuffle(document_index)  # the same permutation whatever the dtype
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
    """The (samples + 1, 2) index of (position in document_index, token offset) where each
    sample starts; same arguments, numbers and dtype (int32, or int64 when a position or a
    size passes 2^31 - 1) as megatron-core's `helpers.build_sample_idx`.

    Sample k spans flat tokens [k L, (k+1) L + extra) of the documents laid end to end in
    `document_index` order; its end is recorded in the first document whose end reaches
    k L + extra (so empty documents there are skipped), at offset k L - (that document's
    start), which may equal the document's length when extra is 0. Computed with numpy
    alone (a cumulative sum of the sizes and a search of the sample ends, chunk by chunk):
    about as fast as megatron's C++ loop and with no compiler to load.
    """
    if seq_length <= 1 or num_epochs <= 0:
        raise IndexBuildError(
            f"need seq_length > 1 and num_epochs > 0 (got {seq_length}, {num_epochs})"
        )
    sizes, document_index = np.asarray(sizes), np.asarray(document_index)
    if not sizes.flags.owndata and len(document_index) * 2 > len(sizes):
        # Dense random reads of a memory-mapped file run several times slower (4 KiB pages)
        # than of a copy in memory: megatron copies here too.
        sizes = sizes.copy()
    extra = int(add_extra_token)
    count = num_samples_in(
        num_epochs, tokens_per_epoch, seq_length, drop_last_partial_sequence, extra
    )
    if count and not len(document_index):
        raise IndexBuildError(f"{tokens_per_epoch} tokens per epoch, but no documents")
    index = np.empty(
        (count + 1, 2), dtype=sample_index_dtype(len(document_index), _max_size(sizes))
    )
    index[0] = 0
    done = 0  # samples recorded so far: rows 1..done
    start = 0  # flat position of the chunk's first token
    for first in range(0, len(document_index), CHUNK):
        if done == count:
            break
        # (int64 before the sum: numpy's cumsum casting as it goes is twice as slow)
        lengths = np.take(sizes, document_index[first : first + CHUNK]).astype(np.int64)
        ends = np.cumsum(lengths)
        ends += start
        end = int(ends[-1])
        last = min((end - extra) // seq_length, count)  # the last sample ending here
        if last > done:
            # Sample k's last token is k L + extra - 1: it ends in the first document whose
            # end reaches k L + extra, at offset k L - that document's start.
            positions = np.arange(done + 1, last + 1, dtype=np.int64)
            positions *= seq_length
            inside = np.searchsorted(ends, positions + extra)
            starts = np.subtract(ends, lengths, out=ends)
            rows = index[done + 1 : last + 1]
            rows[:, 1] = positions - starts[inside]
            rows[:, 0] = inside + first
            done = last
        start = end
    if done < count:
        # A kept partial sample runs out of documents: megatron's end marker, the last
        # document at its length minus extra (-1 for an empty one, as the C++ gives).
        index[done + 1 :, 0] = len(document_index) - 1
        index[done + 1 :, 1] = int(sizes[document_index[-1]]) - extra
    return index


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """`[0, num_samples)` shuffled, then `[num_samples, total_size)` shuffled apart: megatron's
    `_build_shuffle_index`, uint32 unless `total_size` needs int64."""
    dtype = shuffle_index_dtype(total_size)
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass(frozen=True)
class GPTIndexPlan:
    """What one split's indices will be, known before building them: epochs, sample count,
    the final-epoch rule and each array's dtype (which the cache key records)."""

    tokens_per_epoch: int
    num_epochs: int
    separate_final_epoch: bool
    samples_before_final_epoch: int
    num_samples: int
    document_index_length: int
    dtypes: dict[str, str]

    def nbytes(self) -> int:
        """The bytes of the three arrays."""
        return (
            self.document_index_length * np.dtype(self.dtypes["document_index"]).itemsize
            + (self.num_samples + 1) * 2 * np.dtype(self.dtypes["sample_index"]).itemsize
            + self.num_samples * np.dtype(self.dtypes["shuffle_index"]).itemsize
        )


def plan_gpt_indices(
    sizes: np.ndarray,
    documents: Documents,
    seq_length: int,
    num_samples: int | None,
    add_extra_token: bool = True,
    drop_last_partial_sequence: bool = True,
) -> GPTIndexPlan:
    """The plan of `build_gpt_indices` for these arguments: one pass over the split's sizes."""
    extra = int(add_extra_token)
    sizes, documents = np.asarray(sizes), _as_documents(documents)
    tokens_per_epoch = _tokens_in(sizes, documents)
    epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length, extra)
    separate, before = separate_final_epoch(
        epochs, tokens_per_epoch, num_samples, seq_length, extra
    )
    count = num_samples_in(epochs, tokens_per_epoch, seq_length, drop_last_partial_sequence, extra)
    length = epochs * len(documents)
    dtypes = {
        "document_index": document_index_dtype(_max_document(documents)),
        "sample_index": sample_index_dtype(length, _max_size(sizes)),
        "shuffle_index": shuffle_index_dtype(count),
    }
    return GPTIndexPlan(
        tokens_per_epoch,
        epochs,
        separate,
        before,
        count,
        length,
        {name: dtype.name for name, dtype in dtypes.items()},
    )


def build_gpt_indices(
    sizes: np.ndarray,
    documents: Documents,
    seq_length: int,
    num_samples: int | None,
    seed: int,
    add_extra_token: bool = True,
    drop_last_partial_sequence: bool = True,
    plan: GPTIndexPlan | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle indices of one GPTDataset split, in Megatron's order.

    `sizes` are the sequence lengths of the corpus, `documents` the sequence ids of the split
    (a `range` for a contiguous split: no array of them is made), `num_samples` None for one
    epoch; `plan` is `plan_gpt_indices` of the same arguments, if already made.
    """
    extra = int(add_extra_token)
    if plan is None:
        plan = plan_gpt_indices(
            sizes, documents, seq_length, num_samples, add_extra_token, drop_last_partial_sequence
        )
    samples, epochs = num_samples or plan.num_samples, plan.num_epochs
    _require_memory(
        plan.nbytes(),
        f"{samples:,} samples ({epochs:,} epochs of {len(documents):,} documents)",
    )
    rng = np.random.RandomState(seed)
    document_index = build_document_index(
        documents, plan.num_epochs, rng, plan.separate_final_epoch
    )
    sample_index = build_sample_index(
        sizes,
        document_index,
        seq_length,
        plan.num_epochs,
        plan.tokens_per_epoch,
        drop_last_partial_sequence,
        extra,
    )
    total = len(sample_index) - 1
    cut = plan.samples_before_final_epoch if plan.separate_final_epoch else total
    shuffle_index = build_shuffle_index(cut, total, rng)
    return document_index, sample_index, shuffle_index


# -- blending -------------------------------------------------------------------------------

# Below this many (samples x datasets) the rule runs as plain Python: faster than loading
# numba (about 0.5 s in a fresh process), so small blends (the shipped example, tests) never
# import it.
PYTHON_BLEND_LIMIT = 1 << 18
# megatron-core's: dataset ids fit int16 (at most 32766 datasets), sample ids may not fit int32.
BLENDING_DTYPES = {"dataset_index": "int16", "dataset_sample_index": "int64"}

_kernels: dict[Any, Any] = {}


def _kernel(function: Callable[..., None]) -> Callable[..., None]:
    """`function` compiled by numba the first time it is needed (and cached on disk)."""
    if function not in _kernels:
        import numba

        _kernels[function] = numba.njit(cache=True, nogil=True)(function)
    return _kernels[function]


def _blend_loop(weights, size, counts, dataset_index, dataset_sample_index):  # pragma: no cover
    """Megatron's largest-error rule, once for both paths: numba compiles it over arrays for
    large blends; small ones run it as plain Python over lists, which is faster than numpy
    scalars. `counts` starts at zero, one per dataset, as float64 (exact below 2^53), which
    spares a conversion per comparison."""
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
        dataset_sample_index[i] = int(counts[best])
        counts[best] += 1.0


def build_blending_indices(
    weights: Sequence[float] | np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(dataset_index int16, dataset_sample_index int64)` of `size` blended samples, the
    dtypes of megatron-core's `helpers.build_blending_indices` arrays.

    Megatron's largest-error rule: sample i goes to the first dataset with the largest
    `w_k * max(i, 1) - count_k`; per-dataset sample ids run 0, 1, 2, ... . The weights are used
    as given (float64), as `helpers_cpp.build_blending_indices` uses them. The rule is
    sequential by nature: plain Python for small blends, numba (compiled once, cached on disk)
    for large ones.
    """
    weights_array = np.ascontiguousarray(weights, dtype=np.float64)
    if weights_array.ndim != 1 or not 0 < len(weights_array) < 32767:
        raise IndexBuildError(f"need between 1 and 32766 weights, got {weights_array.shape}")
    _require_memory(size * 10, f"{size:,} blended samples")
    dataset_index = np.zeros(size, dtype=BLENDING_DTYPES["dataset_index"])
    dataset_sample_index = np.zeros(size, dtype=BLENDING_DTYPES["dataset_sample_index"])
    if size * len(weights_array) <= PYTHON_BLEND_LIMIT:
        chosen, ids = [0] * size, [0] * size
        weights_list = weights_array.tolist()
        _blend_loop(weights_list, size, [0.0] * len(weights_list), chosen, ids)
        dataset_index[:] = chosen
        dataset_sample_index[:] = ids
    elif size:
        if _blend_loop not in _kernels:
            # The first large blend of a process: numba loads its cached code (about 0.5 s,
            # mostly holding the GIL) while this thread faults in the output pages (about as
            # long; numpy's fill lets go of the GIL), instead of one after the other.
            loader = threading.Thread(target=_load_blend_kernel)
            loader.start()
            dataset_index.fill(0)
            dataset_sample_index.fill(0)
            loader.join()
        counts = np.zeros(len(weights_array), dtype=np.float64)
        _kernel(_blend_loop)(weights_array, size, counts, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def _load_blend_kernel() -> None:
    """Import numba and load `_blend_loop`'s compiled code for the argument types it gets."""
    # A failure here (no numba) is raised again by the caller's own call, after the join.
    with contextlib.suppress(Exception):
        _kernel(_blend_loop)(
            np.zeros(1), 1, np.zeros(1), np.zeros(1, np.int16), np.zeros(1, np.int64)
        )
