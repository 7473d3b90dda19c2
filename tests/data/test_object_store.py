"""Datasets in object storage (issue 24 §1): a GPTDataset or blend over s3:// (moto's server,
behind the fault-injecting relay that counts requests) and memory:// gives every sample the
local files give, with 4 KiB chunks so that samples straddle chunk boundaries; DataLoader
workers share one download per chunk; faults end in one line, never in wrong tokens."""

from __future__ import annotations

import fcntl
import os
import pickle
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
from hp_data.blend import build_split
from hp_data.errors import HpDataError
from hp_data.gpt import GPTDataset, GPTDatasetConfig
from hp_data.object_store import StoreOptions
from hp_data.remote import DEFAULT_TIMEOUT, set_timeout
from hp_data.sampler import PretrainingSampler
from hp_data.torch_adapter import make_dataloader

from tests.helpers.fault_http import Faults, fault_server
from tests.helpers.object_store import (
    CHUNK_MB,
    s3_client,
    s3_endpoint,
    upload_memory,
    upload_s3,
    write_corpus,
)

CHUNK = 4096
FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


@pytest.fixture(autouse=True)
def _default_timeout():
    yield
    set_timeout(DEFAULT_TIMEOUT)  # what the process's other tests of remote inputs expect
    warnings.resetwarnings()


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Two corpora on disk, the reference every remote read is compared with."""
    root = tmp_path_factory.mktemp("remote-corpus")
    return {
        "a": write_corpus(root / "a", 1, count=150),
        "c": write_corpus(root / "c", 2, count=100),
    }


@pytest.fixture(scope="module")
def s3(s3_server, local):
    """The corpora in a bucket of the S3 server; its client and the bucket's name."""
    client = s3_client(s3_server["FSSPEC_S3_ENDPOINT_URL"])
    bucket = f"corpus-{uuid.uuid4().hex[:8]}"
    upload_s3(client, bucket, local)
    return client, bucket, s3_server["FSSPEC_S3_ENDPOINT_URL"]


def _config(cache, **fields) -> GPTDatasetConfig:
    return GPTDatasetConfig(seq_length=24, split="1,0,0", cache_dir=str(cache),
                            remote_chunk_mb=CHUNK_MB, **fields)  # fmt: skip


def _same(remote, reference) -> None:
    assert len(remote) == len(reference)
    for i in range(len(reference)):
        got, want = remote[i], reference[i]
        for key in FIELDS:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"sample {i} {key}")


def _bin_gets(server) -> list[tuple[str, str]]:
    """The (object, byte range) of every GET of a .bin the server answered."""
    return [r[1:] for r in server.requests if r[0] == "GET" and r[1].endswith(".bin")]


