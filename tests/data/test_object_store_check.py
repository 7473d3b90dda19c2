"""Every token read from a node cache is the token that was written (issue 40 §1): hp-data's
writer records the xxh3-64 of every 4 MiB block of a `.bin` in its `.hp.json`, and the cache
checks each chunk against it as it arrives and when a process maps it, or, where no record
covers a chunk (Megatron's files, chunks smaller than a block), against the chunk's own hash
taken at download. Bytes flipped in a cached chunk (same size) are fetched again; a store
whose `.bin` differs from its record stops the read in one line. The expected hashes here are
xxhash's own, over the file's bytes."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner
from hp_data import IndexedDatasetBuilder
from hp_data.cli import main
from hp_data.errors import HpDataError
from hp_data.gpt import GPTDataset, GPTDatasetConfig
from hp_data.merge import merge_datasets
from hp_data.remote import DEFAULT_TIMEOUT, set_timeout

from tests.helpers.fault_http import Faults, fault_server
from tests.helpers.object_store import CHUNK_MB, upload_memory, write_corpus

BLOCK = 4 << 20
FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


@pytest.fixture(autouse=True)
def _default_timeout():
    yield
    set_timeout(DEFAULT_TIMEOUT)
    warnings.resetwarnings()


def _block_hexes(data: bytes, block: int = BLOCK) -> str:
    return "".join(
        xxhash.xxh3_64_hexdigest(data[i : i + block]) for i in range(0, len(data), block)
    )


def _record(prefix: str) -> dict:
    return json.loads(Path(prefix + ".hp.json").read_text())["bin_blocks"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small corpus (one block, many 4 KiB chunks) with hp's record."""
    return write_corpus(tmp_path_factory.mktemp("check") / "a", 5, count=200)


def _config(cache: Path, chunk_mb: float = CHUNK_MB, **fields) -> GPTDatasetConfig:
    return GPTDatasetConfig(seq_length=24, split="1,0,0", cache_dir=str(cache),
                            remote_chunk_mb=chunk_mb, **fields)  # fmt: skip


def _samples(dataset) -> list[dict[str, np.ndarray]]:
    return [{k: np.asarray(dataset[i][k]) for k in FIELDS} for i in range(len(dataset))]


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for key in FIELDS:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"sample {i} {key}")


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as stream:
        stream.seek(at)
        byte = stream.read(1)
        stream.seek(at)
        stream.write(bytes([byte[0] ^ 0x5A]))


# -- the writer's record -------------------------------------------------------------------


def test_the_builder_records_the_hash_of_every_block(tmp_path):
    """Three blocks (4 + 4 + 2 MiB): each block's xxh3-64, computed here from the file."""
    prefix = str(tmp_path / "big")
    tokens = np.random.default_rng(0).integers(0, 60000, 5 << 20, dtype=np.uint16)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:  # no metadata: recorded anyway
        builder.add_documents(tokens, [1 << 20] * 5)
    data = Path(prefix + ".bin").read_bytes()
    assert len(data) == 10 << 20
    assert _record(prefix) == {"block_bytes": BLOCK, "xxh3_64": _block_hexes(data)}


def test_preprocess_and_merge_record_their_outputs(tmp_path, example_corpus, example_tokenizer):
    out = str(tmp_path / "docs")
    args = ["preprocess", str(example_corpus), "--out", out, "--tokenizer", str(example_tokenizer)]
    result = CliRunner().invoke(main, [*args, "--quiet"])
    assert result.exit_code == 0, result.output
    assert _record(out)["xxh3_64"] == _block_hexes(Path(out + ".bin").read_bytes())
    other = write_corpus(tmp_path / "other", 1)  # the same dtype, another tokenizer's record
    merge_datasets(str(tmp_path / "merged"), [out, other])
    merged = Path(tmp_path / "merged.bin").read_bytes()
    assert merged == Path(out + ".bin").read_bytes() + Path(other + ".bin").read_bytes()
    assert _record(str(tmp_path / "merged"))["xxh3_64"] == _block_hexes(merged)


def test_inspect_check_finds_a_flipped_byte_of_the_bin(tmp_path):
    prefix = write_corpus(tmp_path / "a", 2)
    assert CliRunner().invoke(main, ["inspect", prefix, "--check"]).exit_code == 0
    _flip(prefix + ".bin", os.path.getsize(prefix + ".bin") - 1)
    result = CliRunner().invoke(main, ["inspect", prefix, "--check"])
    assert result.exit_code != 0
    size = os.path.getsize(prefix + ".bin")
    assert (
        f"{prefix}.bin: bytes 0-{BLOCK:,} (block 0) differ from what was written" in result.output
    )
    assert size < BLOCK


