"""What `hp-data inspect` reports: counts, length statistics, a histogram and a full check."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hp_data.dataset import IndexedDataset
from hp_data.errors import PreprocessError
from hp_data.format.header import metadata_path
from hp_data.format.metadata import read_metadata
from hp_data.object_store import RemoteCorpus


def document_lengths(dataset: IndexedDataset) -> np.ndarray:
    """Tokens per document (int64), from the pointers: no pass over the `.bin`."""
    ends = np.empty(len(dataset) + 1, dtype=np.int64)
    ends[:-1] = dataset.sequence_pointers
    ends[-1] = dataset.num_tokens * dataset.dtype.itemsize
    boundaries = dataset.document_indices
    return (ends[boundaries[1:]] - ends[boundaries[:-1]]) // dataset.dtype.itemsize


def length_stats(lengths: np.ndarray) -> dict[str, float | int | None]:
    keys = ("min", "mean", "p50", "p90", "p99", "max")
    if len(lengths) == 0:
        return dict.fromkeys(keys)
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99], method="nearest")
    return {
        "min": int(lengths.min()),
        "mean": round(float(lengths.mean()), 2),
        "p50": int(p50),
        "p90": int(p90),
        "p99": int(p99),
        "max": int(lengths.max()),
    }


def histogram(lengths: np.ndarray) -> list[dict[str, int]]:
    """Counts in power-of-two buckets [0], [1], [2, 3], [4, 7], ... up to the longest."""
    if len(lengths) == 0:
        return []
    buckets = np.zeros(len(lengths), dtype=np.int64)
    positive = lengths > 0
    buckets[positive] = np.floor(np.log2(lengths[positive])).astype(np.int64) + 1
    counts = np.bincount(buckets)
    rows = []
    for bucket, count in enumerate(counts):
        low = 0 if bucket == 0 else 1 << (bucket - 1)
        high = 0 if bucket == 0 else (1 << bucket) - 1
        rows.append({"low": low, "high": high, "count": int(count)})
    # Trim empty buckets at both ends; keep gaps inside so the shape reads true.
    while rows and rows[0]["count"] == 0:
        rows.pop(0)
    return rows


def summarize(dataset: IndexedDataset) -> dict[str, Any]:
    """The report of a dataset, local or behind a URL (its sizes then the store's, its
    metadata and provenance read from copies in the node cache)."""
    lengths = document_lengths(dataset)
    remote = dataset.remote
    return {
        "prefix": dataset.path_prefix,
        "dtype": str(dataset.dtype),
        "sequences": len(dataset),
        "documents": dataset.num_documents,
        "tokens": dataset.num_tokens,
        "bin_bytes": dataset.bin_bytes,
        "idx_bytes": os.path.getsize(dataset.idx_path) if remote is None else remote.idx_size,
        "document_length": length_stats(lengths),
        "histogram": histogram(lengths),
        "tokenizer": (read_metadata(_metadata_prefix(dataset)) or {}).get("tokenizer"),
        "provenance": provenance_report(dataset.path_prefix, remote),
    }


def _metadata_prefix(dataset: IndexedDataset) -> str:
    """Where the dataset's `.hp.json` is read: beside it, or its copy in the node cache."""
    return dataset.path_prefix if dataset.remote is None else dataset.remote.local_prefix


def provenance_report(prefix: str, remote: RemoteCorpus | None = None) -> dict[str, Any] | None:
    """What the `.hp.sources` sidecar records (provenance.py), or None without one; a
    damaged or mismatched one is reported as `{"problem": ...}`, the dataset stays usable.
    Of a URL prefix (`remote`), the store's sidecar is copied into the node cache first."""
    from hp_data.format.header import idx_path, sources_path
    from hp_data.provenance import REASONS, ProvenanceError, read_provenance

    path, named = sources_path(prefix), {}
    if remote is not None:
        copied = remote.copy_sidecar(".hp.sources")
        if copied is None:
            return None
        named = {copied: path, remote.local_prefix + ".idx": idx_path(prefix)}
        prefix, path = remote.local_prefix, copied
    try:
        found = read_provenance(prefix, path)
    except ProvenanceError as exc:
        message = str(exc)
        for local, shown in named.items():  # named as the user named them
            message = message.replace(local, shown)
        return {"problem": message}
    if found is None:
        return None
    counts = np.bincount(found.reasons, minlength=len(REASONS))
    return {
        "inputs": len(found.inputs),
        "units": len(found.units),
        "skipped": dict(zip(REASONS, counts.tolist(), strict=True)),
        "bytes": os.path.getsize(path),
    }


def show_documents(
    dataset: IndexedDataset, count: int, tokenizer: str | None = None, allow_download: bool = False
) -> list[dict[str, Any]]:
    """The first `count` documents decoded with `tokenizer` (a path or hub name), or else
    with the tokenizer the dataset's metadata records, checked to be the same bytes; a hub
    tokenizer missing from the local cache is fetched only with `allow_download`."""
    from hp_data.tokenize import TokenizerFiles, decode_ids  # tokenizers only when showing

    prefix = dataset.path_prefix
    if tokenizer is not None:
        files = TokenizerFiles.locate(tokenizer, allow_download)
    else:
        record = (read_metadata(_metadata_prefix(dataset)) or {}).get("tokenizer")
        if record is None:
            raise PreprocessError(
                f"{prefix}: no tokenizer recorded beside it (hp-data preprocess writes "
                f"{os.path.basename(metadata_path(prefix))}); pass --tokenizer"
            )
        files = TokenizerFiles.recorded(record, metadata_path(prefix), allow_download)
    decoder = files.load()
    return [
        {"document": d, "text": decode_ids(decoder, dataset.get_document(d))}
        for d in range(min(count, dataset.num_documents))
    ]


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of `summarize()`."""
    lines = [
        f"dataset    {report['prefix']}",
        f"dtype      {report['dtype']}",
        f"sequences  {report['sequences']:,}",
        f"documents  {report['documents']:,}",
        f"tokens     {report['tokens']:,}",
        f".bin bytes {report['bin_bytes']:,}",
    ]
    found = report.get("provenance")
    if found is None:
        lines.append("provenance none (document ids only: no .hp.sources)")
    elif "problem" in found:
        lines.append(f"provenance unusable: {found['problem']}")
    else:
        skipped = ", ".join(f"{n:,} {why}" for why, n in found["skipped"].items() if n)
        lines.append(
            f"provenance {found['inputs']:,} input(s), {found['units']:,} unit(s)"
            + (f", skipped records: {skipped}" if skipped else "")
            + f" ({found['bytes']:,} bytes)"
        )
    if report["tokenizer"]:
        tokenizer = report["tokenizer"]
        lines.append(f"tokenizer  {tokenizer['source']} (xxh3 {tokenizer['xxh3_128'][:16]})")
    stats = report["document_length"]
    if stats["min"] is not None:
        lines.append(
            "document length (tokens): "
            + "  ".join(f"{key} {value:,}" for key, value in stats.items())
        )
        lines.append("histogram of document lengths:")
        rows = report["histogram"]
        peak = max(row["count"] for row in rows)
        width = len(f"{rows[-1]['high']:,}")
        for row in rows:
            bar = "#" * (round(40 * row["count"] / peak) if row["count"] else 0)
            span = f"{row['low']:>{width},} - {row['high']:>{width},}"
            lines.append(f"  {span} | {bar:<40} {row['count']:,}")
    return "\n".join(lines)
