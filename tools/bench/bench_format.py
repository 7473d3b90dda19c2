"""hp-data's IndexedDataset builder and reader against megatron-core's, side by side.

    uv run python tools/bench/bench_format.py [--documents 200000] [--mean-length 256]

Writes the same random corpus with both builders (checking the bytes are identical), then
times opening and random reads with both readers. Prints seconds and hp's speed-up
(reference time / hp time; above 1 means hp is faster).
"""

from __future__ import annotations

import argparse
import filecmp
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np


def timed(function: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def row(what: str, hp: float, reference: float) -> None:
    print(
        f"{what:<40} hp {hp:8.4f} s   megatron {reference:8.4f} s   speed-up {reference / hp:5.2f}x"
    )


def open_index(big: str, sequences: int, megatron: Any) -> None:
    """Opening an index of `sequences` one-token sequences, checked and not, against Megatron."""
    from hp_data import IndexedDataset, IndexedDatasetBuilder

    with IndexedDatasetBuilder(big, np.uint16) as builder:
        builder.add_documents(np.zeros(sequences, np.uint16), np.ones(sequences, np.int64))
    reference = timed(lambda: megatron.IndexedDataset(big))
    label = f"open {sequences:,}-sequence index"
    row(f"{label}, checked", timed(lambda: IndexedDataset(big)), reference)
    row(f"{label}, validate=False", timed(lambda: IndexedDataset(big, validate=False)), reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--mean-length", type=int, default=256)
    parser.add_argument("--reads", type=int, default=100_000)
    parser.add_argument(
        "--open-sequences", type=int, default=10_000_000, help="index size for the open timing"
    )
    args = parser.parse_args()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from megatron.core.datasets import indexed_dataset as megatron

    from hp_data import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    lengths = rng.geometric(1 / args.mean_length, args.documents).astype(np.int64)
    tokens = rng.integers(0, 50_000, int(lengths.sum()), dtype=np.uint16)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    documents = [tokens[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    tensors = [torch.from_numpy(d) for d in documents]
    print(f"corpus: {args.documents:,} documents, {len(tokens):,} uint16 tokens")

    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs, bulk = f"{tmp}/hp", f"{tmp}/megatron", f"{tmp}/hp_bulk"

        def build_megatron() -> None:
            builder = megatron.IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
            for tensor in tensors:
                builder.add_document(tensor, [tensor.numel()])
            builder.finalize(theirs + ".idx")

        def build_hp() -> None:
            with IndexedDatasetBuilder(ours, np.uint16) as builder:
                for document in documents:
                    builder.add_document(document, [len(document)])

        def build_hp_bulk() -> None:
            with IndexedDatasetBuilder(bulk, np.uint16) as builder:
                builder.add_documents(tokens, lengths)

        reference = timed(build_megatron, 1)
        row("build, add_document per document", timed(build_hp, 1), reference)
        row("build, hp add_documents in one call", timed(build_hp_bulk, 1), reference)
        for suffix in (".bin", ".idx"):
            for mine in (ours, bulk):
                assert filecmp.cmp(mine + suffix, theirs + suffix, shallow=False), suffix
        print("bytes: hp and megatron files are identical")

        open_index(f"{tmp}/big", args.open_sequences, megatron)

        picks = rng.integers(0, args.documents, args.reads).tolist()
        for mmap in (True, False):
            hp_ds = IndexedDataset(ours, mmap=mmap)
            mg_ds = megatron.IndexedDataset(theirs, mmap=mmap)
            count = args.reads if mmap else args.reads // 10

            def read_hp(ds=hp_ds, count=count) -> None:
                for i in picks[:count]:
                    ds[i]

            def read_megatron(ds=mg_ds, count=count) -> None:
                for i in picks[:count]:
                    ds[i]

            row(f"{count:,} random ds[i], mmap={mmap}", timed(read_hp), timed(read_megatron))

        hp_ds, mg_ds = IndexedDataset(ours), megatron.IndexedDataset(theirs)
        row(
            f"{args.reads:,} random ds.get(i, 1, 32)",
            timed(lambda: [hp_ds.get(i, 1, 32) for i in picks if lengths[i] > 32]),
            timed(lambda: [mg_ds.get(i, 1, 32) for i in picks if lengths[i] > 32]),
        )


if __name__ == "__main__":
    main()