# -- the cache ------------------------------------------------------------------------------

# (chunk MiB, the record kept): the record covers one 4 MiB chunk; 4 KiB chunks are not whole
# blocks, and Megatron's files have no record: both are checked by the chunk's own hash.
MODES = {"record": (4.0, True), "small-chunks": (CHUNK_MB, True), "megatron": (CHUNK_MB, False)}


def _upload(root: str, prefix: str, keep_record: bool, tmp_path: Path) -> str:
    if not keep_record:  # a Megatron-made dataset: no .hp.json
        copy = tmp_path / "megatron"
        for suffix in (".bin", ".idx"):
            Path(f"{copy}{suffix}").write_bytes(Path(prefix + suffix).read_bytes())
        prefix = str(copy)
    upload_memory(root, {"a": prefix})
    return f"memory://{root}/a"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["middle", "last byte"])
def test_a_flipped_cached_chunk_is_fetched_again_never_read(tmp_path, corpus, mode, where):
    chunk_mb, keep = MODES[mode]
    url = _upload(f"flip-{mode}-{where[0]}", corpus, keep, tmp_path)
    reference = _samples(GPTDataset(corpus, "train", None, _config(tmp_path / "local")))
    first = GPTDataset(url, "train", None, _config(tmp_path / "cache", chunk_mb))
    _same(_samples(first), reference)
    remote = first.dataset.remote
    assert remote.record is not None if keep else remote.record is None
    chunks = sorted(Path(remote.chunk_dir).glob("*.chunk"))
    assert chunks and all(p.stat().st_size > 8 for p in chunks)
    clean = {p: p.read_bytes() for p in chunks}
    for path in chunks:  # every chunk, in the data (not in the trailer)
        data = path.stat().st_size - 8
        _flip(str(path), data // 2 if where == "middle" else data - 1)
    again = GPTDataset(url, "train", None, _config(tmp_path / "cache", chunk_mb))
    with pytest.warns(
        UserWarning, match="not the bytes that were written .a damaged cache."
    ) as seen:
        _same(_samples(again), reference)
    assert len([w for w in seen if "damaged cache" in str(w.message)]) == len(chunks)
    assert {p: p.read_bytes() for p in chunks} == clean


def test_a_chunk_damaged_on_the_way_is_fetched_once_more(tmp_path, corpus):
    """One download's body damaged in transit (same length, same ETag): with the record the
    chunk is downloaded again and the samples are the written ones."""
    reference = _samples(GPTDataset(corpus, "train", None, _config(tmp_path / "local")))
    root = tmp_path / "served"
    root.mkdir()
    for suffix in (".bin", ".idx", ".hp.json"):
        (root / f"a{suffix}").write_bytes(Path(corpus + suffix).read_bytes())
    with fault_server(root, Faults(flip={"/a.bin": 1})) as server:
        remote = GPTDataset(server.url("a"), "train", None, _config(tmp_path / "cache", 4.0))
        _same(_samples(remote), reference)
        gets = [r for r in server.requests if r[0] == "GET" and r[1] == "/a.bin"]
    assert server.faults.flip == {"/a.bin": 0}  # the damage was served
    assert len(gets) == 2


def test_a_store_bin_unlike_its_record_is_one_line_and_nothing_cached(tmp_path, corpus):
    """The store's .bin was damaged after the record was written (a half-synced copy): two
    downloads differ from it, and the read stops in one line naming object, chunk and path."""
    upload_memory("unlike", {"a": corpus})
    import fsspec

    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat("/unlike/a.bin"))
    data[len(data) // 2] ^= 1
    fs.pipe("/unlike/a.bin", bytes(data))
    remote = GPTDataset("memory://unlike/a", "train", None, _config(tmp_path / "cache", 4.0))
    corpus_ = remote.dataset.remote
    with pytest.raises(HpDataError) as info:
        remote[0]
    assert str(info.value) == (
        f"memory://unlike/a.bin: chunk 0 (bytes 0-{len(data)}, cached at "
        f"{corpus_.chunk_path(0)}) differs from the block hashes in memory://unlike/a.hp.json on "
        "two downloads: the store's .bin is not the one hp-data wrote; upload the dataset's "
        "files again"
    )
    left = [n for n in os.listdir(corpus_.chunk_dir) if not n.startswith("stripe-")]
    assert left == []  # neither the chunk nor a temporary file of it


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("not a table", "bin_blocks needs a positive integer block_bytes and a hex string xxh3_64"),
        ({"block_bytes": 0, "xxh3_64": ""}, "bin_blocks needs a positive integer block_bytes"),
        ({"block_bytes": -4, "xxh3_64": "00"}, "bin_blocks needs a positive integer block_bytes"),
        ({"block_bytes": 4.5, "xxh3_64": "00"}, "bin_blocks needs a positive integer block_bytes"),
        ({"block_bytes": BLOCK, "xxh3_64": 7}, "a hex string xxh3_64"),
        ({"block_bytes": BLOCK, "xxh3_64": "zz" * 8}, "bin_blocks.xxh3_64 is not 16 hex digits"),
        ({"block_bytes": BLOCK, "xxh3_64": "0" * 15}, "bin_blocks.xxh3_64 is not 16 hex digits"),
        ({"block_bytes": BLOCK, "xxh3_64": "0" * 32}, "bin_blocks records 2 blocks of 4,194,304"),
        ({"block_bytes": 1, "xxh3_64": "0" * 16}, "bin_blocks records 1 blocks of 1 bytes"),
    ],
)
def test_a_bad_record_is_one_line_naming_the_file(tmp_path, corpus, record, message):
    bad = tmp_path / "bad"
    for suffix in (".bin", ".idx"):
        Path(f"{bad}{suffix}").write_bytes(Path(corpus + suffix).read_bytes())
    metadata = json.loads(Path(corpus + ".hp.json").read_text())
    Path(f"{bad}.hp.json").write_text(json.dumps({**metadata, "bin_blocks": record}))
    root = f"bad-{abs(hash(json.dumps(record)))}"
    upload_memory(root, {"a": str(bad)})
    with pytest.raises(HpDataError) as info:  # at open, before any chunk is read
        GPTDataset(f"memory://{root}/a", "train", None, _config(tmp_path / "cache", 4.0))
    assert str(info.value).startswith(f"memory://{root}/a.hp.json: ")
    assert message in str(info.value) and "\n" not in str(info.value)
    result = CliRunner().invoke(main, ["inspect", str(bad), "--check"])
    assert result.exit_code != 0 and message in result.output


