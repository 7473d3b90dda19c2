"""Checkpoints in object storage (issue 46): `checkpoint.dir` as an s3:// URL of the local S3
server (moto), reached through a relay that fails on request (503s, a stall, the server gone,
a request held until the job is killed). Every resumed run's losses are an uninterrupted
run's; what the store holds is read back with boto, not with hp."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from tests.helpers.distributed import run_ranks
from tests.helpers.fault_http import Faults, fault_server
from tests.helpers.object_store import flip_object, s3_client, s3_endpoint
from tests.helpers.train import (
    FAST,
    HP_TRAIN,
    _train_rank,
    hp_train_here,
    plant_in_optimizer,
    records,
    signal_tree,
)

RUN = [
    *FAST, "data.type=dummy", "data.seq_length=16", "train.global_batch_size=2",
    "train.micro_batch_size=1", "train.steps=6", "checkpoint.interval=2",
    "data.remote_timeout_s=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def moto(s3_server) -> str:
    return s3_server["FSSPEC_S3_ENDPOINT_URL"]


@pytest.fixture
def bucket(moto) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    s3_client(moto).create_bucket(Bucket=name)  # type: ignore[attr-defined]
    return name


@contextlib.contextmanager
def relay(moto: str, faults: Faults | None = None) -> Iterator[object]:
    """A relay to moto that fails as `faults` say, this process's s3:// URLs pointed at it."""
    with (
        fault_server(faults=faults or Faults(), upstream=moto) as server,
        s3_endpoint(server.url().rstrip("/")),
    ):
        yield server


def keys(moto: str, bucket: str) -> dict[str, bytes]:
    """Every object of the bucket, read by boto."""
    client = s3_client(moto)
    found = client.list_objects_v2(Bucket=bucket).get("Contents", [])  # type: ignore[attr-defined]
    return {
        o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()  # type: ignore[attr-defined]
        for o in found
    }


def committed_steps(moto: str, bucket: str, prefix: str = "run/") -> list[int]:
    pattern = re.compile(re.escape(prefix) + r"step-(\d+)/commit\.json")
    return sorted(int(m[1]) for k in keys(moto, bucket) if (m := pattern.fullmatch(k)))


def listing_holds(objects: dict[str, bytes], prefix: str) -> bool:
    """Whether the commit object under `prefix` lists exactly objects that are there, each
    of its size and xxh3-64 (computed here)."""
    commit = json.loads(objects[prefix + "commit.json"])
    for name, entry in commit["objects"].items():
        data = objects.get(prefix + name)
        if data is None or len(data) != entry["size"]:
            return False
        if xxhash.xxh3_64_hexdigest(data) != entry["xxh3"]:
            return False
    return True


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir)}  # a resumed step: its last record


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The run uninterrupted, its checkpoints on the local disk."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert hp_train_here(*RUN, f"train.run_dir={run}").returncode == 0
    return losses(run)


