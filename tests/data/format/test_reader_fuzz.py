"""Thousands of mutated `.idx` files: only IndexedDatasetError may escape the reader."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hp_data import IndexedDataset, IndexedDatasetError
from hp_data.format.validate import dataset_problems
from hp_data.summary import summarize

from tests.helpers.corpus import random_corpus, write_with_hp

EXTREMES = [0, 1, 2, 3, 33, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


def _mutate(rng: np.random.Generator, raw: bytes) -> bytes:
    data = bytearray(raw)
    kind = rng.integers(6)
    if kind == 0 and data:  # flip bits
        for _ in range(int(rng.integers(1, 9))):
            data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    elif kind == 1:  # truncate
        del data[int(rng.integers(len(data) + 1)) :]
    elif kind == 2:  # append junk
        data += rng.bytes(int(rng.integers(1, 64)))
    elif kind == 3:  # an extreme value in a header count
        offset = (9, 18, 26)[int(rng.integers(3))]
        data[offset : offset + 8] = struct.pack("<Q", EXTREMES[int(rng.integers(len(EXTREMES)))])
    elif kind == 4 and len(data) > 42:  # an extreme int64 in the arrays
        offset = int(rng.integers(34, len(data) - 8))
        value = EXTREMES[int(rng.integers(len(EXTREMES)))] % 2**64
        data[offset : offset + 8] = struct.pack("<Q", value)
    elif len(data) > 34:  # overwrite a run of bytes
        start = int(rng.integers(34, len(data)))
        data[start : start + 16] = rng.bytes(min(16, len(data) - start))
    return bytes(data)


def _use(prefix: str, multimodal: bool) -> None:
    ds = IndexedDataset(prefix, multimodal=multimodal, mmap=bool(len(prefix) % 2))
    for i in range(len(ds)):
        ds[i]
    for d in range(ds.num_documents):
        ds.get_document(d)
    summarize(ds)


@pytest.mark.slow
@pytest.mark.parametrize("multimodal", [False, True])
def test_mutated_indices_raise_only_our_error(tmp_path: Path, multimodal: bool):
    rng = np.random.default_rng(1234 + multimodal)
    bases = []
    for seed, dtype in [(1, np.uint16), (2, np.int32), (3, np.int64)]:
        prefix = write_with_hp(
            str(tmp_path / f"base{seed}"), random_corpus(seed, dtype), multimodal
        )
        bases.append((Path(prefix + ".idx").read_bytes(), Path(prefix + ".bin").read_bytes()))

    target = str(tmp_path / "mutant")
    rejected = accepted = 0
    for _ in range(1500):
        idx, data = bases[int(rng.integers(len(bases)))]
        Path(target + ".idx").write_bytes(_mutate(rng, idx))
        Path(target + ".bin").write_bytes(data)
        try:
            _use(target, multimodal)
            accepted += 1
        except IndexedDatasetError as exc:
            assert str(exc).startswith(target), exc
            rejected += 1
        assert all(p.startswith(target) for p in dataset_problems(target, multimodal))
    # Most mutations break an invariant; a few (a flipped mode or token-free bits) do not.
    assert rejected > 1000
    assert accepted + rejected == 1500
