"""An HTTP server on localhost that misbehaves on request, for tests of remote inputs: a real
`ThreadingHTTPServer` in a thread serving the files of a directory (read again at every
request, so a test may change them between requests) or relaying to an upstream server (an
S3 server, moto), with switches for what object stores and web servers differ in (byte
ranges, ETag, Last-Modified, Content-Type), faults on the n-th GET (a stall, a truncated
body, an error status, the server going down) and a hook called before every answer."""

from __future__ import annotations

import base64
import email.utils
import http.client
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import xxhash


@dataclass
class Faults:
    """What the server does; a test may change any field while the server runs. `*_on`
    count GET requests from 1 (HEAD requests are not counted); `stall_on`, `truncate_on`
    and `status_on` may name several."""

    ranges: bool = True  # answer Range with 206 (else the whole body with 200)
    etag: bool = True  # a strong ETag: the xxh3 of the contents
    no_etag: set[str] = field(default_factory=set)  # paths (/NAME) served without one anyway
    weak_etag: bool = False  # W/"...": the same meaning, not the same bytes (nginx with gzip)
    last_modified: bool = True
    content_type: bool = True
    stall_on: set[int] = field(default_factory=set)  # sleep `stall_seconds` before answering
    stall_seconds: float = 30.0
    stall_all: bool = False  # every request, HEAD too
    truncate_on: set[int] = field(default_factory=set)  # half the body, then close
    trickle_on: set[int] = field(default_factory=set)  # the body a byte every 0.1 s
    # The next N GETs of /NAME have their body's middle byte inverted on the way.
    flip: dict[str, int] = field(default_factory=dict)
    status_on: dict[int, int] = field(default_factory=dict)  # answer this status instead
    down_from: int | None = None  # from this GET on, the server is gone (connections refused)
    # "USER:PASSWORD": a request without that HTTP Basic credential is answered 401, as a
    # store that needs one answers (None: every request is served).
    auth: str | None = None
    # Called with (GET number or 0 for HEAD, method, path) before each answer: change files.
    hook: Callable[[int, str, str], None] | None = None
    # Writes (PUT, POST, DELETE: relayed upstream with their bodies), counted from 1 apart
    # from GETs: an error status, a stall, the server gone from the n-th on, and a hook
    # called with (write number, method, path) before each (returning True: the request is
    # dropped unanswered, as by a server that died with it).
    write_status_on: dict[int, int] = field(default_factory=dict)
    write_stall_on: set[int] = field(default_factory=set)
    write_down_from: int | None = None
    write_hook: Callable[[int, str, str], bool | None] | None = None


class FaultServer(ThreadingHTTPServer):
    daemon_threads = True
    root: Path
    upstream: tuple[str, int] | None  # relay every request there instead of serving `root`
    faults: Faults
    down: bool
    gets: int
    writes: int
    requests: list[tuple[str, str, str]]  # (method, path, Range header)
    lock: threading.Lock
    stopping: threading.Event

    def url(self, name: str = "") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up on a stalled or truncated answer: expected here

    def go_down(self) -> None:
        """Stop listening (new connections are refused) and drop every request from now."""
        if not self.down:
            self.down = True
            threading.Thread(target=lambda: (self.shutdown(), self.socket.close())).start()