def test_a_kill_during_an_upload_resumes_from_the_newest_committed(
    moto, bucket, tmp_path, reference, s3_server
):
    """SIGKILL while step 4 is being uploaded (in the background: checkpoint.async), its
    shards there, its `.metadata` not;
    the same command again names step 4 as unfinished, resumes from step 2, and trains the
    uninterrupted run's losses bit for bit."""
    url = f"s3://{bucket}/run"
    args = [*RUN, f"train.run_dir={tmp_path / 'run'}", f"checkpoint.dir={url}",
            "checkpoint.async=true"]  # fmt: skip
    uploading, killed = threading.Event(), threading.Event()

    def hold(number: int, method: str, path: str) -> bool:
        if method == "PUT" and path.endswith("/step-0000004/.metadata"):  # shards are there
            uploading.set()
            killed.wait(120)
            return True  # never reaches the store
        return False

    with relay(moto, Faults(write_hook=hold)) as server:
        env = {**os.environ, **s3_server, "FSSPEC_S3_ENDPOINT_URL": server.url().rstrip("/")}
        process = subprocess.Popen(
            [HP_TRAIN, *args], env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            assert uploading.wait(120), "the upload of step 4 never began"
        finally:
            signal_tree(process.pid, signal.SIGKILL)
            process.wait(60)
            killed.set()
    assert committed_steps(moto, bucket) == [2]
    with relay(moto):
        again = hp_train_here(*args)
    assert again.returncode == 0, again.stderr
    assert f"{url}/step-0000004 has no commit.json" in again.stdout, again.stdout[-3000:]
    assert "resumed from " + f"{url}/step-0000002" in again.stdout
    assert losses(tmp_path / "run") == reference
    assert committed_steps(moto, bucket) == [2, 4, 6]
    objects = keys(moto, bucket)
    assert all(listing_holds(objects, f"run/step-000000{s}/") for s in (2, 4, 6))


@pytest.mark.parametrize("async_save", [False, True])
def test_the_store_gone_during_a_save_stops_the_run_in_one_line(
    moto, bucket, tmp_path, reference, async_save
):
    url = f"s3://{bucket}/run"
    args = [*RUN, f"train.run_dir={tmp_path / 'run'}", f"checkpoint.dir={url}",
            f"checkpoint.async={str(async_save).lower()}"]  # fmt: skip
    gone: list[float] = []

    def down(number: int, method: str, path: str) -> bool:
        if "/step-0000004/" in path and not gone:
            gone.append(time.monotonic())
            server.go_down()
            return True
        return False

    with relay(moto, Faults(write_hook=down)) as server:
        done = hp_train_here(*args)
    took = time.monotonic() - gone[0]
    assert done.returncode == 1, done.stdout[-2000:]
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("hp-train: error: checkpoint of step 4 not written: ")
    assert f"{url}/step-0000004" in done.stderr and "cannot reach the server" in done.stderr
    assert took < 30, took  # 3 tries of a refused connection, and the way out
    saved = [r["step"] for r in records(tmp_path / "run", "checkpoint")]
    assert saved == [2]  # never a checkpoint it does not have
    objects = keys(moto, bucket)
    assert committed_steps(moto, bucket) == [2]
    assert listing_holds(objects, "run/step-0000002/")
    with relay(moto):  # the store back: the same command goes on from step 2
        again = hp_train_here(*args)
    assert again.returncode == 0, again.stderr
    assert losses(tmp_path / "run") == reference


# What each write of step 4's save is (and, with keep = 1, of deleting step 2 after it).
WRITES = {
    "a shard": lambda m, p: m == "PUT" and "/step-0000004/" in p and ".distcp" in p,
    "the random states": lambda m, p: m == "PUT" and "/step-0000004/extra/" in p,
    "the DCP metadata": lambda m, p: m == "PUT" and p.endswith("/step-0000004/.metadata"),
    "meta.json": lambda m, p: m == "PUT" and p.endswith("/step-0000004/meta.json"),
    "the commit object": lambda m, p: m == "PUT" and p.endswith("/step-0000004/commit.json"),
    "deleting an object of step 2": lambda m, p: m == "DELETE" and "/step-0000002/" in p,
    "deleting step 2's commit": lambda m, p: m == "DELETE" and p.endswith("02/commit.json"),
}


def test_the_store_gone_at_each_write_leaves_a_store_the_same_command_resumes(
    moto, bucket, tmp_path, reference
):
    """The store gone at each kind of write of a save in turn: the run stops in one line
    (at that save, or at the next where step 4 was committed), every commit object but
    that of a half-deleted older checkpoint lists what is there, and the same command then
    ends with the uninterrupted run's losses and only the newest checkpoint's objects."""
    for number, (kind, matches) in enumerate(WRITES.items()):
        url = f"s3://{bucket}/run{number}"
        args = [*RUN, "checkpoint.keep=1", f"train.run_dir={tmp_path / str(number)}",
                f"checkpoint.dir={url}"]  # fmt: skip

        def down(n: int, method: str, path: str, matches=matches) -> bool:
            if matches(method, path):
                server.go_down()
                return True
            return False

        with relay(moto, Faults(write_hook=down)) as server:
            stopped = hp_train_here(*args)
        assert stopped.returncode == 1 and len(stopped.stderr.splitlines()) == 1, kind
        assert "not written" in stopped.stderr, (kind, stopped.stderr)
        objects = keys(moto, bucket)
        for step in committed_steps(moto, bucket, f"run{number}/"):
            commit = f"run{number}/step-{step:07d}/"
            assert step == 2 or listing_holds(objects, commit), kind  # 2: half deleted
        with relay(moto):
            again = hp_train_here(*args)
        assert again.returncode == 0, (kind, again.stderr)
        assert losses(tmp_path / str(number)) == reference, kind
        assert committed_steps(moto, bucket, f"run{number}/") == [6], kind
        objects = {k: v for k, v in keys(moto, bucket).items() if k.startswith(f"run{number}/")}
        listed = json.loads(objects[f"run{number}/step-0000006/commit.json"])["objects"]
        assert set(objects) == {f"run{number}/step-0000006/{n}" for n in [*listed, "commit.json"]}


def _s3_rank(rank: int, world: int, endpoint: str, overrides: list[str]) -> dict:
    with s3_endpoint(endpoint):
        return _train_rank(rank, world, overrides)


def test_fsdp_saves_through_503s_and_a_stall_and_one_process_resumes_and_exports(
    moto, bucket, tmp_path
):
    """2 FSDP ranks upload through 503 and 500 answers and a stalled request (retried), one
    process resumes the URL with the same next losses, and `hp-train export URL` loads in
    transformers with the logits of the checkpoint's weights."""
    import transformers

    url = f"s3://{bucket}/run"
    faults = Faults(write_status_on={2: 503, 7: 500}, write_stall_on={4}, stall_seconds=5)
    with relay(moto, faults) as server:
        fsdp = [*RUN, "parallel.dp_shard=2", f"train.run_dir={tmp_path / 'fsdp'}",
                f"checkpoint.dir={url}"]  # fmt: skip
        ranks = run_ranks(_s3_rank, 2, server.url().rstrip("/"), fsdp)
        methods = [m for m, _, _ in server.requests]
        # the same command again: rank 0 lists the store, each node's first rank mirrors it
        lists = len([p for m, p, _ in server.requests if m == "GET" and "list-type" in p])
        again = run_ranks(_s3_rank, 2, server.url().rstrip("/"), fsdp)
        lists = len([p for m, p, _ in server.requests if m == "GET" and "list-type" in p]) - lists
    assert methods.count("PUT") == 3 * 7 + 3  # 7 objects a save; 3 asked again
    assert f"resumed from {url}/step-0000006" in again[0]["log"] and lists == 1
    assert committed_steps(moto, bucket) == [2, 4, 6]
    with relay(moto):
        one = hp_train_here(*RUN, f"train.run_dir={tmp_path / 'one'}",
                            f"checkpoint.resume={url}/step-0000004")  # fmt: skip
        assert one.returncode == 0, one.stderr
        out = tmp_path / "hf"
        exported = hp_train_here("export", f"{url}/step-0000006", "--out", out, "--dtype",
                                 "float32")  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    resumed = losses(tmp_path / "one")
    np.testing.assert_allclose([resumed[5], resumed[6]], ranks[0]["losses"][4:], rtol=1e-5)
    # the reference: step 6's weights read from the store by boto and plain DCP
    local = tmp_path / "step-6"
    for key, data in keys(moto, bucket).items():
        if key.startswith("run/step-0000006/"):
            (local / key[len("run/step-0000006/") :]).parent.mkdir(parents=True, exist_ok=True)
            (local / key[len("run/step-0000006/") :]).write_bytes(data)
    expected = _logits_of(local)
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    with torch.no_grad():
        np.testing.assert_allclose(hf(TOKENS).logits.numpy(), expected, atol=1e-4, rtol=0)


TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])


