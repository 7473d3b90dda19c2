"""`hp-data preprocess`, with each tokenizer engine, against `tokenizers`' own batch encoders.

    uv run python tools/bench/bench_preprocess.py [--workers 1,2] [--mb 50] [--only converted]

Builds (once, cached in --cache) two byte-level BPE tokenizers trained on CPython's standard
library sources: a 32k one (ByteLevel pre-tokenizer, GPT-2's layout) and a 128k Llama-3-style
one (Llama 3's Split regex, then ByteLevel, ignore_merges); two converted the way Llama 3's and
Qwen's files are, the trained 128k table and a 200k one as tiktoken rank tables turned into
tokenizer.json by transformers' `TikTokenConverter` (every two-token split of a token a merge),
with Llama 3's and o200k's split regexes; and a JSONL corpus of
English-like text (sentences of the stdlib's docstrings, mixed into documents of 3-60
sentences). Then, for each tokenizer and each worker count N, each in a fresh process:

- ceiling: `Tokenizer.encode_batch` and `encode_batch_fast(texts, add_special_tokens=False)`
  on the texts already in memory, with RAYON_NUM_THREADS=N (no reading, parsing or writing);
- hp: `hp-data preprocess corpus.jsonl --workers N --append-eod --tokenizer-engine E` for
  E = hf and tiktoken, the whole run end to end.

Prints tokens/s, MB/s, documents/s of each, hp's share of each ceiling, hp's peak RSS, and
whether the two engines wrote identical files.

    uv run python tools/bench/bench_preprocess.py --shards 1,2,4 [--workers 2]

instead runs the sharded path against the one-process run: for each N, the N shards one after
another as separate processes (as a Slurm array runs them on N machines), then
`hp-data merge --shards`. Prints each shard's throughput, the merge's time and GB/s, the merge's
share of a run on N machines (slowest shard + merge), the sharding overhead (all shards + merge
against the one-process run), and checks the merged bytes equal the one-process output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REFERENCE = """
import json, sys, time
from tokenizers import Tokenizer
texts = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]
tokenizer = Tokenizer.from_file(sys.argv[2])
report = {"documents": len(texts)}
for name in ("encode_batch_fast", "encode_batch"):
    start = time.perf_counter()
    encodings = getattr(tokenizer, name)(texts, add_special_tokens=False)
    report[name] = time.perf_counter() - start
    report["tokens"] = sum(len(e.ids) for e in encodings)
    del encodings  # gigabytes of Encoding objects would slow the next call's allocations
print(json.dumps(report))
"""
# Runs a command; then prints the largest resident set of any one of its processes (KB).
PEAK = """
import resource, subprocess, sys
result = subprocess.run(sys.argv[1:], check=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""
# Llama 3's split regex, as its tokenizer.json gives it.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def prepare(cache: Path, megabytes: float) -> tuple[Path, dict[str, Path]]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    cache.mkdir(parents=True, exist_ok=True)
    tokenizers = {"32k BPE": cache / "bpe32k.json", "128k Llama-3-style": cache / "llama3.json"}
    corpus = cache / f"english-{megabytes:g}mb.jsonl"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p for p in sorted(stdlib.rglob("*.py")) if "test" not in p.parts]

    def texts():
        for path in sources:
            try:
                yield path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue

    for (name, path), llama in zip(tokenizers.items(), (False, True), strict=True):
        if path.exists():
            continue
        tokenizer = Tokenizer(models.BPE(ignore_merges=llama))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        specials = ["<|endoftext|>"]
        if llama:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
            specials = ["<|begin_of_text|>", "<|end_of_text|>"]
            specials += [f"<|reserved_special_token_{i}|>" for i in range(254)]
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=128_256 if llama else 32000,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        print(f"training the {name} tokenizer (once) ...", flush=True)
        tokenizer.train_from_iterator(texts(), trainer=trainer)
        tokenizer.save(str(path))
    if not corpus.exists():
        import ast

        sentences = []
        for path in sources:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                    doc = ast.get_docstring(node) or ""
                    for part in re.split(r"(?<=[.!?])\s+|\n\n", doc):
                        if len(part.strip()) > 20:
                            sentences.append(" ".join(part.split()))
        rng = random.Random(0)
        target = int(megabytes * 1e6)
        with open(corpus, "w", encoding="utf-8") as out:
            written = 0
            while written < target:
                text = " ".join(rng.choice(sentences) for _ in range(rng.randint(3, 60)))
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line)
    tokenizers |= converted(cache, tokenizers["128k Llama-3-style"], texts)
    return corpus, tokenizers


