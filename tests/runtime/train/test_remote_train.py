"""hp-train on datasets in object storage (issue 24 §1): `data.path` (a prefix or a blend) and
`data.valid_path` as s3:// URLs of the local S3 server give the losses of the local files, on
one process and on 2 FSDP ranks; the vocabulary check reads no .bin; the three keys refuse bad
values in one line."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hp_data.errors import HpDataError
from hp_runtime.train.batch import batch_plan
from hp_runtime.train.config import ConfigError, load_config
from hp_runtime.train.data import check_data, resolve_data

from tests.helpers.distributed import run_ranks
from tests.helpers.fault_http import fault_server
from tests.helpers.object_store import (
    CHUNK_MB,
    s3_client,
    s3_endpoint,
    upload_memory,
    upload_s3,
    write_corpus,
)
from tests.helpers.train import FAST, _train_rank, hp_train_here, train_ranks


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, s3_server):
    """Two corpora on disk and the same in a bucket: (local prefixes, bucket, endpoint)."""
    root = tmp_path_factory.mktemp("remote-train")
    local = {"a": write_corpus(root / "a", 3), "c": write_corpus(root / "c", 4, count=120)}
    endpoint = s3_server["FSSPEC_S3_ENDPOINT_URL"]
    bucket = f"train-{uuid.uuid4().hex[:8]}"
    upload_s3(s3_client(endpoint), bucket, local)
    return local, bucket, endpoint


def _run(tmp_path, name: str, path: str, *overrides: str) -> list[str]:
    return [
        "data.type=megatron",
        f"data.path={path}",
        "data.split=1,0,0",
        "data.seq_length=16",
        f"data.cache_dir={tmp_path / name / 'cache'}",
        f"data.remote_chunk_mb={CHUNK_MB}",
        "model.vocab_size=1000",
        "train.steps=3",
        f"train.run_dir={tmp_path / name / 'run'}",
        *overrides,
    ]


def _s3_rank(rank: int, world: int, endpoint: str, overrides: list[str]) -> dict:
    with s3_endpoint(endpoint):
        return _train_rank(rank, world, overrides)


def _s3_ranks(world: int, endpoint: str, overrides: list[str]) -> list[dict]:
    return run_ranks(_s3_rank, world, endpoint, [*FAST, *overrides])


# A blend for training, another corpus for validation; 2 micro-batches of 2 a step.
LAYOUT = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_interval=3",
          "train.eval_iters=1"]  # fmt: skip


def _blend(names: dict[str, str]) -> str:
    return f"0.3 {names['a']} 0.7 {names['c']}"


@pytest.fixture(scope="module")
def on_disk(corpora, tmp_path_factory):
    """The run on the local files, one process: the reference."""
    local, _, _ = corpora
    root = tmp_path_factory.mktemp("on-disk")
    valid = f"data.valid_path={local['c']}"
    return train_ranks(1, _run(root, "local", _blend(local), valid, *LAYOUT))[0]


def _remote_run(tmp_path, bucket: str) -> list[str]:
    valid = f"data.valid_path=s3://{bucket}/c"
    urls = {name: f"s3://{bucket}/{name}" for name in ("a", "c")}
    return _run(tmp_path, "s3", _blend(urls), valid, *LAYOUT)


def test_one_process_over_s3_trains_bit_identically_to_the_local_files(tmp_path, corpora, on_disk):
    _, bucket, endpoint = corpora
    remote = _s3_ranks(1, endpoint, _remote_run(tmp_path, bucket))[0]
    assert remote["losses"] == on_disk["losses"]
    assert remote["val_losses"] == on_disk["val_losses"] != {}
    assert len(on_disk["losses"]) == 3


def test_two_fsdp_ranks_over_s3_give_the_local_run_losses(tmp_path, corpora, on_disk):
    """FSDP 2 with one micro-batch a rank: the local run's losses, as every layout gives them
    (tests/runtime/train/test_loss_equivalence.py: to float rounding)."""
    _, bucket, endpoint = corpora
    steps = sorted(on_disk["val_losses"])
    for rank in _s3_ranks(2, endpoint, [*_remote_run(tmp_path, bucket), "parallel.dp_shard=2"]):
        np.testing.assert_allclose(rank["losses"], on_disk["losses"], rtol=1e-5, atol=0)
        assert sorted(rank["val_losses"]) == steps
        got = [rank["val_losses"][s] for s in steps]
        want = [on_disk["val_losses"][s] for s in steps]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def test_bytes_flipped_in_the_cached_chunks_never_reach_a_step(tmp_path, corpora):
    """Issue 40: a second run over the first's node cache, every token of every cached chunk
    damaged in place (same size): its losses are the first's, bit for bit, so every step
    received the written tokens (before chunks were checked, the damaged ones were trained on
    and the losses differed)."""
    _, bucket, endpoint = corpora
    first = _s3_ranks(1, endpoint, _run(tmp_path, "first", f"s3://{bucket}/a"))[0]
    chunks = sorted((tmp_path / "first" / "cache" / "remote").glob("*/chunks-*/*.chunk"))
    assert len(chunks) > 3
    for path in chunks:  # every token id's low bit (uint16, little-endian): ids stay < 1000
        data = np.frombuffer(path.read_bytes(), np.uint8).copy()
        data[: len(data) - 8 : 2] ^= 1  # the data, not the chunk's 8-byte trailer
        path.write_bytes(data.tobytes())
    shared = f"data.cache_dir={tmp_path / 'first' / 'cache'}"
    second = _s3_ranks(1, endpoint, _run(tmp_path, "second", f"s3://{bucket}/a", shared))[0]
    assert second["losses"] == first["losses"]
    assert len(first["losses"]) == 3


def test_the_vocabulary_check_reads_the_record_not_the_bin(tmp_path, corpora):
    _, bucket, endpoint = corpora
    with fault_server(upstream=endpoint) as server, s3_endpoint(server.url().rstrip("/")):
        config = load_config(
            None, _run(tmp_path, "check", f"0.5 s3://{bucket}/a 0.5 s3://{bucket}/c")
        )
        check_data(resolve_data(config, batch_plan(config), validation=False))
    gets = [r[1] for r in server.requests if r[0] == "GET"]
    assert gets and not [path for path in gets if path.endswith(".bin")]


def test_a_remote_bin_without_a_record_larger_than_the_cache_is_refused(tmp_path):
    prefix = write_corpus(tmp_path / "bare", 5, record=False)
    upload_memory("bare", {"x": prefix})
    config = load_config(None, _run(tmp_path, "bare", "memory://bare/x",
                                    "data.remote_cache_gb=1e-6"))  # fmt: skip
    with pytest.raises(HpDataError) as info:  # hp-train says it as "data: ..."
        check_data(resolve_data(config, batch_plan(config), validation=False))
    assert str(info.value).startswith(
        "memory://bare/x: its .hp.json records no max_token_id, and finding the largest token "
        "id would download the whole .bin ("
    )
    assert "more than data.remote_cache_gb = 1e-06" in str(info.value)
    # Within the bound it is scanned once, through the cache.
    fits = load_config(None, _run(tmp_path, "bare", "memory://bare/x"))
    check_data(resolve_data(fits, batch_plan(fits), validation=False))


def test_a_missing_remote_prefix_is_one_line(tmp_path, corpora):
    _, bucket, endpoint = corpora
    with s3_endpoint(endpoint):
        done = hp_train_here(*FAST, *_run(tmp_path, "missing", f"s3://{bucket}/none"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"hp-train: error: data.path: s3://{bucket}/none.idx: no such dataset"
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.remote_chunk_mb=0", "data.remote_chunk_mb: must be in [0.00390625, 4096], got 0"),
        ("data.remote_chunk_mb=8192", "data.remote_chunk_mb: must be in [0.00390625, 4096]"),
        ("data.remote_chunk_mb=big", "data.remote_chunk_mb: expected "),
        ("data.remote_cache_gb=0", "data.remote_cache_gb: must be more than 0, got 0"),
        ("data.remote_cache_gb=-5", "data.remote_cache_gb: must be more than 0, got -5"),
        ("data.remote_cache_gb=true", "data.remote_cache_gb: expected "),
        ("data.remote_timeout_s=0", "data.remote_timeout_s: must be more than 0, got 0"),
        ("data.remote_timeout_s=nan", "data.remote_timeout_s: "),
        ('data.remote_timeout_s="60"', "data.remote_timeout_s: expected "),
    ],
)
def test_bad_values_of_the_remote_keys_are_one_line(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.type=dummy", override])
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(message)


def test_the_loader_reads_ahead_the_samples_its_sampler_gives_next():
    """The ids handed to the read-ahead are the ones the sampler yields next on this rank."""
    import torch
    from hp_runtime.train.batch import BatchPlan
    from hp_runtime.train.loader import Loader

    plan = BatchPlan(micro_batch_size=2, global_batch_size=8, dp_size=2)
    dataset = [{"tokens": torch.zeros(4, dtype=torch.int64)}] * 200
    loader = Loader(dataset, plan, 1, 10, torch.device("cpu"), 0, 2, background=False)
    sampler = iter(loader.sampler)
    upcoming = [i for _ in range(loader._ahead) for i in next(sampler)]
    assert loader._coming() == upcoming
    loader.take(3)
    after = iter(type(loader.sampler)(200, 10 + 3 * 4, 2, 1, 2))
    assert loader._coming() == [i for _ in range(loader._ahead) for i in next(after)]


def test_a_store_that_cannot_be_reached_is_one_line_without_its_credentials(tmp_path):
    url = "https://user:hunter2@127.0.0.1:9/corpus"  # port 9: nothing listens
    done = hp_train_here(*FAST, *_run(tmp_path, "unreachable", url, "data.remote_timeout_s=0.5"))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "hp-train: error: data.path: https://***:***@127.0.0.1:9/corpus.idx: cannot read: "
        "cannot reach the server, 3 tries (Cannot connect to host 127.0.0.1:9 ssl:default "
        "[Connect call failed ('127.0.0.1', 9)])"
    ]
    signed = hp_train_here(*FAST, *_run(tmp_path, "signed", url + "?sig=s3cret"))
    assert signed.stderr.splitlines() == [
        "hp-train: error: data.path: https://***:***@127.0.0.1:9/corpus?sig=***: a URL prefix "
        "cannot carry a query or fragment (PREFIX.idx and PREFIX.bin are named by adding to "
        "it); give the store's credentials in its environment or fsspec configuration instead"
    ]
