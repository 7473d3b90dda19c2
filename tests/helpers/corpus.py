"""Seeded random corpora and the two ways to write them (hp and megatron-core)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hp_data import IndexedDatasetBuilder


@dataclass
class Corpus:
    """Documents as lists of sequences, with a mode per sequence."""

    dtype: np.dtype
    documents: list[list[np.ndarray]]
    modes: list[list[int]]

    @property
    def sequences(self) -> list[np.ndarray]:
        return [sequence for document in self.documents for sequence in document]

    @property
    def flat_modes(self) -> list[int]:
        return [mode for document in self.modes for mode in document]

    def document_tokens(self, d: int) -> np.ndarray:
        parts = self.documents[d]
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)


def random_corpus(
    seed: int, dtype: type = np.uint16, max_documents: int = 30, max_length: int = 60
) -> Corpus:
    """Documents of 0-4 sequences, some of length 0, ids over the dtype's whole range."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        draw = lambda n: rng.standard_normal(n).astype(dtype)  # noqa: E731
    else:
        info = np.iinfo(dtype)
        draw = lambda n: rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)  # noqa: E731
    documents, modes = [], []
    for _ in range(int(rng.integers(0, max_documents + 1))):
        count = int(rng.integers(0, 5))
        lengths = rng.integers(0, max_length + 1, count)
        lengths[rng.random(count) < 0.15] = 0
        documents.append([draw(int(n)) for n in lengths])
        modes.append([int(m) for m in rng.integers(-3, 4, count)])
    return Corpus(dtype, documents, modes)


def write_with_hp(prefix: str, corpus: Corpus, multimodal: bool = False, per_item: bool = True):
    """Write `corpus` with hp's builder, sequence by sequence or document by document."""
    with IndexedDatasetBuilder(prefix, corpus.dtype, multimodal=multimodal) as builder:
        for document, modes in zip(corpus.documents, corpus.modes, strict=True):
            if per_item:
                for sequence, mode in zip(document, modes, strict=True):
                    builder.add_item(sequence, mode)
                builder.end_document()
            else:
                tokens = np.concatenate(document) if document else np.empty(0, corpus.dtype)
                builder.add_document(tokens, [len(s) for s in document], modes)
    return prefix


def write_with_megatron(prefix: str, corpus: Corpus, multimodal: bool = False):
    """Write `corpus` with megatron-core's IndexedDatasetBuilder, sequence by sequence."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder

    builder = MegatronBuilder(prefix + ".bin", dtype=corpus.dtype.type, multimodal=multimodal)
    for document, modes in zip(corpus.documents, corpus.modes, strict=True):
        for sequence, mode in zip(document, modes, strict=True):
            builder.add_item(torch.from_numpy(sequence), mode)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def write_documents(prefix: str, documents: int, high: int, seed: int) -> str:
    """A uint16 corpus of `documents` documents of 4 to 39 ids from 1 to `high - 1`."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(documents):
            document = rng.integers(1, high, int(rng.integers(4, 40)))
            builder.add_document(document, [len(document)])
    return prefix


def largest_error(weights: list[float], size: int) -> list[int]:
    """megatron's blending rule written the obvious way, as the independent count of blend
    tests: sample i goes to the first dataset with the largest `w * max(i, 1) - taken`."""
    taken, out = [0] * len(weights), []
    for i in range(size):
        errors = [w * max(i, 1) - t for w, t in zip(weights, taken, strict=True)]
        out.append(errors.index(max(errors)))
        taken[out[-1]] += 1
    return out