def converted(cache: Path, trained: Path, texts: Callable[[], Iterator[str]]) -> dict[str, Path]:
    """The trained 128k table and a 200k one trained alike, each turned into a tokenizer.json
    by transformers' converter, as Meta's and Qwen's files were (`tests/helpers/bpe.py`)."""
    from hp_data.fast_bpe import LLAMA3_PATTERN as LLAMA3
    from hp_data.fast_bpe import O200K_PATTERN
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.helpers
    from tests.helpers.bpe import convert_ranks, rank_table

    made = {
        "128k converted, Llama 3 regex": cache / "converted128k.json",
        "200k converted, o200k regex": cache / "converted200k.json",
    }
    wide = cache / "trained200k.json"
    if not wide.exists():
        print("training the 200k table (once) ...", flush=True)
        tokenizer = Tokenizer(models.BPE(ignore_merges=True))
        tokenizer.pre_tokenizer = Tokenizer.from_file(str(trained)).pre_tokenizer
        trainer = trainers.BpeTrainer(
            vocab_size=200_000,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts(), trainer=trainer)
        tokenizer.save(str(wide))
    sources = (trained, wide)
    patterns = (LLAMA3, O200K_PATTERN)
    specials = (["<|begin_of_text|>", "<|end_of_text|>"], ["<|endoftext|>"])
    for (name, path), source, pattern, added in zip(
        made.items(), sources, patterns, specials, strict=True
    ):
        if not path.exists():
            print(f"converting the {name} tokenizer (once) ...", flush=True)
            convert_ranks(rank_table(source), pattern, added, path)
    return made


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def sharded(corpus: Path, tokenizer: Path, workers: int, counts: list[int]) -> None:
    """The sharded path against one process, side by side (see the module docstring)."""
    hp = str(Path(sys.executable).parent / "hp-data")
    size = corpus.stat().st_size
    with tempfile.TemporaryDirectory() as out:
        base = [hp, "preprocess", str(corpus), "--tokenizer", str(tokenizer), "--append-eod"]
        base += ["--workers", str(workers), "--quiet"]
        one = min(_timed([*base, "--out", f"{out}/one"]) for _ in range(2))  # warm, then again
        expected = Path(f"{out}/one.bin").read_bytes(), Path(f"{out}/one.idx").read_bytes()
        startup = min(_timed([hp, "--version"]) for _ in range(3))
        print(
            f"corpus: {size / 1e6:.1f} MB; {workers} worker(s) per process; "
            f"hp-data start-up {startup:.2f} s"
        )
        print(f"one process                          {one:7.2f} s  {size / one / 1e6:6.2f} MB/s")
        for count in counts:
            prefix = f"{out}/n{count}"
            shards = [
                _timed(
                    [*base, "--out", prefix, "--num-shards", str(count), "--shard-index", str(i)]
                )
                for i in range(count)
            ]
            merge = _timed([hp, "merge", prefix, "--shards", "--quiet"])
            merged = Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()
            output = sum(len(part) for part in merged)
            on_machines = max(shards) + merge
            print(
                f"{count} shard(s): each {min(shards):.2f}-{max(shards):.2f} s "
                f"({size / count / max(shards) / 1e6:.2f} MB/s per shard); merge {merge:.2f} s "
                f"of {output / 1e6:.0f} MB ({merge / on_machines:.1%} of a run "
                f"on {count} machine(s): {on_machines:.2f} s, {one / on_machines:.2f}x one); "
                f"overhead {(sum(shards) + merge) / one - 1:+.1%}; "
                f"identical: {merged == expected}"
            )
        merge_rate(hp, Path(out))


