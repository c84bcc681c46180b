"""Real ``redis-server`` processes on 127.0.0.1 and a free port, for tests and benchmarks.

Each server runs without persistence in its own temporary directory and can be
stopped, killed, paused (SIGSTOP) and restarted on the same port, which is what the
failure tests need. redis-py (the ``redis`` extra) is imported only when a server is
started or a client made, so importing this module needs neither.
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
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

START_TIMEOUT_S = 10.0
INSTALL_HINT = "apt-get install -y redis-server"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def in_ci() -> bool:
    """True under CI (``CI`` set and not ``0``/``false``/``no``), where missing services are failures."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def find_redis_server() -> str | None:
    """Path of the ``redis-server`` binary on PATH, or None."""
    return shutil.which("redis-server")


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
        self.extra_args: list[str] = []  # more ``--option value`` pairs (a cluster node's, ``redis_cluster.py``)
        self.workdir = tempfile.mkdtemp(prefix="cachegen-redis-")
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = False  # answered once: a restart keeps its port

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client of this server that fails fast (no retries, short connect timeout)."""
        import redis  # noqa: PLC0415
        from redis.backoff import NoBackoff  # noqa: PLC0415
        from redis.retry import Retry  # noqa: PLC0415

        opts: dict[str, Any] = {"socket_connect_timeout": 0.5, "password": self.password, "retry": Retry(NoBackoff(), 0)}
        if self.tls:
            opts.update(ssl=True, ssl_ca_certs=self.tls["ca"])
        return redis.Redis(host=self.host, port=self.port, **{**opts, **kwargs})

    def _args(self) -> list[str]:
        args = [self.binary, "--bind", self.host, "--save", "", "--appendonly", "no", "--dir", self.workdir,
                "--daemonize", "no", "--loglevel", "warning"]  # fmt: skip
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"],
                     "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                     "--tls-auth-clients", "no"]  # fmt: skip
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        return args + self.extra_args

    def start(self) -> None:
        """Start (or restart on the same port) and wait until it answers PING. A first start whose port another process
        took since it was picked (``free_port`` can only say it was free) tries new ports."""
        for attempt in range(3):
            try:
                return self._start()
            except RuntimeError as e:
                if self.started or "Address already in use" not in str(e) or attempt == 2:
                    raise
                self.new_ports()

    def new_ports(self) -> None:
        """Pick new free ports (before a first start)."""
        self.port = free_port()

    def _start(self) -> None:
        import redis  # noqa: PLC0415

        if self.proc is not None and self.proc.poll() is None:
            return
        log_path = os.path.join(self.workdir, "redis.log")
        with open(log_path, "ab") as log:  # a file, not a pipe: a full pipe would block the server
            self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        probe = self.client(socket_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    with open(log_path, "rb") as log:
                        out = log.read().decode(errors="replace")
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {out[-2000:]}")
                try:
                    if probe.ping():
                        self.started = True
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop(kill=True)
                    raise RuntimeError(f"redis-server did not answer PING on port {self.port} in {START_TIMEOUT_S}s")
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
        """Stop the server and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_redis_server(binary: str | None = None, **kwargs: Any) -> RedisServer:
    """A started ``RedisServer`` (see its options; ``binary``: the one on PATH by default); the caller closes it."""
    binary = binary or find_redis_server()
    if binary is None:
        raise RuntimeError(f"redis-server not found on PATH ({INSTALL_HINT})")
    last: Exception | None = None
    for _ in range(3):  # the free port may be taken between probing and binding
        server = RedisServer(binary, **kwargs)
        try:
            server.start()
            return server
        except RuntimeError as exc:
            last = exc
            server.close()
    raise RuntimeError(f"could not start redis-server: {last}")


@contextmanager
def running_redis_server(binary: str | None = None, **kwargs: Any) -> Iterator[RedisServer]:
    """``start_redis_server`` as a context manager: the server is closed on exit."""
    server = start_redis_server(binary, **kwargs)
    try:
        yield server
    finally:
        server.close()