def _logits_of(checkpoint: Path) -> np.ndarray:
    import tomllib

    import torch.distributed.checkpoint as dcp
    from hp_runtime.model import Transformer
    from hp_runtime.train.config import build_config

    meta = json.loads((checkpoint / "meta.json").read_text())
    config = build_config(tomllib.loads(meta["config"])).model
    model = Transformer(config)
    state = {n: torch.empty(p.shape) for n, p in model.named_parameters()}
    dcp.load({"model": state}, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return model(TOKENS).numpy()


def test_keep_deletes_only_what_this_runs_older_checkpoints_list(moto, bucket, tmp_path):
    client = s3_client(moto)
    theirs = {
        "run/notes.txt": b"the user's",
        "run/step-0000002/mine.txt": b"the user's, inside a prefix the run will write",
        "run/step-0000099/partial.distcp": b"no commit object",
        "run/other/step-0000002/commit.json": b"another tree's",
        "elsewhere/step-0000002/x": b"outside",
    }
    for key, data in theirs.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)  # type: ignore[attr-defined]
    url = f"s3://{bucket}/run"
    with relay(moto):
        done = hp_train_here(*RUN, "train.steps=8", "checkpoint.keep=2",
                             f"train.run_dir={tmp_path / 'run'}",
                             f"checkpoint.dir={url}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"{url}/step-0000099 has no commit.json" in done.stdout
    objects = keys(moto, bucket)
    assert committed_steps(moto, bucket) == [6, 8]
    ours = set()
    for step in (6, 8):
        prefix = f"run/step-000000{step}/"
        assert listing_holds(objects, prefix)
        ours |= {prefix + n for n in json.loads(objects[prefix + "commit.json"])["objects"]}
        ours.add(prefix + "commit.json")
    assert set(objects) == ours | set(theirs)
    assert all(objects[k] == v for k, v in theirs.items())


def _damaged_then_again(moto, bucket, tmp_path, reference, damage) -> str:
    """The run to its end on the store, `damage(client)` done to step 6, then the same
    command again: it falls back to step 4 and trains steps 5 and 6 as the reference did.
    Its output."""
    args = [*RUN, f"train.run_dir={tmp_path / 'run'}", f"checkpoint.dir=s3://{bucket}/run"]
    with relay(moto):
        assert hp_train_here(*args).returncode == 0
    damage(s3_client(moto))
    (tmp_path / "run" / "metrics.jsonl").unlink()  # the run again, from what the store holds
    with relay(moto):
        again = hp_train_here(*args)
    assert again.returncode == 0, again.stderr
    assert f"resumed from s3://{bucket}/run/step-0000004" in again.stdout
    assert losses(tmp_path / "run") == {s: reference[s] for s in (5, 6)}
    return again.stdout


def test_a_damaged_object_falls_back_to_the_checkpoint_before(moto, bucket, tmp_path, reference):
    shard = "run/step-0000006/__0_0.distcp"

    def flip(client) -> None:
        flip_object(client, bucket, shard)

    out = _damaged_then_again(moto, bucket, tmp_path, reference, flip)
    assert f"s3://{bucket}/{shard}: not the bytes its commit" in out
    assert listing_holds(keys(moto, bucket), "run/step-0000006/")  # written again, whole


def test_a_store_failing_while_a_shard_is_read_stops_the_run_instead_of_falling_back(
    moto, bucket, tmp_path
):
    """A resume whose shard the store will not serve (503s, every try) stops in one line:
    it is not damage, so the run neither falls back to step 4 nor saves step 6 again."""
    url = f"s3://{bucket}/run"
    args = [*RUN, f"train.run_dir={tmp_path / 'run'}", f"checkpoint.dir={url}"]
    with relay(moto):
        assert hp_train_here(*args).returncode == 0
    before = keys(moto, bucket)
    faults = Faults()

    def refuse(number: int, method: str, path: str) -> None:
        if ".distcp" in path and number:
            faults.status_on.update({n: 503 for n in range(number, number + 10)})

    faults.hook = refuse
    with relay(moto, faults):
        again = hp_train_here(*args, "train.steps=8")
    assert again.returncode == 1 and len(again.stderr.splitlines()) == 1, again.stderr
    assert f"{url}/step-0000006/__0_0.distcp: cannot be read" in again.stderr, again.stderr
    assert "trying the checkpoint before it" not in again.stdout
    assert keys(moto, bucket) == before


def test_an_unreadable_commit_object_is_skipped_then_kept_aside_when_its_step_is_saved(
    moto, bucket, tmp_path, reference
):
    def garble(client) -> None:
        client.put_object(Bucket=bucket, Key="run/step-0000006/commit.json", Body=b"{garbled")

    out = _damaged_then_again(moto, bucket, tmp_path, reference, garble)
    assert f"s3://{bucket}/run/step-0000006/commit.json: not valid JSON" in out
    objects = keys(moto, bucket)
    aside = [k for k in objects if k.startswith("run/step-0000006/commit.json.unreadable-")]
    assert len(aside) == 1 and objects[aside[0]] == b"{garbled"
    assert listing_holds(objects, "run/step-0000006/")


def test_a_crafted_pickle_in_a_remote_checkpoint_is_refused_by_name(moto, bucket, tmp_path):
    """A bucket's checkpoint whose optimizer item is a pickle that runs a command, listed with
    the right sizes and digests (the store's writer is the attacker): refused by name."""
    run = tmp_path / "run"
    assert hp_train_here(*RUN, "train.steps=2", f"train.run_dir={run}").returncode == 0
    source = run / "checkpoints" / "step-0000002"
    marker = tmp_path / "pwned"
    lr = plant_in_optimizer(source, marker, tmp_path)
    client, objects = s3_client(moto), {}
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        name = file.relative_to(source).as_posix()
        data = file.read_bytes()
        client.put_object(Bucket=bucket, Key=f"seed/step-0000002/{name}", Body=data)  # type: ignore[attr-defined]
        objects[name] = {"size": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}
    commit = {"step": 2, "run_id": "x", "objects": objects}
    commit["xxh3"] = xxhash.xxh3_64_hexdigest(json.dumps(commit, sort_keys=True).encode())
    client.put_object(Bucket=bucket, Key="seed/step-0000002/commit.json",  # type: ignore[attr-defined]
                      Body=json.dumps(commit).encode())  # fmt: skip
    with relay(moto):
        done = hp_train_here(*RUN, f"train.run_dir={tmp_path / 'b'}",
                             f"checkpoint.resume=s3://{bucket}/seed/step-0000002")  # fmt: skip
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"optim.{lr}: refers to posix.system" in done.stderr, done.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    "commit",
    [
        b"not json",
        b'{"step": 2, "run_id": "x"}',
        b'{"step": 2, "run_id": "x", "objects": {"meta.json": {"size": 1, "xxh3": "0"}, '
        b'"../../etc/passwd": {"size": 1, "xxh3": "0"}}}',
        b'{"step": 2, "run_id": "x", "objects": {"/abs": {"size": 1, "xxh3": "0"}, '
        b'"meta.json": {"size": 1, "xxh3": "0"}}}',
        b'{"step": 2, "run_id": "x", "objects": {"meta.json": {"size": -1, "xxh3": "0"}}}',
        b'{"step": 2, "run_id": "x", "objects": {"meta.json": {"size": 1, "xxh3": "0"}, '
        b'"extra//x": {"size": 1, "xxh3": "0"}}}',
        b'{"step": "2", "run_id": "x", "objects": {"meta.json": {"size": 1, "xxh3": "0"}}}',
        b'{"step": 2, "run_id": "x", "objects": {"meta.json": {"size": 1, "xxh3": "0"}}, '
        b'"xxh3": "0"}',
    ],
)
def test_a_bad_commit_object_is_one_line_and_nothing_is_written_outside(
    moto, bucket, tmp_path, commit
):
    client = s3_client(moto)
    client.put_object(Bucket=bucket, Key="seed/step-0000002/commit.json", Body=commit)  # type: ignore[attr-defined]
    with relay(moto):
        done = hp_train_here(*RUN, f"train.run_dir={tmp_path / 'b'}",
                             f"checkpoint.resume=s3://{bucket}/seed/step-0000002")  # fmt: skip
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"s3://{bucket}/seed/step-0000002/commit.json" in done.stderr, done.stderr
    assert not (tmp_path / "etc").exists() and not Path("/abs").exists()