def merge_rate(hp: str, out: Path, shards: int = 4, megabytes: int = 256) -> None:
    """`hp-data merge` of large datasets against the floor, `cat` of their .bin files and an
    fsync: the bytes must be copied once either way."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages/hp-data/src"))
    from hp_data import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    names = []
    for i in range(shards):
        names.append(str(out / f"big{i}"))
        with IndexedDatasetBuilder(names[-1], np.uint16) as builder:
            lengths = rng.integers(100, 4000, megabytes * 1_000_000 // 4100)
            tokens = rng.integers(0, 60000, int(lengths.sum()), dtype=np.uint16)
            builder.add_documents(tokens, lengths)
    size = sum(Path(f"{name}.bin").stat().st_size for name in names)
    merge = _timed([hp, "merge", str(out / "merged"), *names, "--quiet"])
    script = f"cat {' '.join(n + '.bin' for n in names)} > {out}/cat.bin && sync {out}/cat.bin"
    cat = _timed(["bash", "-c", script])
    print(
        f"merge of {shards} datasets, {size / 1e9:.2f} GB: hp-data merge {merge:.2f} s "
        f"({size / merge / 1e9:.2f} GB/s), cat + sync {cat:.2f} s ({size / cat / 1e9:.2f} GB/s); "
        f"hp / cat: {cat / merge:.0%} of cat's speed"
    )


def compare_engines(corpus: Path, name: str, tokenizer: Path, workers: int) -> None:
    """One tokenizer, one worker count: both ceilings, then hp with each engine."""
    size = corpus.stat().st_size
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers)}
    reference = json.loads(
        subprocess.run(
            [sys.executable, "-c", REFERENCE, str(corpus), str(tokenizer)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )

    def report(label: str, seconds: float, tokens: int, documents: int) -> float:
        rate = tokens / seconds
        print(
            f"  {label:<46} {seconds:7.2f} s  {rate / 1e6:6.3f} M tokens/s  "
            f"{size / seconds / 1e6:6.2f} MB/s  {documents / seconds:8.0f} docs/s",
            flush=True,
        )
        return rate

    print(f"{name}, {workers} thread(s) / worker(s):")
    tokens, documents = reference["tokens"], reference["documents"]
    ceilings = {
        method: report(f"tokenizers {method}", reference[method], tokens, documents)
        for method in ("encode_batch", "encode_batch_fast")
    }
    hp = str(Path(sys.executable).parent / "hp-data")
    written = {}
    with tempfile.TemporaryDirectory() as out:
        # tiktoken twice: the first run converts and proves the tokenizer and keeps the recipe
        # (in a cache of this run's own), the second reads it, as every later run does.
        env = {**os.environ, "HP_DATA_TOKENIZER_CACHE": f"{out}/recipes"}
        for engine, when in (("hf", ""), ("tiktoken", ", proving"), ("tiktoken", ", kept")):
            prefix = f"{out}/{engine}{len(written)}"
            command = [hp, "preprocess", str(corpus), "--out", prefix, "--tokenizer"]
            command += [str(tokenizer), "--append-eod", "--workers", str(workers), "--quiet"]
            command += ["--json", "--tokenizer-engine", engine]
            start = time.perf_counter()
            result = subprocess.run(
                [sys.executable, "-c", PEAK, *command],
                check=True,
                capture_output=True,
                text=True,
                env=env,
            )
            wall = time.perf_counter() - start
            *output, peak_kb = result.stdout.splitlines()
            summary = json.loads(output[-1])
            assert summary["engine"] == engine, summary["engine"]
            # hp's tokens include one EOD per document; compare like with like.
            rate = report(
                f"hp-data preprocess --tokenizer-engine {engine}{when}",
                wall,
                summary["tokens"] - summary["documents_written"],
                summary["documents_in"],
            )
            shares = ", ".join(f"{rate / c:.2f}x {m}" for m, c in ceilings.items())
            print(f"  {'':<46} = {shares}; peak RSS of one process {int(peak_kb) / 1024:.0f} MB")
            written[engine + when] = (
                Path(f"{prefix}.bin").read_bytes(),
                Path(f"{prefix}.idx").read_bytes(),
            )
    same = all(files == written["hf"] for files in written.values())
    print(f"  identical .bin/.idx from every run: {same}")
    if "converted" in name:
        probes(tokenizer)


def probes(tokenizer: Path) -> None:
    """The tiktoken engine's ids against `tokenizers`' on the run's probe set and 3,200
    adversarial texts (the tests' own, `tests/helpers/bpe.py`), one text at a time."""
    import numpy as np
    from hp_data.fast_bpe import FastBPE, compare, probe_texts
    from tokenizers import Tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.helpers
    from tests.helpers.bpe import adversarial_probes

    reference = Tokenizer.from_file(str(tokenizer))
    added = [token.content for token in reference.get_added_tokens_decoder().values()]
    texts = probe_texts(added) + adversarial_probes()
    ids = [reference.encode(text, add_special_tokens=False).ids for text in texts]
    want = np.array([i for one in ids for i in one], np.int64), np.array(list(map(len, ids)))
    found = compare(texts, want, FastBPE.from_tokenizer_json(tokenizer).engine().encode(texts))
    verdict = "yes" if found is None else f"no: {texts[found.index]!r} {found.describe()}"
    print(f"  ids identical on {len(texts):,} probe and adversarial texts: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, os.cpu_count() or 1],
        help="worker counts to compare, e.g. 1,2",
    )
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "hp-bench")
    parser.add_argument("--shards", default=None, help="e.g. 1,2,4: the sharded path instead")
    parser.add_argument("--only", default="", help="only the tokenizers whose name has this")
    args = parser.parse_args()

    corpus, tokenizers = prepare(args.cache, args.mb)
    if args.shards:
        counts = [int(n) for n in args.shards.split(",")]
        sharded(corpus, tokenizers["32k BPE"], args.workers[-1], counts)
        return
    size = corpus.stat().st_size
    documents = sum(1 for _ in corpus.open("rb"))
    print(f"corpus: {size / 1e6:.1f} MB, {documents:,} documents")
    for name, tokenizer in tokenizers.items():
        if args.only not in name:
            continue
        for workers in args.workers:
            compare_engines(corpus, name, tokenizer, workers)


if __name__ == "__main__":
    main()
