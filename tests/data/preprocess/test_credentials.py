"""Credentials in input URLs are never echoed or stored: `hp-data preprocess` over a local
HTTP server that checks basic auth (the password in the URL) and over presigned-style URLs,
with and without errors; every byte printed or left on disk is searched for the secrets. The
same run with a rotated password resumes and merges (identities hold no secret)."""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner
from hp_data.cli import main
from hp_data.remote import _filesystem

PASSWORD_A, PASSWORD_B = "SECRETPWaaa", "SECRETPWbbb"
SIGNATURE, CREDENTIAL = "SECRETSIG0123", "SECRETCRED4567"
SECRETS = [PASSWORD_A, PASSWORD_B, SIGNATURE, CREDENTIAL] + [
    base64.b64encode(f"user:{p}".encode()).decode() for p in (PASSWORD_A, PASSWORD_B)
]


class _Handler(BaseHTTPRequestHandler):
    """Serves `server.files` to a request with a password of `server.passwords` (basic auth)
    or the presigned signature, with byte ranges and a content ETag, as object stores do."""

    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        auth = self.headers.get("Authorization", "")
        signed = f"X-Amz-Signature={SIGNATURE}" in query
        if not signed and auth not in {_basic(p) for p in self.server.passwords}:
            return self._reply(401, {"WWW-Authenticate": 'Basic realm="corpus"'})
        data = self.server.files.get(path)
        if data is None:
            return self._reply(404, {})
        headers = {"ETag": f'"{xxhash.xxh3_64_hexdigest(data)}"', "Accept-Ranges": "bytes"}
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match is None:
            return self._reply(200, headers, data)
        start = int(match[1])
        end = min(int(match[2]) + 1 if match[2] else len(data), len(data))
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        return self._reply(206, headers, data[start:end])

    do_HEAD = do_GET


class _Server(ThreadingHTTPServer):
    files: dict[str, bytes]
    passwords: set[str]


def _basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"user:{password}".encode()).decode()


@pytest.fixture
def server(example_corpus):
    http = _Server(("127.0.0.1", 0), _Handler)
    lines = example_corpus.read_bytes().splitlines(keepends=True)
    http.files = {"/c/a.jsonl": b"".join(lines[:150]), "/c/b.jsonl": b"".join(lines[150:300])}
    http.passwords = {PASSWORD_A, PASSWORD_B}
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    _filesystem.cache_clear()  # fsspec's HTTP filesystem, and its session, per test
    yield http
    http.shutdown()
    http.server_close()
    _filesystem.cache_clear()


def _url(server: _Server, name: str, password: str = PASSWORD_A) -> str:
    return f"http://user:{password}@127.0.0.1:{server.server_address[1]}/c/{name}"


def _presigned(server: _Server, name: str) -> str:
    return (
        f"http://127.0.0.1:{server.server_address[1]}/c/{name}?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential={CREDENTIAL}&X-Amz-Signature={SIGNATURE}"
    )


class _Runs:
    """Runs `hp-data` in-process and keeps everything it printed."""

    def __init__(self, tokenizer: Path) -> None:
        self.tokenizer = str(tokenizer)
        self.printed: list[str] = []

    def __call__(self, *args: object, code: int = 0) -> str:
        result = CliRunner().invoke(main, [str(a) for a in args])
        self.printed += [result.stdout, result.stderr]
        assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
        return result.stdout if code == 0 else result.stderr

    def preprocess(self, inputs: list[str], out: Path, *extra: object, code: int = 0) -> str:
        return self(
            "preprocess", *inputs, "--out", out, "--tokenizer", self.tokenizer, "--workers", 1,
            "--chunk-mb", 0.02, *extra, code=code,
        )  # fmt: skip


