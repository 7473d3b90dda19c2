"""Remote inputs that stall, fail or change (issue 29): `hp-data preprocess`, `plan`, a resumed
run and `merge --shards` against a local HTTP server that misbehaves on request
(tests/helpers/fault_http.py) and a real S3 server (moto, a versioned bucket; faults from the
same server relaying to it), each run in a subprocess under a timeout, so that a hang fails.

Every run ends as either the bytes of a fresh local run over the objects as they finally are,
or one line naming the object: never a traceback, a hang, or output of two versions mixed."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import pytest

from tests.helpers.corpus_files import english_records, write_jsonl, write_jsonl_zst, write_parquet
from tests.helpers.fault_http import Faults, fault_server
from tests.helpers.run import cli, read_bytes, run_preprocess

TIMEOUT = 60  # seconds: a run that hangs fails its test
FROM_4TH = set(range(4, 10_000))  # every GET from the 4th: a fault that does not pass


@pytest.fixture(scope="module")
def originals(tmp_path_factory, example_corpus) -> Path:
    """a.jsonl (cut into 3 units of 0.1 MB), b.jsonl.gz, c.parquet, d.jsonl.zst."""
    root = tmp_path_factory.mktemp("originals")
    lines = example_corpus.read_bytes().splitlines(keepends=True)
    data = b""
    for line in lines:
        if len(data) + len(line) > 300_000:
            break
        data += line
    (root / "a.jsonl").write_bytes(data)
    records = english_records(29, 60)
    (root / "b.jsonl.gz").write_bytes(
        gzip.compress(write_jsonl(root / "b.tmp", records[:30]).read_bytes())
    )
    (root / "b.tmp").unlink()
    write_parquet(root / "c.parquet", records[30:45], row_group_size=5)
    write_jsonl_zst(root / "d.jsonl.zst", records[45:])
    return root


@pytest.fixture
def served(tmp_path, originals) -> Path:
    """A copy of the originals for one test to serve (and change)."""
    return Path(shutil.copytree(originals, tmp_path / "served"))


@pytest.fixture(scope="module")
def tokenizer(example_tokenizer) -> str:
    return str(example_tokenizer)


def _reference(tmp_path: Path, tokenizer: str, *paths: Path) -> tuple[bytes, ...]:
    """The bytes of a fresh local run over `paths` (as they are now)."""
    out = tmp_path / f"reference-{len(list(tmp_path.glob('reference-*.bin')))}"
    run_preprocess(paths, out, tokenizer, append_eod=True)
    return read_bytes(out)


def _preprocess(
    inputs: list[str], out: Path, tokenizer: str, *extra: object, env=None, timeout: float = 1
):
    return cli(
        "preprocess", *inputs, "--out", out, "--tokenizer", tokenizer, "--append-eod",
        "--workers", 1, "--quiet", "--unit-mb", 0.1, "--chunk-mb", 0.05,
        "--remote-timeout", timeout, *extra, timeout=TIMEOUT, env=env,
    )  # fmt: skip


def _same(result, out: Path, reference: tuple[bytes, ...]) -> None:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert read_bytes(out) == reference


def _refused(result, out: Path | None, name: str, pattern: str) -> None:
    """Exit 1 with one line `Error: NAME: ...` matching `pattern` (after warnings, if any),
    and no output at its final path."""
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("Warning: ") for line in lines[:-1]), result.stderr
    assert re.fullmatch(f"Error: {re.escape(name)}: {pattern}", lines[-1]), result.stderr
    if out is not None:
        assert not Path(f"{out}.bin").exists() and not Path(f"{out}.idx").exists()


def _changer(path: Path, data: bytes, on_get: int, mtime_step: float = 10.0):
    """A hook that writes `data` to `path` just before the `on_get`-th GET is answered, with
    a modification time `mtime_step` seconds later (HTTP's Last-Modified counts seconds)."""

    def hook(number: int, method: str, request: str) -> None:
        if number == on_get:
            before = path.stat().st_mtime
            path.write_bytes(data)
            os.utime(path, (before + mtime_step, before + mtime_step))

    return hook


def _same_size_variant(data: bytes) -> bytes:
    changed = data.replace(b"the", b"THE")
    assert len(changed) == len(data) and changed != data
    return changed


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_timeout_that_is_no_positive_number_is_refused_naming_the_flag(tmp_path, value):
    from click.testing import CliRunner
    from hp_data import PreprocessError
    from hp_data.cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    for command in (["plan", str(corpus)], ["preprocess", str(corpus), "--out", "x"]):
        result = CliRunner().invoke(main, [*command, "--remote-timeout", value])
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert "Invalid value for '--remote-timeout'" in result.output
    with pytest.raises(PreprocessError, match=r"^--remote-timeout .*: give a positive number"):
        run_preprocess([corpus], tmp_path / "o", "unused", remote_timeout=float(value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


# -- HTTP -----------------------------------------------------------------------------------


def test_every_format_over_http_with_passing_faults_is_the_local_run(tmp_path, served, tokenizer):
    """A stall, a truncated body and a 500 answer, each once, are tried again; no GET asks
    for a whole object (no Range), not even without Content-Type (issue 29, items 4, 6, 8)."""
    names = ["a.jsonl", "b.jsonl.gz", "c.parquet", "d.jsonl.zst"]
    faults = Faults(content_type=False, stall_on={3}, truncate_on={6}, status_on={9: 500})
    with fault_server(served, faults) as server:
        urls = [server.url(name) for name in names]
        result = _preprocess(urls, tmp_path / "o", tokenizer, timeout=0.5)
    _same(result, tmp_path / "o", _reference(tmp_path, tokenizer, *(served / n for n in names)))
    gets = [r for r in server.requests if r[0] == "GET"]
    assert len(gets) > 12 and all(ranged for _, _, ranged in gets), gets
    assert len({r for r in gets if gets.count(r) > 1}) >= 3  # the three faults, asked again


def test_a_server_that_trickles_bytes_ends_in_one_line(tmp_path, served, tokenizer):
    """A byte every 0.1 s never trips a socket timeout (the reviewer's run went on for ever):
    a whole http(s) request has 10 timeouts."""
    with fault_server(served, Faults(trickle_on=FROM_4TH)) as server:
        url = server.url("a.jsonl")
        result = _preprocess([url], tmp_path / "o", tokenizer, timeout=0.2)
    pattern = (
        r"cannot read bytes \d+-\d+: no answer within 0.2 s \(--remote-timeout; .* 2 s in all\)"
    )
    _refused(result, tmp_path / "o", url, pattern + ", 3 tries")


@pytest.mark.parametrize(
    "faults, pattern",
    [
        (Faults(stall_on=FROM_4TH), r"cannot read bytes \d+-\d+: no answer within 0.5 s "
                                    r"\(--remote-timeout; .* 5 s in all\), 3 tries"),
        (Faults(truncate_on=FROM_4TH), r"cannot read bytes \d+-\d+: Response payload is not "
                                       r"completed.*, 3 tries"),
        (Faults(status_on=dict.fromkeys(FROM_4TH, 404)), r"cannot read bytes \d+-\d+: no such "
                                                         r"file \(deleted during the run\?\)"),
        (Faults(down_from=4), r"cannot read( bytes \d+-\d+)?: cannot reach the server, 3 tries "
                              r"\(.+\)"),
        (Faults(ranges=False), r"cannot read bytes \d+-\d+: the server does not answer "
                               r"byte-range requests \(HTTP Range\).*"),
    ],
    ids=["stalls", "truncates", "404", "goes-down", "no-ranges"],
)  # fmt: skip
def test_a_fault_that_does_not_pass_ends_in_one_line(tmp_path, served, tokenizer, faults, pattern):
    with fault_server(served, faults) as server:
        url = server.url("a.jsonl")
        result = _preprocess([url], tmp_path / "o", tokenizer, timeout=0.5)
    _refused(result, tmp_path / "o", url, pattern)


@pytest.mark.parametrize(
    "faults, change",
    [
        (Faults(), _same_size_variant),
        (Faults(), lambda data: data + b'{"text": "one more"}\n'),
        (Faults(etag=False), _same_size_variant),  # Last-Modified is all that tells
        (Faults(weak_etag=True, last_modified=False), _same_size_variant),  # W/"..." only
    ],
    ids=["same-size", "other-size", "no-etag", "weak-etag-only"],
)
def test_an_object_replaced_during_the_run_stops_it(tmp_path, served, tokenizer, faults, change):
    """Issue 29, item 2: was output equal to neither version, or a false `malformed JSON`."""
    path = served / "a.jsonl"
    faults.hook = _changer(path, change(path.read_bytes()), on_get=4)
    with fault_server(served, faults) as server:
        url = server.url("a.jsonl")
        result = _preprocess([url], tmp_path / "o", tokenizer)
    _refused(result, tmp_path / "o", url, "changed during the run; rerun")
    weak = not faults.etag or faults.weak_etag
    assert result.stderr.count("Warning: ") == weak


def test_a_local_file_rewritten_during_the_run_stops_it(tmp_path, served, tokenizer):
    """A local input rewritten in place after it was planned (here while an URL before it is
    read): its size, mtime and inode are checked as each unit opens and closes."""
    local = served / "a.jsonl"
    first = tmp_path / "first.jsonl"
    first.write_bytes(b'{"text": "first"}\n' * 10)
    faults = Faults(hook=_changer(local, _same_size_variant(local.read_bytes()), on_get=1))
    with fault_server(tmp_path, faults) as server:
        result = _preprocess([server.url("first.jsonl"), str(local)], tmp_path / "o", tokenizer)
    _refused(result, tmp_path / "o", str(local), "changed during the run; rerun")


def test_a_resumed_run_reuses_a_unit_only_when_a_strong_validator_says_it_holds(
    tmp_path, served, tokenizer
):
    """Issue 29, item 1: a server without ETag, an object rewritten at the same size and
    modification time; the resumed run reused its unit and wrote other bytes than a fresh one.
    Here a.jsonl has an ETag, w.jsonl none: a rerun after a failure reuses a's three units,
    warns about w and reads it again, and writes the fresh run's bytes."""
    a, w, bad = served / "a.jsonl", served / "w.jsonl", served / "bad.jsonl"
    w.write_bytes(b"".join(b'{"text": "the word %d"}\n' % i for i in range(50)))
    bad.write_bytes(b'{"text": "fine"}\nnot json\n')
    with fault_server(served, Faults(no_etag={"/w.jsonl"})) as server:
        urls = [server.url(p.name) for p in (a, w, bad)]
        first = _preprocess(urls, tmp_path / "o", tokenizer)
        _refused(first, tmp_path / "o", urls[2] + ":2", "malformed JSON.*")
        bad.write_bytes(b'{"text": "fine"}\n{"text": "fixed"}\n')
        stat = w.stat()  # rewritten, with the Last-Modified it had
        w.write_bytes(_same_size_variant(w.read_bytes()))
        os.utime(w, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        again = _preprocess(urls, tmp_path / "o", tokenizer, "--json")
    _same(again, tmp_path / "o", _reference(tmp_path, tokenizer, a, w, bad))
    assert json.loads(again.stdout)["resumed_shards"] == 3
    warning = (f"Warning: {urls[1]}: no ETag, version id or content hash: only its size and "
               "Last-Modified can show a change; a resumed run reads it again rather than reuse "
               "its finished units")  # fmt: skip
    assert first.stderr.splitlines()[:-1] == again.stderr.splitlines() == [warning]


def test_plan_refuses_a_server_without_byte_ranges_in_one_line(served):
    """Issue 29, item 7: was a ValueError traceback from plan.py."""
    with fault_server(served, Faults(ranges=False)) as server:
        url = server.url("a.jsonl")
        result = cli("plan", url, "--unit-mb", 0.1, "--remote-timeout", 1, timeout=TIMEOUT)
    _refused(result, None, url, r"cannot read bytes \d+-\d+: the server does not answer .*")


def test_shards_of_an_object_that_changed_between_them_do_not_merge(tmp_path, served, tokenizer):
    """Each machine pins the objects as it plans: shards planned over two versions of an
    object (its ETag changed between them) refuse to merge."""
    a = served / "a.jsonl"
    out = tmp_path / "o"
    with fault_server(served) as server:
        url = server.url("a.jsonl")
        shard = ["--num-shards", 2, "--shard-index"]
        assert _preprocess([url], out, tokenizer, *shard, 0).returncode == 0
        a.write_bytes(_same_size_variant(a.read_bytes()))
        assert _preprocess([url], out, tokenizer, *shard, 1).returncode == 0
    merged = cli("merge", out, "--shards", "--quiet", timeout=TIMEOUT)
    _refused(merged, out, f"{out}.shard-00001-of-00002.json", "made with other inputs .*")


def test_a_split_run_refuses_an_object_nothing_strong_identifies(tmp_path, served, tokenizer):
    """Shards of an object without ETag, rewritten at the same size between them, merged into
    output of two versions: each machine pins only what it sees. Refused before any work."""
    out = tmp_path / "o"
    with fault_server(served, Faults(etag=False)) as server:
        url = server.url("a.jsonl")
        result = _preprocess([url], out, tokenizer, "--num-shards", 2, "--shard-index", 0)
    _refused(result, None, url, "no ETag, version id or content hash, so the machines .*")
    assert not list(tmp_path.glob("o*"))


# -- S3 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(s3_server):
    """boto3's client of the S3 server, and the environment of hp-data's runs against it."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server["FSSPEC_S3_ENDPOINT_URL"],
                          aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")  # fmt: skip
    return client, {**os.environ, **s3_server}


def _bucket(s3, name: str, files: dict[str, bytes]) -> None:
    """A versioned bucket holding `files` (moto keeps buckets per process: unique names)."""
    client, _ = s3
    client.create_bucket(Bucket=name)
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    for key, data in files.items():
        client.put_object(Bucket=name, Key=key, Body=data)


def test_an_s3_glob_reads_a_matching_directory_as_the_local_glob_does(
    tmp_path, originals, tokenizer, s3, s3_server
):
    """Issue 29, item 9: `s3://bkt/g/*` where `g/sub/` holds files was a format error. Read
    through the fault server, whose stall, truncated body and 503, once each, are tried
    again (botocore's timeouts, s3fs's reads, hp's retries)."""
    local = tmp_path / "g"
    (local / "sub").mkdir(parents=True)
    shutil.copy(originals / "a.jsonl", local / "a.jsonl")
    shutil.copy(originals / "c.parquet", local / "sub" / "c.parquet")
    shutil.copy(originals / "d.jsonl.zst", local / "sub" / "d.jsonl.zst")
    (local / "sub" / "notes.txt").write_text("not a corpus file")
    files = {str(p.relative_to(tmp_path)): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    _bucket(s3, "glob-dir", files)
    faults = Faults(stall_on={2}, truncate_on={4}, status_on={6: 503})
    with fault_server(faults=faults, upstream=s3_server["FSSPEC_S3_ENDPOINT_URL"]) as server:
        env = {**s3[1], "FSSPEC_S3_ENDPOINT_URL": server.url().rstrip("/")}
        result = _preprocess(["s3://glob-dir/g/*"], tmp_path / "o", tokenizer, env=env, timeout=0.5)
    run_preprocess([f"{local}/*"], tmp_path / "local", tokenizer, append_eod=True)
    _same(result, tmp_path / "o", read_bytes(tmp_path / "local"))
    gets = [r for r in server.requests if r[0] == "GET"]
    assert len({r for r in gets if gets.count(r) > 1}) >= 3  # the three faults, asked again


@pytest.mark.parametrize(
    "faults, pattern",
    [
        ("replaced", "changed during the run; rerun"),
        (Faults(down_from=3), r"cannot read( bytes \d+-\d+)?: cannot reach the server, 3 tries "
                              r"\(.+\)"),
        (Faults(stall_on=set(range(3, 10_000))), r"cannot read bytes \d+-\d+: no answer within "
                                                 r"0.5 s \(--remote-timeout; .*\), 3 tries"),
    ],
    ids=["replaced", "goes-down", "stalls"],
)  # fmt: skip
def test_s3_faults_that_do_not_pass_end_in_one_line(
    tmp_path, originals, tokenizer, s3, s3_server, faults, pattern
):
    """The S3 server behind the fault server: an object replaced (a new version) while it is
    read, the server gone (was botocore's EndpointConnectionError), a stall."""
    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    data = (originals / "a.jsonl").read_bytes()
    _bucket(s3, bucket, {"a.jsonl": data})
    if faults == "replaced":

        def replace(number: int, method: str, request: str) -> None:
            if number == 3:
                s3[0].put_object(Bucket=bucket, Key="a.jsonl", Body=_same_size_variant(data))

        faults = Faults(hook=replace)
    url = f"s3://{bucket}/a.jsonl"
    with fault_server(faults=faults, upstream=s3_server["FSSPEC_S3_ENDPOINT_URL"]) as server:
        env = {**s3[1], "FSSPEC_S3_ENDPOINT_URL": server.url().rstrip("/")}
        result = _preprocess([url], tmp_path / "o", tokenizer, env=env, timeout=0.5)
    _refused(result, tmp_path / "o", url, pattern)