def test_every_sample_over_s3_and_memory_equals_the_local_one(tmp_path, local, s3):
    _, bucket, endpoint = s3
    reference = GPTDataset(local["a"], "train", None, _config(tmp_path / "local"))
    blend_spec = f"0.3 {local['a']} 0.7 {local['c']}"
    blend_reference = build_split(blend_spec, _config(tmp_path / "local"), "train", 150)
    upload_memory("m", local)
    with fault_server(upstream=endpoint) as server, s3_endpoint(server.url().rstrip("/")):
        for base in (f"s3://{bucket}", "memory://m"):
            cache = tmp_path / base.split(":")[0]
            remote = GPTDataset(f"{base}/a", "train", None, _config(cache))
            # Samples cross the 4 KiB chunk boundaries (the reads that straddle them).
            assert max(len(remote.chunks_for([i])) for i in range(len(remote))) >= 2
            _same(remote, reference)
            blend = build_split(f"0.3 {base}/a 0.7 {base}/c", _config(cache), "train", 150)
            _same(blend, blend_reference)
    bin_size = os.path.getsize(local["a"] + ".bin") + os.path.getsize(local["c"] + ".bin")
    gets = _bin_gets(server)
    assert len(gets) == len(set(gets)) == sum(-(-os.path.getsize(local[n] + ".bin") // CHUNK)
                                              for n in "ac")  # fmt: skip
    assert bin_size > 4 * CHUNK  # several chunks each


def test_dataloader_workers_share_one_download_per_chunk(tmp_path, local, s3):
    _, bucket, endpoint = s3
    reference = GPTDataset(local["a"], "train", None, _config(tmp_path / "local"))
    with fault_server(upstream=endpoint) as server, s3_endpoint(server.url().rstrip("/")):
        remote = GPTDataset(f"s3://{bucket}/a", "train", None, _config(tmp_path / "s3"))
        sampler = PretrainingSampler(len(remote), 0, 4, 0, 1)
        loader = make_dataloader(remote, sampler, num_workers=2)
        batches = list(loader)
    tokens = np.concatenate([b["tokens"].numpy() for b in batches])
    expected = np.stack([reference[i]["tokens"] for i in range(len(tokens))])
    np.testing.assert_array_equal(tokens, expected)
    gets = _bin_gets(server)
    assert len(gets) == len(set(gets)) == -(-os.path.getsize(local["a"] + ".bin") // CHUNK)


def _relayed(endpoint: str, faults: Faults):
    return fault_server(faults=faults, upstream=endpoint)


def test_a_truncated_body_or_a_stall_is_retried_and_a_lasting_one_ends_in_one_line(
    tmp_path, local, s3
):
    _, bucket, endpoint = s3
    reference = GPTDataset(local["a"], "train", None, _config(tmp_path / "local"))
    faults = Faults(truncate_on={1, 4}, stall_on={6}, stall_seconds=2.5)
    with _relayed(endpoint, faults) as server, s3_endpoint(server.url().rstrip("/")):
        config = _config(tmp_path / "cache", remote_timeout_s=1.5)  # a loaded machine: margin
        remote = GPTDataset(f"s3://{bucket}/a", "train", None, config)
        # The samples of chunks 0 and 1 through one truncated body and one stall, each asked
        # again; then every body truncated, for the samples of the chunks not read yet.
        early = {i for i in range(len(remote)) if max(c for _, c in remote.chunks_for([i])) < 2}
        for i in sorted(early):
            np.testing.assert_array_equal(remote[i]["tokens"], reference[i]["tokens"])
        assert server.gets >= 6 and early
        faults.truncate_on = set(range(server.gets + 1, server.gets + 100))
        with pytest.raises(HpDataError) as info:
            for i in sorted(set(range(len(remote))) - early):
                np.testing.assert_array_equal(remote[i]["tokens"], reference[i]["tokens"])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"s3://{bucket}/a.bin: cannot read bytes ")
    assert "3 tries" in message


def test_a_server_gone_mid_run_ends_in_one_line_within_the_timeouts(tmp_path, local, s3):
    _, bucket, endpoint = s3
    with _relayed(endpoint, Faults()) as server, s3_endpoint(server.url().rstrip("/")):
        config = _config(tmp_path / "cache", remote_timeout_s=1.5)  # a loaded machine: margin
        remote = GPTDataset(f"s3://{bucket}/a", "train", None, config)
        first = remote[0]
        server.go_down()
        # A worker's copy reopens from the pins and the cache: no request to the store.
        copy = pickle.loads(pickle.dumps(remote))
        np.testing.assert_array_equal(copy[0]["tokens"], first["tokens"])
        start = time.monotonic()
        with pytest.raises(HpDataError) as info:
            for i in range(len(remote)):
                remote[i]
        waited = time.monotonic() - start
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"s3://{bucket}/a.bin: ")
    assert "cannot reach the server, 3 tries" in str(info.value)
    assert waited < 30  # never a hang: three tries with a short backoff


def test_an_object_replaced_under_the_run_is_named_and_never_read(tmp_path, local, s3):
    client, _, endpoint = s3
    bucket = f"replaced-{uuid.uuid4().hex[:8]}"
    upload_s3(client, bucket, {"a": local["a"]})
    with s3_endpoint(endpoint):
        remote = GPTDataset(f"s3://{bucket}/a", "train", None, _config(tmp_path / "cache"))
        remote[0]
        data = bytearray(Path(local["a"] + ".bin").read_bytes())
        data[::2] = bytes(len(data[::2]))  # the same size, other tokens
        client.put_object(Bucket=bucket, Key="a.bin", Body=bytes(data))
        with pytest.raises(HpDataError) as info:
            for i in range(len(remote)):
                remote[i]
    assert str(info.value) == f"s3://{bucket}/a.bin: changed during the run; rerun"