def _assert_no_secret(runs: _Runs, root: Path) -> None:
    """Not one secret in any byte printed or in any file under `root` (hidden ones too)."""
    stored = {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert stored, "the runs wrote nothing"
    for secret in SECRETS:
        for number, text in enumerate(runs.printed):
            assert secret not in text, f"printed ({number}): {text!r}"
        for path, data in stored.items():
            assert secret.encode() not in data, path


def test_no_secret_is_printed_or_stored_and_a_new_password_resumes(
    tmp_path, server, example_tokenizer
):
    runs = _Runs(example_tokenizer)
    out = tmp_path / "out"
    out.mkdir()
    a, b = _url(server, "a.jsonl"), _url(server, "b.jsonl")

    # Basic auth from the URL; a presigned URL; the summary, with --json too.
    assert "wrote " in runs.preprocess([a, b], out / "basic")
    report = json.loads(runs.preprocess([_presigned(server, "a.jsonl")], out / "signed", "--json"))
    assert report["ok"] and report["documents_in"] == 150

    # A bad line: the error, then the summary's invalid examples (with --skip-invalid).
    server.files["/c/b.jsonl"] += b"not json\n"
    error = runs.preprocess([a, b], out / "resumed", "--quiet", code=1)
    assert re.fullmatch(r"Error: http://\*\*\*:\*\*\*@127\.0\.0\.1:\d+/c/b\.jsonl:\d+: .*\n", error)
    assert (out / ".resumed.hp-preprocess" / "manifest.json").exists()  # a.jsonl is done
    skipped = runs.preprocess([_presigned(server, "b.jsonl")], out / "skip", "--skip-invalid")
    assert "invalid: http://127.0.0.1:" in skipped and "X-Amz-Signature=***" in skipped

    # The same run with the password rotated resumes the finished a.jsonl.
    server.files["/c/b.jsonl"] = server.files["/c/b.jsonl"].removesuffix(b"not json\n")
    server.passwords = {PASSWORD_B}
    a, b = _url(server, "a.jsonl", PASSWORD_B), _url(server, "b.jsonl", PASSWORD_B)
    resumed = json.loads(runs.preprocess([a, b], out / "resumed", "--json", "--quiet"))
    assert resumed["resumed_shards"] == 1 and resumed["shards"] == 2
    assert (out / "resumed.bin").read_bytes() == (out / "basic.bin").read_bytes()

    # Shards: one done with the old password is done (not redone) with the new, and merges.
    server.passwords = {PASSWORD_A, PASSWORD_B}
    for index, password in [(0, PASSWORD_A), (1, PASSWORD_B)]:
        urls = [_url(server, name, password) for name in ("a.jsonl", "b.jsonl")]
        shard = runs.preprocess(urls, out / "split", "--num-shards", 2, "--shard-index", index,
                                "--json", "--quiet")  # fmt: skip
    assert json.loads(shard)["ok"]
    again = [_url(server, name, PASSWORD_B) for name in ("a.jsonl", "b.jsonl")]
    redone = runs.preprocess(again, out / "split", "--num-shards", 2, "--shard-index", 0, "--json")
    assert json.loads(redone)["resumed_shards"] == json.loads(redone)["shards"]
    runs("merge", out / "split", "--shards", "--quiet")
    assert (out / "split.bin").read_bytes() == (out / "basic.bin").read_bytes()

    # Errors: a missing object, a wrong password, the server stopped (connection refused).
    assert "no such file" in runs.preprocess([_url(server, "none.jsonl")], out / "x", code=1)
    runs.preprocess([_url(server, "a.jsonl", "SECRETPWaaaWRONG")], out / "x", "--json", code=1)
    server.shutdown()
    server.server_close()
    _filesystem.cache_clear()
    refused = runs.preprocess([a], out / "x", "--json", code=1)
    assert refused.startswith("Error: http://***:***@127.0.0.1:") and refused.count("\n") == 1
    _assert_no_secret(runs, tmp_path)


BUCKET = "presigned-credentials-test"


@pytest.mark.parametrize("signature", ["s3v4", "s3"])
def test_a_presigned_url_of_an_s3_server_leaves_no_secret(tmp_path, example_tokenizer, signature):
    """A real S3-compatible server (moto) and boto3's own presigned URLs, SigV4 and SigV2:
    the access key and the signature appear in nothing printed or written, also on a 404."""
    import boto3
    from botocore.config import Config
    from moto.server import ThreadedMotoServer

    # moto keeps its buckets per process, across servers: a bucket of this test's own,
    # removed after, so that the other S3 tests start from what they expect
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    client = None
    try:
        host, port = server.get_host_and_port()
        client = boto3.client(
            "s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id="AKIASECRETID9",
            aws_secret_access_key="SECRETKEY9", region_name="us-east-1",
            config=Config(signature_version=signature),
        )  # fmt: skip
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="in/a.jsonl", Body=b'{"text": "hi"}\n' * 50)

        def presign(key: str) -> str:
            return client.generate_presigned_url(
                "get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=600
            )

        url = presign("in/a.jsonl")
        # the signature's first characters: a leak decoded from %-escapes is caught too
        secrets = ["AKIASECRETID9", re.search(r"Signature=([^&]+)", url).group(1)[:16]]
        runs = _Runs(example_tokenizer)
        runs.preprocess([url], tmp_path / "out", "--json")
        runs.preprocess([presign("in/none.jsonl")], tmp_path / "missing", code=1)
        stored = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        assert stored
        for secret in secrets:
            assert not any(secret in text for text in runs.printed), secret
            assert not any(secret.encode() in data for data in stored.values()), secret
    finally:
        if client is not None and BUCKET in [b["Name"] for b in client.list_buckets()["Buckets"]]:
            for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
                client.delete_object(Bucket=BUCKET, Key=item["Key"])
            client.delete_bucket(Bucket=BUCKET)
        server.stop()
