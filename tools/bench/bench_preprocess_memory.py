"""Peak memory of `hp-data preprocess` on a corpus of many small documents.

    uv run python tools/bench/bench_preprocess_memory.py [--documents 10000000] [--dedup]

Writes (once, cached in --cache) a JSONL corpus of `--documents` short distinct documents,
runs `hp-data preprocess` on it with the example tokenizer, and samples the resident memory
of the whole process tree (main process and workers) from /proc every 0.1 s. Prints the peak
of the sum, the peak of any one process, and the run's own summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """(sum, largest) resident MB of `pid` and all its descendants."""
    pending, sizes = [pid], []
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            sizes.append(int(status.split("VmRSS:")[1].split()[0]) / 1024)
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError):
            continue
    return sum(sizes), max(sizes, default=0.0)


def make_corpus(path: Path, documents: int) -> None:
    words = "the of and to in a is that for it as was with be by on not he this are or".split()
    phrases = [
        " ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 9)) for i in range(997)
    ]
    with open(path, "w", encoding="utf-8") as out:
        for i in range(documents):
            out.write(f'{{"text": "{phrases[i % 997]} {i}"}}\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=10_000_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dedup", action="store_true")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "hp-bench")
    args = parser.parse_args()

    args.cache.mkdir(parents=True, exist_ok=True)
    corpus = args.cache / f"small-docs-{args.documents}.jsonl"
    if not corpus.exists():
        make_corpus(corpus, args.documents)
    with tempfile.TemporaryDirectory() as out:
        command = [
            str(Path(sys.executable).parent / "hp-data"),
            "preprocess",
            str(corpus),
            "--out",
            f"{out}/small",
            "--tokenizer",
            str(REPO / "examples" / "tokenizer.json"),
            "--append-eod",
            "--workers",
            str(args.workers),
            "--quiet",
            "--json",
        ] + (["--dedup", "exact"] if args.dedup else [])
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        peak_sum = peak_one = 0.0
        while process.poll() is None:
            total, largest = tree_rss_mb(process.pid)
            peak_sum, peak_one = max(peak_sum, total), max(peak_one, largest)
            time.sleep(0.1)
        summary = json.loads(process.stdout.read())
    print(
        f"corpus: {corpus.stat().st_size / 1e6:.0f} MB, {args.documents:,} documents, "
        f"{args.workers} workers, dedup={'exact' if args.dedup else 'off'}"
    )
    print(
        f"documents written {summary['documents_written']:,}, tokens {summary['tokens']:,}, "
        f"{summary['seconds']:.1f} s, {summary['documents_per_second']:,.0f} docs/s"
    )
    if summary["dedup_hash_set_bytes"] is not None:
        print(f"dedup hash set: {summary['dedup_hash_set_bytes'] / 2**20:.0f} MiB")
    print(
        f"peak RSS: {peak_sum:.0f} MB for the whole process tree, "
        f"{peak_one:.0f} MB for the largest process"
    )


if __name__ == "__main__":
    main()
