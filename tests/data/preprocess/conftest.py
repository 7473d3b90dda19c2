"""Fixtures shared by the preprocessing tests of remote inputs."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free port of this machine; its address in fsspec's and boto's
    environment variables, which the hp-data processes started by a test inherit. moto keeps
    buckets per process, across servers: each test names buckets of its own."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}",
    }
    yield env
    server.stop()
