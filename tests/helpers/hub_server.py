"""A Hugging Face hub endpoint on localhost for `HF_ENDPOINT`: a real HTTP server that
answers the requests `huggingface_hub.snapshot_download` makes for one model repository, and
records each request, so that tests see what was fetched (CI has no internet)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@contextmanager
def hub_server(
    repo: str, files: dict[str, bytes], as_the_hub: bool = False
) -> Iterator[tuple[str, list[str]]]:
    """Serve `files` as model `repo` at its `main` revision; yields (endpoint, requested paths).
    Another repository is a plain 404, or with `as_the_hub` what huggingface.co answers to an
    unauthenticated client: 401 with `X-Error-Code: RepoNotFound`."""
    requested: list[str] = []
    tree = [
        {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
        for name, data in files.items()
    ]
    info = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": name} for name in files]}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, body: bool) -> None:
            path = self.path.split("?")[0]
            requested.append(path)
            headers = {"X-Repo-Commit": COMMIT}
            if path == f"/api/models/{repo}/revision/main":
                data = json.dumps(info).encode()
            elif path == f"/api/models/{repo}/tree/{COMMIT}":
                data = json.dumps(tree).encode()
            elif path.startswith(f"/{repo}/resolve/") and path.split("/", 5)[-1] in files:
                data = files[path.split("/", 5)[-1]]
                headers["ETag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            else:
                hub_style = as_the_hub and path.startswith("/api/models/")
                self.send_response(401 if hub_style else 404)
                if hub_style:
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.send_header("X-Error-Message", "Repository not found")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requested
    finally:
        server.shutdown()
        server.server_close()