def test_credentials_in_the_url_never_appear_in_output_or_files(moto, bucket, tmp_path):
    secret = "SECRETKEY" + uuid.uuid4().hex[:6]
    url = f"s3://AKIDUSER:{secret}@{bucket}/run"  # refused, in one redacted line
    with relay(moto):
        done = hp_train_here(*RUN, f"train.run_dir={tmp_path / 'run'}", f"checkpoint.dir={url}")
    assert done.returncode == 2 and done.stderr.startswith("hp-train: error: checkpoint.dir: ")
    assert secret not in done.stdout + done.stderr
    for file in (tmp_path / "run").rglob("*"):
        if file.is_file():
            assert secret.encode() not in file.read_bytes(), file
    assert all(secret.encode() not in k.encode() + v for k, v in keys(moto, bucket).items())


def test_a_local_copy_restarts_without_downloading_shards(moto, bucket, tmp_path):
    """With checkpoint.local_copy the newest checkpoint stays on the node: the run started
    again loads it without fetching a shard; without, the shards come from the store and
    the mirror they were read through is removed."""
    url = f"s3://{bucket}/run"
    run = tmp_path / "run"
    args = [*RUN, f"train.run_dir={run}", f"checkpoint.dir={url}"]
    with relay(moto):
        assert hp_train_here(*args, "checkpoint.local_copy=true").returncode == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["local-step-0000006"]
    for copy in (True, False):
        with relay(moto) as server:
            again = hp_train_here(*args, f"checkpoint.local_copy={str(copy).lower()}")
        assert again.returncode == 0, again.stderr
        assert f"resumed from {url}/step-0000006" in again.stdout, again.stdout[-2000:]
        fetched = [p for m, p, _ in server.requests if m == "GET" and ".distcp" in p]
        assert bool(fetched) is not copy, server.requests
        left = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert left == (["local-step-0000006"] if copy else [])


