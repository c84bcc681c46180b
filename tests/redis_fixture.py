"""pytest fixtures running a real ``redis-server`` on 127.0.0.1 and a free port.

``redis_server`` is shared by a whole session (tests flush it or use their own
namespace); ``fresh_redis_server`` is private to one test, for tests that stop,
kill, pause or restart it. Without a ``redis-server`` binary the tests are skipped,
except under ``CI`` (set and not ``0``/``false``), where that is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

_START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def redis_server_binary() -> str:
    """Path of ``redis-server``; skips the test (fails it under CI) when missing."""
    path = shutil.which("redis-server")
    if path is None:
        msg = "redis-server not found on PATH (apt-get install -y redis-server)"
        if _in_ci():
            pytest.fail(msg + "; it is required when CI is set", pytrace=False)
        pytest.skip(msg)
    return path


class RedisServer:
    """One ``redis-server`` process without persistence; restartable on the same port.

    ``password`` sets ``requirepass``; ``tls`` (paths ``cert``, ``key``, ``ca``) serves
    TLS only, on the same port, without client certificates.
    """

    host = "127.0.0.1"

    def __init__(self, binary: str, *, password: str | None = None, tls: dict[str, str] | None = None) -> None:
        self.binary = binary
        self.password = password
        self.tls = tls
        self.workdir = tempfile.mkdtemp(prefix="cachegen-redis-")
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        opts: dict[str, object] = {"socket_connect_timeout": 0.5, "password": self.password,
                                   "retry": Retry(NoBackoff(), 0)}
        if self.tls:
            opts.update(ssl=True, ssl_ca_certs=self.tls["ca"])
        return redis.Redis(host=self.host, port=self.port, **{**opts, **kwargs})  # type: ignore[arg-type]

    def _args(self) -> list[str]:
        args = [self.binary, "--bind", self.host, "--save", "", "--appendonly", "no", "--dir", self.workdir,
                "--daemonize", "no", "--loglevel", "warning"]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"],
                     "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                     "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        return args

    def start(self) -> None:
        """Start (or restart on the same port) and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return
        log_path = os.path.join(self.workdir, "redis.log")
        with open(log_path, "ab") as log:  # a file, not a pipe: a full pipe would block the server
            self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        probe = self.client(socket_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    with open(log_path, "rb") as log:
                        out = log.read().decode(errors="replace")
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {out[-2000:]}")
                try:
                    if probe.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop(kill=True)
                    raise RuntimeError(f"redis-server did not answer PING on port {self.port} in {_START_TIMEOUT_S}s")
                time.sleep(0.02)
        finally:
            probe.close()

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (``kill``: SIGKILL, as in a crash)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def flushall(self) -> None:
        c = self.client()
        try:
            c.flushall()
        finally:
            c.close()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_redis_server(binary: str, **kwargs: object) -> RedisServer:
    """A started ``RedisServer`` (see its options); the caller closes it."""
    last: Exception | None = None
    for _ in range(3):  # the free port may be taken between probing and binding
        server = RedisServer(binary, **kwargs)  # type: ignore[arg-type]
        try:
            server.start()
            return server
        except RuntimeError as exc:
            last = exc
            server.close()
    raise RuntimeError(f"could not start redis-server: {last}")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by the session; flushed before each use by the tests' stores."""
    server = start_redis_server(redis_server_binary())
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def fresh_redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test alone, free to be stopped, killed, paused or restarted."""
    server = start_redis_server(redis_server_binary())
    try:
        yield server
    finally:
        server.close()
