"""hp-data's index construction and sample reads against megatron-core, side by side.

    uv run python tools/bench/bench_indices.py [--sequences 10000000] [--corpus-gb 1.0]

Each case runs in a fresh process per side (so imports and peak memory do not mix), three
times alternating, and prints the median seconds, hp's speed-up (megatron time / hp time)
and the extra peak RSS of the operation:

1. sample index for N sequences (lengths 50-2000, L=4096, one epoch): `build_sample_index` vs
   `helpers.build_sample_idx`;
2. the whole GPTDataset index build (document, sample, shuffle; saved to the cache) on that
   corpus, cold, and hp's warm reload from the cache;
3. blending 3 datasets into 50M samples: `build_blending_indices` (numba, compiled and cached
   beforehand) vs `helpers.build_blending_indices`;
4. 20,000 random full items at L=2048 from a ~1 GB uint16 corpus: `GPTDataset[i]` vs
   megatron-core's (with create_attention_mask=False, its fastest setting).

The N-sequence corpus of case 1-2 has a sparse `.bin`: index building reads only lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np


def _rss_kb(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0])


def measure(function):
    """(seconds, extra peak RSS in MB) of one call."""
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current RSS
    before = _rss_kb("VmRSS")
    start = time.perf_counter()
    function()
    seconds = time.perf_counter() - start
    return seconds, (_rss_kb("VmHWM") - before) / 1024


def write_lengths_corpus(prefix: str, count: int) -> None:
    """An .idx of `count` sequences (lengths 50-2000) and a sparse .bin of the right size."""
    from hp_data.format.header import pack_header

    lengths = np.random.default_rng(0).integers(50, 2001, count).astype(np.int32)
    pointers = np.zeros(count, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
    with open(prefix + ".idx", "wb") as out:
        out.write(pack_header(np.dtype(np.uint16), count, count + 1))
        out.write(lengths.tobytes())
        out.write(pointers.tobytes())
        out.write(np.arange(count + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as out:
        out.truncate(int(lengths.sum(dtype=np.int64)) * 2)


def write_token_corpus(prefix: str, gigabytes: float) -> None:
    from hp_data import IndexedDatasetBuilder

    rng = np.random.default_rng(1)
    tokens = int(gigabytes * 1e9 / 2)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        done = 0
        while done < tokens:
            lengths = rng.integers(50, 4000, 10_000)
            builder.add_documents(
                rng.integers(0, 50_000, int(lengths.sum()), dtype=np.uint16), lengths
            )
            done += int(lengths.sum())


class _Tokenizer:
    """The attributes megatron-core's GPTDataset reads from a tokenizer."""

    def __init__(self) -> None:
        self.vocab_size, self.eod = 65536, 0
        self.unique_identifiers = {"class": "Tokenizer"}


def megatron_gpt(prefix: str, seq_length: int, cache: str, num_samples=None):
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    config = gpt_dataset.GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="1,0,0",
        path_to_cache=cache,
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )

    def build():
        # Opening the corpus is part of the build on both sides (hp also checks it).
        indexed = IndexedDataset(prefix)
        indices = np.arange(len(indexed), dtype=np.int32)
        return gpt_dataset.GPTDataset(indexed, prefix, indices, num_samples, Split.train, config)

    return build