def test_replay_starts_from_the_stores_checkpoint_before_the_step(moto, bucket, tmp_path):
    url = f"s3://{bucket}/run"
    run = tmp_path / "run"
    with relay(moto):
        assert hp_train_here(*RUN, f"train.run_dir={run}", f"checkpoint.dir={url}").returncode == 0
        before = keys(moto, bucket)
        replayed = hp_train_here("replay", run, "--step", "5")
    assert replayed.returncode == 0, replayed.stderr
    assert "step-0000004" in replayed.stdout, replayed.stdout
    assert keys(moto, bucket) == before  # the replay writes nothing to the run's store


def test_a_large_shard_goes_up_in_parts_and_comes_back_whole(moto, bucket, tmp_path, monkeypatch):
    """A file above the part size is a multipart upload (its parts, then one completion), and
    reads back byte for byte; its listing entry is its size and xxh3-64."""
    from hp_runtime.train import checkpoint_remote

    monkeypatch.setattr(checkpoint_remote, "PART_BYTES", 5 << 20)  # S3's smallest part
    data = np.random.default_rng(0).integers(0, 256, 12 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "shard").write_bytes(data)
    with relay(moto) as server:
        listed = checkpoint_remote.upload(str(tmp_path / "shard"), f"s3://{bucket}/x", 4)
    assert listed == (len(data), xxhash.xxh3_64_hexdigest(data))
    parts = [p for m, p, _ in server.requests if m == "PUT" and "partNumber=" in p]
    assert len(parts) == 3 and ("POST", f"/{bucket}/x?uploads", "") in server.requests
    assert keys(moto, bucket)["x"] == data
