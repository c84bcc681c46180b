"""A real ``redis-server`` serving TLS with a throwaway CA and server certificate (made with openssl).

``tls_redis_server`` skips a test with the exact reason when this machine cannot run one:
no ``openssl`` binary, or a ``redis-server`` built without TLS (its own error message).
Under ``CI`` a missing ``redis-server`` is a failure, as for the plain fixtures.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachegen_core.testing import RedisServer, start_redis_server
from tests.redis_fixture import redis_server_binary


def make_tls_files(d: Path) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 / localhost signed by it (2 days), as redis-server's tls paths."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found on PATH: cannot make a test CA and certificate (apt-get install -y openssl)")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=cachegen-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "srv.crt",
        "-days", "2", "-extfile", "ext")  # fmt: skip
    return {"cert": str(d / "srv.crt"), "key": str(d / "srv.key"), "ca": str(d / "ca.crt")}


@pytest.fixture
def tls_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test serving TLS only (``server.tls["ca"]``: the CA to trust)."""
    binary = redis_server_binary()
    tls = make_tls_files(tmp_path)
    try:
        server = start_redis_server(binary, tls=tls)
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server cannot serve TLS: {exc}")
        raise
    try:
        yield server
    finally:
        server.close()
