"""hp-data's index construction and sample reads against megatron-core, side by side.

    uv run python tools/bench/bench_indices.py [--sequences 10000000] [--corpus-gb 1.0]

Every case runs in fresh processes, once per side untimed (to warm the page cache and any
on-disk compiled code), then three times per side, alternating; the median run is printed.
"Peak MB" is the extra resident memory of the operation (VmHWM after, reset before, minus
VmRSS before; mapped file pages count, as they do in RSS).

1. `first_sample_index`: a fresh process's first `build_sample_index` over N sequences
   (lengths 50-2000, L=4096, one epoch), import included, against megatron-core's
   `helpers.build_sample_idx` imported the usual way (`megatron.core.datasets.helpers`,
   which imports torch) and with its compiled `helpers_cpp` loaded alone (the floor);
   the second call in the same process is the steady state.
2. `first_blend`: the same for blending 3 datasets (0.5/0.3/0.2) into 50M samples.
3. `gpt_build`: the whole GPTDataset index build on the N-sequence corpus (open the corpus,
   document + sample + shuffle index, saved to the cache): seconds, peak memory, the bytes of
   the cache files, and hp's warm reload from the cache.
4. `build_index_cli`: wall time of a fresh `hp-data build-index` on the shipped example
   (out of `hp-data preprocess examples/docstrings.jsonl ... --append-eod`, L=128, split
   95,5,0, one epoch per split) against a fresh process that builds the same splits with
   megatron-core's BlendedMegatronDatasetBuilder (what `prepare_cache.py` does).
5. `items`: 20,000 random full items at L=2048 from a ~1 GB uint16 corpus: `GPTDataset[i]`
   vs megatron-core's (create_attention_mask=False, its fastest setting).

The N-sequence corpus has a sparse `.bin`: index building reads only lengths.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HP_DATA = str(Path(sys.executable).parent / "hp-data")
SIDES = {
    "first_sample_index": ("hp", "megatron", "megatron-so"),
    "first_blend": ("hp", "megatron", "megatron-so"),
    "gpt_build": ("hp", "megatron"),
    "build_index_cli": ("hp", "megatron"),
    "items": ("hp", "megatron"),
}
BLEND_WEIGHTS, BLEND_SIZE = [0.5, 0.3, 0.2], 50_000_000


def _rss_mb(field: str) -> float:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0]) / 1024


def measure(function):
    """(seconds, extra peak RSS in MB, result) of one call."""
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current RSS
    before = _rss_mb("VmRSS")
    start = time.perf_counter()
    result = function()
    seconds = time.perf_counter() - start
    return seconds, _rss_mb("VmHWM") - before, result


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


def _megatron_config(prefix: str, seq_length: int, cache: str, split: str):
    from megatron.core.datasets import gpt_dataset

    return gpt_dataset.GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        path_to_cache=cache,
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )


def megatron_gpt(prefix: str, seq_length: int, cache: str, num_samples=None):
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    config = _megatron_config(prefix, seq_length, cache, "1,0,0")

    def build():
        # Opening the corpus is part of the build on both sides (hp also checks it).
        indexed = IndexedDataset(prefix)
        indices = np.arange(len(indexed), dtype=np.int32)
        return gpt_dataset.GPTDataset(indexed, prefix, indices, num_samples, Split.train, config)

    return build


def _megatron_helpers(side: str):
    """megatron-core's compiled helpers: through its package (what its code does: that
    imports torch), or the extension module loaded alone by path."""
    if side == "megatron":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers
        return helpers
    import importlib.util

    import megatron

    pattern = os.path.join(megatron.__path__[0], "core", "datasets", "helpers_cpp*.so")
    spec = importlib.util.spec_from_file_location("helpers_cpp", glob.glob(pattern)[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_calls(side: str, call_hp, call_megatron) -> dict:
    """Import plus first call in this fresh process, then a second call."""
    start = time.perf_counter()
    if side == "hp":
        from hp_data import index

        call = lambda: call_hp(index)  # noqa: E731
    else:
        helpers = _megatron_helpers(side)
        call = lambda: call_megatron(helpers)  # noqa: E731
    imported = time.perf_counter() - start
    first, peak, result = measure(call)
    del result  # the second call allocates its arrays afresh, as the first did
    second = measure(call)[0]
    return {
        "seconds": imported + first,
        "import_seconds": imported,
        "first_call_seconds": first,
        "second_call_seconds": second,
        "peak_mb": peak,
    }


def _npy_bytes(directory: str) -> dict[str, int]:
    """Bytes of each cached array file, by array name."""
    out = {}
    for path in glob.glob(os.path.join(directory, "**", "*.npy"), recursive=True):
        name = os.path.basename(path)[: -len(".npy")].split("-")[-1]
        out[name] = out.get(name, 0) + os.path.getsize(path)
    return out


def _gpt_build(side: str, work: str, lengths_prefix: str) -> dict:
    """A GPTDataset built into an empty cache (hp: and reloaded warm): time, memory, dtypes."""
    result: dict = {}
    cache = tempfile.mkdtemp(dir=work)
    if side == "hp":
        from hp_data.gpt import GPTDataset, GPTDatasetConfig

        config = GPTDatasetConfig(seq_length=4096, split="1,0,0", cache_dir=cache)
        build = lambda: GPTDataset(lengths_prefix, "train", None, config)  # noqa: E731
        result["seconds"], result["peak_mb"], dataset = measure(build)
        result["warm_reload_seconds"] = min(measure(build)[0] for _ in range(3))
    else:
        result["seconds"], result["peak_mb"], dataset = measure(
            megatron_gpt(lengths_prefix, 4096, cache)
        )
    result["dtypes"] = {
        name: str(getattr(dataset, name).dtype)
        for name in ("document_index", "sample_index", "shuffle_index")
    }
    result["cache_bytes"] = _npy_bytes(cache)
    return result


def run_case(case: str, side: str, work: str, sequences: int) -> dict:
    warnings.simplefilter("ignore")
    lengths_prefix, tokens_prefix = f"{work}/lengths", f"{work}/tokens"
    result: dict = {}
    if case == "first_sample_index":
        lengths = np.fromfile(lengths_prefix + ".idx", dtype=np.int32, count=sequences, offset=34)
        documents = np.arange(sequences, dtype=np.int32)
        np.random.RandomState(0).shuffle(documents)
        tokens = int(lengths.sum(dtype=np.int64))
        arguments = (lengths, documents, 4096, 1, tokens)

        def megatron_call(helpers):
            if hasattr(helpers, "build_sample_idx"):
                return helpers.build_sample_idx(*arguments)
            return helpers.build_sample_idx_int32(*arguments, True, 1)  # the .so alone

        result = _first_calls(
            side, lambda index: index.build_sample_index(*arguments), megatron_call
        )
    elif case == "first_blend":
        weights = np.array(BLEND_WEIGHTS)

        def megatron_call(helpers):
            dataset_index = np.zeros(BLEND_SIZE, dtype=np.int16)
            sample_index = np.zeros(BLEND_SIZE, dtype=np.int64)
            helpers.build_blending_indices(
                dataset_index, sample_index, weights, len(weights), BLEND_SIZE, False
            )

        result = _first_calls(
            side, lambda index: index.build_blending_indices(weights, BLEND_SIZE), megatron_call
        )
    elif case == "gpt_build":
        result = _gpt_build(side, work, lengths_prefix)
    elif case == "build_index_megatron":  # the child that build_index_cli times
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset

        config = _megatron_config(f"{work}/docstrings", 128, sys.argv[-1], "95,5,0")
        BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()
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
        result["seconds"], result["peak_mb"], _ = measure(read)
        result["items_per_second"] = len(picks) / result["seconds"]
    return result


def run_side(case: str, side: str, args: argparse.Namespace) -> dict:
    """One fresh-process run of `case` on `side`."""
    if case == "build_index_cli":
        # Wall time of the whole process, start-up included, into an empty cache.
        cache = tempfile.mkdtemp(dir=args.work)
        prefix = f"{args.work}/docstrings"
        if side == "hp":
            command = [HP_DATA, "build-index", "--data-path", prefix, "--seq-len", "128"]
            command += ["--seed", "1234", "--split", "95,5,0", "--cache-dir", cache]
        else:
            command = [sys.executable, __file__, "--case", "build_index_megatron"]
            command += ["--work", args.work, "--side", side, cache]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        return {"seconds": time.perf_counter() - start, "cache_bytes": _npy_bytes(cache)}
    command = [sys.executable, __file__, "--case", case, "--side", side, "--work", args.work]
    command += ["--sequences", str(args.sequences)]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} kB"


def report(case: str, runs: dict[str, list[dict]]) -> None:
    median = {side: sorted(r, key=lambda x: x["seconds"])[len(r) // 2] for side, r in runs.items()}
    hp = median["hp"]
    print(f"{case}:")
    for side, run in median.items():
        seconds = [r["seconds"] for r in runs[side]]
        spread = ", ".join(f"{x:.3f}" for x in seconds)
        line = f"  {side:<12} {run['seconds']:8.3f} s  (runs {spread}; best {min(seconds):.3f})"
        if side != "hp":
            line += f"  hp speed-up {run['seconds'] / hp['seconds']:5.2f}x"
        if "import_seconds" in run:
            line += (
                f"  import {run['import_seconds']:.3f} + first call "
                f"{run['first_call_seconds']:.3f} s; second call {run['second_call_seconds']:.3f} s"
            )
        if "peak_mb" in run:
            line += f"  peak {run['peak_mb']:.0f} MB"
        if "cache_bytes" in run:
            files = sorted(run["cache_bytes"].items())
            sizes = ", ".join(f"{name} {_size(n)}" for name, n in files)
            line += f"  cache {_size(sum(run['cache_bytes'].values()))} ({sizes})"
        if "dtypes" in run:
            line += "  dtypes " + "/".join(run["dtypes"].values())
        if "warm_reload_seconds" in run:
            line += f"  warm reload {run['warm_reload_seconds'] * 1000:.1f} ms"
        if "items_per_second" in run:
            line += f"  {run['items_per_second']:,.0f} items/s"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=10_000_000)
    parser.add_argument("--corpus-gb", type=float, default=1.0)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "hp-bench-indices"))
    parser.add_argument("--repeat", type=int, default=3, help="fresh runs per side and case")
    parser.add_argument("--cases", default=",".join(SIDES), help="comma-separated cases")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.side, args.work, args.sequences)))
        return
    os.makedirs(args.work, exist_ok=True)
    if not os.path.exists(f"{args.work}/lengths.idx"):
        write_lengths_corpus(f"{args.work}/lengths", args.sequences)
    if not os.path.exists(f"{args.work}/tokens.idx"):
        write_token_corpus(f"{args.work}/tokens", args.corpus_gb)
    if not os.path.exists(f"{args.work}/docstrings.idx"):
        subprocess.run(
            [HP_DATA, "preprocess", str(ROOT / "examples/docstrings.jsonl"), "--out"]
            + [f"{args.work}/docstrings", "--tokenizer", str(ROOT / "examples/tokenizer.json")]
            + ["--append-eod", "--quiet"],
            check=True,
        )
    for case in args.cases.split(","):
        runs: dict[str, list[dict]] = {side: [] for side in SIDES[case]}
        for side in runs:  # untimed: page cache, numba's on-disk cache, .pyc files
            run_side(case, side, args)
        for _ in range(args.repeat):  # alternate the sides; report the median run of each
            for side in runs:
                runs[side].append(run_side(case, side, args))
        report(case, runs)


if __name__ == "__main__":
    main()
