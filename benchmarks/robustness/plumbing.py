"""Store plumbing the scenarios attack through: a store with hooks around reads and writes, a delaying TCP proxy,
a private redis-server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cachegen_core.testing import running_redis_server


class HookedStore:
    """Delegates to ``inner``; ``on_get(key, value)`` and ``on_put(items)`` run around reads and writes."""

    def __init__(self, inner: Any, on_get: Callable[[str, bytes | None], None] | None = None,
                 on_put: Callable[[list[tuple[str, bytes]]], None] | None = None) -> None:  # fmt: skip
        self.inner, self.on_get, self.on_put = inner, on_get, on_put
        self.namespace = inner.namespace

    def get(self, key: str) -> bytes | None:
        value = self.inner.get(key)
        if self.on_get is not None:
            self.on_get(key, value)
        return value

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put(self, key: str, value: bytes) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Any) -> None:
        items = list(items.items() if hasattr(items, "items") else items)
        if self.on_put is not None:
            self.on_put(items)
        self.inner.put_many(items)

    def __getattr__(self, name: str) -> Any:  # contains, delete, keys, close...
        return getattr(self.inner, name)


class DelayProxy:
    """A loopback TCP proxy that holds every server->client read for ``delay_s`` (a slow link)."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="delay-proxy").start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.delay_s), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for s in self._conns:
            s.close()


@contextmanager
def redis_server() -> Iterator[Any]:
    """A private ``redis-server`` (``cachegen_core.testing.redis_server``), stopped afterwards."""
    with running_redis_server() as server:
        yield server