def run_case(case: str, side: str, work: str, sequences: int) -> dict:
    warnings.simplefilter("ignore")
    lengths_prefix, tokens_prefix = f"{work}/lengths", f"{work}/tokens"
    result: dict = {}
    if side == "hp":  # numba compiles once per machine (cached on disk): not part of a build
        from hp_data import build_blending_indices, build_sample_index

        build_blending_indices([0.5, 0.5], 4)
        build_sample_index(np.array([5, 5], np.int32), np.array([0, 1], np.int32), 4, 1, 10)
        build_sample_index(np.array([5, 5], np.int32), np.array([0, 1], np.int64), 4, 1, 10)
        sizes = np.array([5, 5], np.int32)
        sizes.flags.writeable = False  # a mapped corpus is read-only: its own specialisation
        build_sample_index(sizes, np.array([0, 1], np.int64), 4, 1, 10)
    if case == "sample_index":
        lengths = np.fromfile(lengths_prefix + ".idx", dtype=np.int32, count=sequences, offset=34)
        documents = np.arange(sequences, dtype=np.int32)
        np.random.RandomState(0).shuffle(documents)
        tokens = int(lengths.sum(dtype=np.int64))
        if side == "hp":
            from hp_data import build_sample_index

            call = lambda: build_sample_index(lengths, documents, 4096, 1, tokens)  # noqa: E731
        else:
            from megatron.core.datasets import helpers

            call = lambda: helpers.build_sample_idx(lengths, documents, 4096, 1, tokens)  # noqa: E731
        result["seconds"], result["peak_mb"] = measure(call)
    elif case == "gpt_build":
        cache = tempfile.mkdtemp(dir=work)
        if side == "hp":
            from hp_data.gpt import GPTDataset, GPTDatasetConfig

            config = GPTDatasetConfig(seq_length=4096, split="1,0,0", cache_dir=cache)
            build = lambda: GPTDataset(lengths_prefix, "train", None, config)  # noqa: E731
            result["seconds"], result["peak_mb"] = measure(build)
            warm = [measure(build)[0] for _ in range(3)]
            result["warm_reload_seconds"] = min(warm)
        else:
            result["seconds"], result["peak_mb"] = measure(
                megatron_gpt(lengths_prefix, 4096, cache)
            )
    elif case == "blend":
        weights = np.array([0.5, 0.3, 0.2])
        size = 50_000_000
        if side == "hp":
            from hp_data import build_blending_indices

            build_blending_indices(weights, 10)  # compile (or load numba's on-disk cache)
            result["seconds"], result["peak_mb"] = measure(
                lambda: build_blending_indices(weights, size)
            )
        else:
            from megatron.core.datasets import helpers

            def call():
                dataset_index = np.zeros(size, dtype=np.int16)
                sample_index = np.zeros(size, dtype=np.int64)
                helpers.build_blending_indices(dataset_index, sample_index, weights, 3, size, False)

            result["seconds"], result["peak_mb"] = measure(call)
    elif case == "items":
        cache = tempfile.mkdtemp(dir=work)
        picks = np.random.default_rng(2).integers(0, 100_000, 20_000).tolist()
        if side == "hp":
            from hp_data.gpt import GPTDataset, GPTDatasetConfig

            dataset = GPTDataset(
                tokens_prefix,
                "train",
                100_000,
                GPTDatasetConfig(seq_length=2048, split="1,0,0", cache_dir=cache),
            )
        else:
            dataset = megatron_gpt(tokens_prefix, 2048, cache, 100_000)()

        def read():
            for i in picks:
                dataset[i]

        read()  # warm the page cache the same way for both sides
        result["seconds"], result["peak_mb"] = measure(read)
        result["items_per_second"] = len(picks) / result["seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=10_000_000)
    parser.add_argument("--corpus-gb", type=float, default=1.0)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "hp-bench-indices"))
    parser.add_argument("--repeat", type=int, default=3, help="fresh runs per side and case")
    parser.add_argument("--case")
    parser.add_argument("--side")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.side, args.work, args.sequences)))
        return
    os.makedirs(args.work, exist_ok=True)
    if not os.path.exists(f"{args.work}/lengths.idx"):
        write_lengths_corpus(f"{args.work}/lengths", args.sequences)
    if not os.path.exists(f"{args.work}/tokens.idx"):
        write_token_corpus(f"{args.work}/tokens", args.corpus_gb)
    for case in ("sample_index", "gpt_build", "blend", "items"):
        runs: dict[str, list[dict]] = {"hp": [], "megatron": []}
        for _ in range(args.repeat):  # alternate the sides; report the median run of each
            for side in runs:
                command = [
                    sys.executable,
                    __file__,
                    "--case",
                    case,
                    "--side",
                    side,
                    "--work",
                    args.work,
                    "--sequences",
                    str(args.sequences),
                ]
                out = subprocess.run(command, check=True, capture_output=True, text=True)
                runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        hp, mg = (sorted(r, key=lambda x: x["seconds"])[len(r) // 2] for r in runs.values())
        line = (
            f"{case:<13} hp {hp['seconds']:8.3f} s ({hp['peak_mb']:7.0f} MB)   "
            f"megatron {mg['seconds']:8.3f} s ({mg['peak_mb']:7.0f} MB)   "
            f"speed-up {mg['seconds'] / hp['seconds']:5.2f}x"
        )
        if "warm_reload_seconds" in hp:
            line += f"   hp warm reload {hp['warm_reload_seconds'] * 1000:.1f} ms"
        if "items_per_second" in hp:
            line += (
                f"   items/s hp {hp['items_per_second']:,.0f} "
                f"megatron {mg['items_per_second']:,.0f}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
