"""The same records written in every input format `hp-data preprocess` reads."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np


def english_records(seed: int, count: int, keys: tuple[str, ...] = ("text",)) -> list[dict]:
    """Seeded pseudo-English records, with a few empty texts and repeated documents."""
    rng = np.random.default_rng(seed)
    words = (
        "the model reads tokens from a corpus of documents and writes an index of every "
        "sequence so training can sample them quickly; naïve café déjà vu — ünïcode too"
    ).split()
    records = []
    for i in range(count):
        record = {}
        for key in keys:
            n = int(rng.integers(0, 40)) if rng.random() > 0.05 else 0
            record[key] = " ".join(words[j] for j in rng.integers(0, len(words), n))
        record["id"] = i
        records.append(record)
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8"
    )
    return path


def write_jsonl_gz(path: Path, records: list[dict]) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    with gzip.open(path, "wb") as stream:
        stream.write(data)
    return path


def write_jsonl_zst(path: Path, records: list[dict]) -> Path:
    import zstandard

    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    return path


def write_parquet(path: Path, records: list[dict], row_group_size: int = 50) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def save_hf(path: Path, records: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def hf_data_dir(path: Path, records: list[dict]) -> Path:
    """A directory of data files that `datasets.load_dataset(path)` reads as one split."""
    path.mkdir(parents=True)
    write_jsonl(path / "train.jsonl", records)
    return path


WRITERS = {
    "jsonl": lambda d, r: write_jsonl(d / "c.jsonl", r),
    "jsonl.gz": lambda d, r: write_jsonl_gz(d / "c.jsonl.gz", r),
    "jsonl.zst": lambda d, r: write_jsonl_zst(d / "c.jsonl.zst", r),
    "parquet": lambda d, r: write_parquet(d / "c.parquet", r),
    "hf-saved": lambda d, r: save_hf(d / "saved", r),
    "hf": lambda d, r: hf_data_dir(d / "hfdir", r),
}
