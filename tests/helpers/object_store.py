"""Datasets in object storage for tests: small corpora written locally, uploaded to the local
S3 server (moto) or fsspec's memory://, and this process pointed at a server's address."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

CHUNK_MB = 4096 / 2**20  # 4 KiB chunks: a corpus of a few hundred documents spans several


def write_corpus(prefix: Path, seed: int, count: int = 300, record: bool = True) -> str:
    """`count` documents of 5-80 ids below 1000, each ending in EOD 0; `record`: with a
    `.hp.json` that records the largest id (as hp-data's preprocess writes it)."""
    from hp_data import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    documents = [np.append(rng.integers(1, 1000, rng.integers(5, 80)), 0) for _ in range(count)]
    metadata = None
    if record:
        largest = max(int(d.max()) for d in documents)
        metadata = {"schema": 1, "eod": 0, "max_token_id": largest}
    with IndexedDatasetBuilder(str(prefix), np.uint16, metadata=metadata) as builder:
        for document in documents:
            builder.add_document(document, [len(document)])
    return str(prefix)


def files_of(prefix: str) -> dict[str, bytes]:
    """The files of a local prefix, by suffix."""
    suffixes = (".bin", ".idx", ".hp.json")
    return {s: Path(prefix + s).read_bytes() for s in suffixes if os.path.exists(prefix + s)}


def upload_s3(client: object, bucket: str, prefixes: dict[str, str]) -> None:
    """Each local prefix as `s3://bucket/NAME` (a fresh versioned bucket)."""
    client.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
    client.put_bucket_versioning(  # type: ignore[attr-defined]
        Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    for name, prefix in prefixes.items():
        for suffix, data in files_of(prefix).items():
            client.put_object(Bucket=bucket, Key=name + suffix, Body=data)  # type: ignore[attr-defined]


def upload_memory(root: str, prefixes: dict[str, str]) -> None:
    """Each local prefix as `memory://ROOT/NAME`."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for name, prefix in prefixes.items():
        for suffix, data in files_of(prefix).items():
            fs.pipe(f"/{root}/{name}{suffix}", data)


def s3_client(endpoint: str) -> object:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip


def flip_object(client: Any, bucket: str, key: str) -> None:
    """The object at `key` with its middle byte inverted: damage in the store that keeps its
    length."""
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


@contextlib.contextmanager
def s3_endpoint(endpoint: str) -> Iterator[None]:
    """This process's s3:// URLs served by `endpoint` (fsspec's configuration, read when hp-data
    makes its filesystem; its cache emptied before and after)."""
    import fsspec
    from hp_data.remote import _filesystem

    saved_conf = fsspec.config.conf.get("s3")
    saved_env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    _filesystem.cache_clear()
    try:
        yield
    finally:
        _filesystem.cache_clear()
        if saved_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved_conf
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