class _Handler(BaseHTTPRequestHandler):
    server: FaultServer
    protocol_version = "HTTP/1.1"  # keep-alive, as object stores serve

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_PUT(self) -> None:
        self._write()

    do_POST = do_DELETE = do_PUT

    def _request_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                data += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return data
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    def _write(self) -> None:
        server, faults = self.server, self.server.faults
        body = self._request_body()
        with server.lock:
            server.writes += 1
            number = server.writes
            server.requests.append((self.command, self.path, ""))
        if faults.write_hook is not None and faults.write_hook(number, self.command, self.path):
            self.close_connection = True
            return
        if faults.write_down_from is not None and number >= faults.write_down_from:
            server.go_down()
        if server.down:
            self.close_connection = True
            return
        if number in faults.write_stall_on:
            server.stopping.wait(faults.stall_seconds)
        if number in faults.write_status_on:
            return self._empty(faults.write_status_on[number])
        self._relay(True, False, request_body=body)

    def _answer(self, body: bool) -> None:
        server, faults = self.server, self.server.faults
        with server.lock:
            number = 0
            if body:
                server.gets += 1
                number = server.gets
            server.requests.append((self.command, self.path, self.headers.get("Range", "")))
            flip = body and faults.flip.get(self.path, 0) > 0
            if flip:
                faults.flip[self.path] -= 1
        if faults.down_from is not None and number >= faults.down_from:
            server.go_down()
        if server.down:
            self.close_connection = True
            return
        if faults.hook is not None:
            faults.hook(number, self.command, self.path)
        if faults.stall_all or number in faults.stall_on:
            server.stopping.wait(faults.stall_seconds)
        if number in faults.status_on:
            return self._empty(faults.status_on[number])
        if faults.auth is not None and self.headers.get("Authorization") != _basic(faults.auth):
            return self._empty(401, {"WWW-Authenticate": 'Basic realm="store"'})
        if server.upstream is not None:
            return self._relay(body, number in faults.truncate_on, flip)
        path = server.root / self.path.split("?", 1)[0].lstrip("/")
        if path.is_dir():
            names = sorted(os.listdir(path))
            links = "".join(f'<a href="{n}{"/" if (path / n).is_dir() else ""}">{n}</a>\n'
                            for n in names)  # fmt: skip
            return self._send(200, links.encode(), {"Content-Type": "text/html"}, body)
        try:
            data = path.read_bytes()
            stat = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return self._empty(404)
        headers = {}
        if faults.etag and self.path not in faults.no_etag:
            headers["ETag"] = f'{"W/" * faults.weak_etag}"{xxhash.xxh3_64_hexdigest(data)}"'
        if faults.last_modified:
            headers["Last-Modified"] = email.utils.formatdate(stat.st_mtime, usegmt=True)
        if faults.content_type:
            headers["Content-Type"] = "application/octet-stream"
        status = 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if faults.ranges:
            headers["Accept-Ranges"] = "bytes"
            if match is not None:
                start = int(match[1])
                if start >= len(data):
                    return self._empty(416, {"Content-Range": f"bytes */{len(data)}"})
                end = min(int(match[2]) + 1 if match[2] else len(data), len(data))
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
                data, status = data[start:end], 206
        truncate = number in faults.truncate_on
        data = _flipped(data) if flip else data
        self._send(status, data, headers, body, truncate, number in faults.trickle_on)

    def _relay(
        self, body: bool, truncate: bool, flip: bool = False, request_body: bytes | None = None
    ) -> None:
        connection = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        dropped = {"transfer-encoding", "content-length"} if request_body is not None else set()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        if request_body is not None:
            headers["Content-Length"] = str(len(request_body))
        try:
            connection.request(self.command, self.path, body=request_body, headers=headers)
            answer = connection.getresponse()
            data = answer.read()
        finally:
            connection.close()
        skip = {"content-length", "transfer-encoding", "connection"}
        headers = {k: v for k, v in answer.getheaders() if k.lower() not in skip}
        if not body:  # a HEAD: the object's length, not the empty body's
            headers["Content-Length"] = answer.getheader("Content-Length", "0")
        self._send(answer.status, _flipped(data) if flip else data, headers, body, truncate)

    def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
        self._send(status, b"", headers or {}, True)

    def _send(
        self,
        status: int,
        data: bytes,
        headers: dict[str, str],
        body: bool,
        truncate: bool = False,
        trickle: bool = False,
    ) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(data)), **headers}.items():
            self.send_header(name, value)
        if truncate:
            self.send_header("Connection", "close")
        self.end_headers()
        if body and trickle:  # never a stall long enough for a socket timeout
            for at in range(len(data)):
                if self.server.stopping.wait(0.1):
                    break
                self.wfile.write(data[at : at + 1])
                self.wfile.flush()
        elif body:
            self.wfile.write(data[: len(data) // 2] if truncate else data)
        if truncate:
            self.close_connection = True


def _basic(credential: str) -> str:
    return "Basic " + base64.b64encode(credential.encode()).decode()


def _flipped(data: bytes) -> bytes:
    """`data` with its middle byte inverted: damage on the way that keeps the length."""
    if not data:
        return data
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF
    return bytes(damaged)


@contextmanager
def fault_server(
    root: Path | None = None, faults: Faults | None = None, upstream: str | None = None
) -> Iterator[FaultServer]:
    """Serve the files under `root` at `server.url(NAME)`, or relay to `upstream`
    (`http://HOST:PORT`), until the block ends."""
    server = FaultServer(("127.0.0.1", 0), _Handler)
    server.root, server.faults = Path(root or "."), faults or Faults()
    server.upstream, server.down = None, False
    if upstream is not None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        server.upstream = (host, int(port))
    server.gets, server.writes, server.requests = 0, 0, []
    server.lock, server.stopping = threading.Lock(), threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopping.set()  # a stalled answer ends now
        if not server.down:
            server.shutdown()
        server.server_close()
