"""A GPTDataset read from object storage (moto's S3 server on this machine) against the same
files on local disk: samples/s cold (empty chunk cache), cold with read-ahead, and warm, and
the bytes downloaded against the bytes of the samples read (read amplification).

    uv run python tools/bench/bench_remote.py [--tokens 8e6] [--samples 2000] [--chunk-mb 1]

One corpus of `--tokens` uint16 tokens (documents of 50-2000 tokens), uploaded to a bucket
of a local moto server; the first `--samples` samples of `--seq-length` tokens (in the
sampler's order: GPTDataset's shuffle spreads them over the whole corpus) are read one by one
in this process (the local and warm figures: the faster of two passes). Cold: a fresh cache,
each chunk fetched when a sample first needs it; read-ahead: the same with `ReadAhead` handed
the next `--ahead` samples as hp-train's Loader does; warm: a filled cache. moto is a Python
server: its throughput, not a real store's, bounds the cold figures; the amplification does
not depend on it.

Then what checking every chunk's bytes costs (issue 40), side by side in the same run, in
seconds a GiB: the writer's block hashes (`format/blocks.py`) against reading the `.bin`
alone; and the first map of every chunk of the warm cache by a process that did not download
it (each chunk's bytes hashed: against the record where `--chunk-mb` is a multiple of 4, else
against the chunk's own hash) against the same maps with the check skipped.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench_format import timed  # the faster of three runs, in seconds


def write_corpus(prefix: str, tokens: int, seed: int = 0) -> None:
    import numpy as np
    from hp_data import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, np.uint16, metadata={"schema": 1, "eod": 0}) as builder:
        written = 0
        while written < tokens:
            document = rng.integers(1, 32000, int(rng.integers(50, 2000)), dtype=np.uint16)
            builder.add_document(document, [len(document)])
            written += len(document)


def read(dataset, count: int, ahead: int = 0) -> float:
    """Seconds to read samples 0..count-1; `ahead`: hand ReadAhead the next `ahead` ids."""
    from hp_data.read_ahead import ReadAhead

    helper = ReadAhead(dataset) if ahead else None
    start = time.perf_counter()
    for i in range(count):
        if helper is not None and i % 8 == 0:
            helper.want(range(i, min(i + ahead, count)))
        dataset[i]
    seconds = time.perf_counter() - start
    if helper is not None:
        helper.close()
    return seconds


def check_costs(bin_file: str, open_remote) -> list[tuple[str, float, float]]:
    """(what, seconds a GiB with the check, without): the writer's hashes against a plain read
    of the `.bin`; a fresh process's first map of every cached chunk, checked and not."""
    from hp_data.format.blocks import file_digests

    gib = os.path.getsize(bin_file) / 2**30

    def read_only() -> None:
        buffer = bytearray(16 << 20)
        with open(bin_file, "rb", buffering=0) as stream:
            while stream.readinto(buffer):
                pass

    hashed, plain = timed(lambda: file_digests(bin_file)), timed(read_only)
    rows = [("record at write (hash the .bin)", hashed / gib, plain / gib)]

    def map_all(skip: bool) -> float:
        corpus = open_remote().dataset.remote  # a new corpus object: nothing checked yet
        chunks = range(-(-corpus.bin_size // corpus.chunk_bytes))
        if skip:  # what mapping cost before chunks were checked
            corpus._checked.update(_inode(corpus.chunk_path(c)) for c in chunks)
        start = time.perf_counter()
        for chunk in chunks:
            corpus.read(chunk * corpus.chunk_bytes, 1)
        return time.perf_counter() - start

    checked = min(map_all(False) for _ in range(3))
    unchecked = min(map_all(True) for _ in range(3))
    rows.append(("first map of each cached chunk", checked / gib, unchecked / gib))
    return rows


def _inode(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def chunk_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in (cache / "remote").glob("*/chunks-*/*.chunk"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=8e6)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--chunk-mb", type=float, default=1.0)
    parser.add_argument("--ahead", type=int, default=64)
    args = parser.parse_args()

    import boto3
    import fsspec
    from hp_data.gpt import GPTDataset, GPTDatasetConfig
    from hp_data.remote import _filesystem
    from moto.server import ThreadedMotoServer

    root = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    prefix = str(root / "corpus")
    write_corpus(prefix, int(args.tokens))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    for suffix in (".bin", ".idx", ".hp.json"):
        client.upload_file(prefix + suffix, "bench", "corpus" + suffix)
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    _filesystem.cache_clear()

    def config(cache: str) -> GPTDatasetConfig:
        return GPTDatasetConfig(seq_length=args.seq_length, split="1,0,0", cache_dir=cache,
                                remote_chunk_mb=args.chunk_mb)  # fmt: skip

    count = args.samples
    rows = []
    local = GPTDataset(prefix, "train", count, config(str(root / "local-cache")))
    read(local, count)  # the file in the page cache: the local figure is the best case
    rows.append(("local files", min(read(local, count) for _ in range(2)), None))
    for name, ahead in (("s3 cold", 0), ("s3 cold + read-ahead", args.ahead)):
        cache = root / name.replace(" ", "-").replace("+", "")
        remote = GPTDataset("s3://bench/corpus", "train", count, config(str(cache)))
        rows.append((name, read(remote, count, ahead), chunk_bytes(cache)))
    warm = GPTDataset("s3://bench/corpus", "train", count, config(str(cache)))
    rows.append(("s3 warm", min(read(warm, count) for _ in range(2)), 0))
    costs = check_costs(
        prefix + ".bin", lambda: GPTDataset("s3://bench/corpus", "train", count, config(str(cache)))
    )
    server.stop()

    used = count * (args.seq_length + 1) * 2
    bin_size = os.path.getsize(prefix + ".bin")
    print(f"corpus {bin_size / 2**20:.1f} MiB, {count} samples of {args.seq_length} tokens "
          f"({used / 2**20:.1f} MiB of tokens), chunks of {args.chunk_mb:g} MiB")  # fmt: skip
    print(f"{'':24} {'samples/s':>10} {'vs local':>9} {'downloaded MiB':>15} {'amplification':>14}")
    base = count / rows[0][1]
    for name, seconds, downloaded in rows:
        rate = count / seconds
        moved = "" if downloaded is None else f"{downloaded / 2**20:.1f}"
        ratio = "" if downloaded is None else f"{downloaded / used:.2f}"
        print(f"{name:24} {rate:10.0f} {rate / base:9.3f} {moved:>15} {ratio:>14}")
    print(f"\nchecking every byte (s/GiB) {'checked':>8} {'unchecked':>10} {'cost':>8}")
    for name, checked, unchecked in costs:
        print(f"{name:32} {checked:8.3f} {unchecked:10.3f} {checked - unchecked:8.3f}")


if __name__ == "__main__":
    main()