def test_a_damaged_cache_chunk_is_fetched_again(tmp_path, local):
    upload_memory("damaged", {"a": local["a"]})
    reference = GPTDataset(local["a"], "train", None, _config(tmp_path / "local"))
    first = GPTDataset("memory://damaged/a", "train", None, _config(tmp_path / "cache"))
    _same(first, reference)
    corpus = first.dataset.remote
    path = corpus.chunk_path(1)
    with open(path, "r+b") as stream:
        stream.truncate(100)
    again = GPTDataset("memory://damaged/a", "train", None, _config(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="a damaged cache"):
        _same(again, reference)
    assert os.path.getsize(path) == CHUNK + 8  # the data, then their xxh3-64


def test_eviction_keeps_the_bound_and_deletes_only_chunk_files(tmp_path, local):
    upload_memory("evict", {"a": local["a"]})
    reference = GPTDataset(local["a"], "train", None, _config(tmp_path / "local"))
    cache = tmp_path / "cache"
    bound = 3 * CHUNK
    config = _config(cache, remote_cache_gb=bound / 2**30)
    remote = GPTDataset("memory://evict/a", "train", None, config)
    corpus = remote.dataset.remote
    mine = [cache / "notes.txt", cache / "remote" / "mine.chunk",
            corpus.chunk_dir + "/0000000000.chunk.keep", corpus.chunk_dir + "/x.chunk"]  # fmt: skip
    for path in mine:
        Path(path).write_text("the user's")
    _same(remote, reference)  # reads every chunk, some more than once
    chunks = [n for n in os.listdir(corpus.chunk_dir) if n.endswith(".chunk") and n[0] == "0"]
    assert 0 < len(chunks) * CHUNK <= bound
    assert all(Path(path).read_text() == "the user's" for path in mine)


def test_a_wait_for_another_process_download_is_bounded(tmp_path, local):
    upload_memory("wait", {"a": local["a"]})
    config = _config(tmp_path / "cache", remote_timeout_s=0.05)
    remote = GPTDataset("memory://wait/a", "train", None, config)
    corpus = remote.dataset.remote
    with open(os.path.join(corpus.chunk_dir, "stripe-0.lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process downloading chunk 0, stuck
        with pytest.raises(HpDataError) as info:
            corpus.fetch(0)
    assert str(info.value) == (
        f"memory://wait/a.bin: another process's download of bytes 0-{CHUNK} wrote nothing "
        "for 0.5 s (10 x remote_timeout_s); is one stuck?"
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("chunk_mb", 0.001, "remote_chunk_mb = 0.001: give at least 1/256 MiB (a 4 KiB page)"),
        ("chunk_mb", float("nan"), "remote_chunk_mb = nan: give at least 1/256 MiB (a 4 KiB page)"),
        ("cache_gb", 0, "remote_cache_gb = 0: give a positive size in GiB"),
        ("cache_gb", "1", "remote_cache_gb = '1': give a positive size in GiB"),
        ("timeout_s", -1.0, "remote_timeout_s = -1.0: give a positive number of seconds"),
        ("timeout_s", True, "remote_timeout_s = True: give a positive number of seconds"),
    ],
)
def test_bad_store_options_are_one_line(field, value, message):
    with pytest.raises(HpDataError) as info:
        StoreOptions(**{field: value})
    assert str(info.value) == message


def test_read_ahead_fetches_what_the_next_samples_read_within_its_bound(tmp_path, local):
    import threading

    from hp_data.read_ahead import ReadAhead

    upload_memory("ahead", {"a": local["a"]})
    remote = GPTDataset("memory://ahead/a", "train", None, _config(tmp_path / "cache"))
    corpus = remote.dataset.remote
    wanted = {chunk for _, chunk in remote.chunks_for(range(10))}
    assert len(wanted) > 2
    running, most, lock, fetch = [0], [0], threading.Lock(), corpus.fetch

    def slow_fetch(chunk: int) -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        try:
            return fetch(chunk)
        finally:
            with lock:
                running[0] -= 1

    corpus.fetch = slow_fetch
    ahead = ReadAhead(remote, in_flight=2)
    deadline = time.monotonic() + 10
    while not all(corpus.cached(c) for c in wanted) and time.monotonic() < deadline:
        ahead.want(range(10))  # as a loader does before each step
        time.sleep(0.01)
    ahead.close()
    assert {c for c in range(100) if corpus.cached(c)} == wanted  # those, and only those
    assert most[0] == 2


def test_phases_over_object_storage_equal_the_local_phases(tmp_path, local):
    """A phased run's samples (two phases, a corpus read again after the other) over
    memory:// equal the local ones, and its read-ahead names the chunks those samples read."""
    from hp_data.phases import Phase, build_phased

    upload_memory("phased", local)
    cumulative = np.arange(0, 41, dtype=np.int64) * 4  # 40 steps of 4 samples

    def phases(base: str) -> list[Phase]:
        return [Phase(from_step=1, path=f"0.5 {base}/a 0.5 {base}/c"),
                Phase(from_step=20, path=f"{base}/a")]  # fmt: skip

    reference = build_phased(phases(os.path.dirname(local["a"])), _config(tmp_path / "l"),
                             cumulative)  # fmt: skip
    remote = build_phased(phases("memory://phased"), _config(tmp_path / "r"), cumulative)
    _same(remote, reference)
    wanted = remote.chunks_for(range(60, 100))  # across the phase boundary (step 20)
    direct = {(id(c), chunk) for i in range(60, 100) for c, chunk in remote.chunks_for([i])}
    pairs = [(id(c), chunk) for c, chunk in wanted]
    assert len(pairs) == len(set(pairs)) and set(pairs) == direct  # each chunk once
    assert len({id(c) for c, _ in wanted}) == 2  # phase 0 reads both corpora
    assert not reference.chunks_for(range(60, 100))  # local files: nothing to fetch