def test_an_older_cache_chunk_without_its_hash_is_replaced_quietly(tmp_path, corpus):
    upload_memory("older", {"a": corpus})
    reference = _samples(GPTDataset(corpus, "train", None, _config(tmp_path / "local")))
    config = _config(tmp_path / "cache")
    remote = GPTDataset("memory://older/a", "train", None, config)
    corpus_ = remote.dataset.remote
    os.makedirs(corpus_.chunk_dir, exist_ok=True)
    data = Path(corpus + ".bin").read_bytes()
    Path(corpus_.chunk_path(0)).write_bytes(data[:4096])  # the layout before the trailer
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", "memory://.*no ETag")
        _same(_samples(GPTDataset("memory://older/a", "train", None, config)), reference)
    assert Path(corpus_.chunk_path(0)).read_bytes()[:4096] == data[:4096]
    assert os.path.getsize(corpus_.chunk_path(0)) == 4096 + 8


def test_a_slow_download_by_another_process_is_waited_for_while_it_writes(tmp_path, corpus):
    """Another process holds chunk 0's lock for 3x the idle bound, writing its temporary file
    all along: the wait goes on (a stuck one ends in one line: test_object_store)."""
    upload_memory("slow", {"a": corpus})
    config = _config(tmp_path / "cache", remote_timeout_s=0.05)  # idle bound: 10 x 0.05 s
    remote = GPTDataset("memory://slow/a", "train", None, config).dataset.remote
    part = os.path.join(remote.chunk_dir, "0000000000.chunk.tmp-1-1")
    held = open(os.path.join(remote.chunk_dir, "stripe-0.lock"), "w")  # noqa: SIM115
    fcntl.flock(held, fcntl.LOCK_EX)

    def downloader() -> None:
        with open(part, "wb") as stream:
            for _ in range(15):
                stream.write(b"x" * 100)
                stream.flush()
                time.sleep(0.1)
        os.remove(part)
        held.close()  # gone without a chunk: the waiter downloads it itself

    thread = threading.Thread(target=downloader)
    start = time.monotonic()
    thread.start()
    path = remote.fetch(0)
    thread.join()
    assert time.monotonic() - start >= 1.4
    assert Path(path).read_bytes()[:-8] == Path(corpus + ".bin").read_bytes()[:4096]
