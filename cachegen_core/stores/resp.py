"""A Redis value read straight into a caller's buffer (``RedisStore.read_into``): RESP over a plain socket.

redis-py returns every value in fresh memory (a 7B chunk's raw form: 200 MB, its pages faulted in and then
copied again to reach a GPU). Here the bulk reply of ``GETRANGE key 0 limit`` is received with ``recv_into``
straight into the buffer (on a GPU host, a pinned read buffer the copy to the device starts from), with the
``PEXPIRE`` that sets a read entry's expiry again pipelined behind it, as ``RedisStore`` reads do.

One socket per thread, to the server of a single-server client's pool, authenticated (``AUTH``) and on its
database (``SELECT``) as that client is; TLS, Redis Cluster and anything else redis-py connects to on its
own are left to ``RedisStore.get``.
"""

from __future__ import annotations

import socket
import threading
from typing import Any


class ServerError(Exception):
    """An error reply of the server (``-ERR ...``, ``-NOPERM ...``)."""


class _Conn:
    """One socket and the bytes received past the last reply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()

    def send(self, *commands: tuple[Any, ...]) -> None:
        out = bytearray()
        for cmd in commands:
            out += b"*%d\r\n" % len(cmd)
            for arg in cmd:
                data = arg if isinstance(arg, bytes) else str(arg).encode()
                out += b"$%d\r\n%s\r\n" % (len(data), data)
        self.sock.sendall(out)

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the Redis server closed the connection")
        self.pending += chunk

    def line(self) -> bytes:
        """The next reply line, without its CRLF; an error reply raises ``ServerError``."""
        while (i := self.pending.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.pending[:i])
        del self.pending[: i + 2]
        if line[:1] == b"-":
            raise ServerError(line[1:].decode("utf-8", "replace"))
        return line

    def fill(self, view: memoryview) -> None:
        """Exactly ``len(view)`` bytes of the reply into ``view``: what was received already, then ``recv_into`` it."""
        got = min(len(self.pending), len(view))
        view[:got] = self.pending[:got]
        del self.pending[:got]
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("the Redis server closed the connection")
            got += n

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class BulkReader:
    """Reads values into buffers over its own sockets (one per thread) to the server ``kwargs`` (a redis-py
    connection pool's ``connection_kwargs``) names."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        self._local = threading.local()
        self._all: list[_Conn] = []
        self._lock = threading.Lock()

    @staticmethod
    def supports(client: Any) -> bool:
        """Whether ``client`` (redis-py) talks to one server over plain TCP or a Unix socket with RESP2 (no TLS, no cluster)."""
        pool = getattr(client, "connection_pool", None)
        kwargs = getattr(pool, "connection_kwargs", None)
        cls = getattr(pool, "connection_class", None)
        return (
            isinstance(kwargs, dict) and cls is not None and cls.__name__ in ("Connection", "UnixDomainSocketConnection")
            and kwargs.get("protocol") in (None, 2, "2") and kwargs.get("credential_provider") is None
        )  # fmt: skip

    def _connect(self) -> _Conn:
        kw = self.kwargs
        timeout = kw.get("socket_connect_timeout") or kw.get("socket_timeout")
        if kw.get("path"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(kw["path"])
        else:
            sock = socket.create_connection((kw.get("host", "localhost"), int(kw.get("port", 6379))), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(kw.get("socket_timeout"))
        conn = _Conn(sock)
        try:
            if kw.get("password") is not None:
                user = kw.get("username")
                conn.send(("AUTH", user, kw["password"]) if user else ("AUTH", kw["password"]))
                conn.line()
            if int(kw.get("db") or 0):
                conn.send(("SELECT", int(kw["db"])))
                conn.line()
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._all.append(conn)
        return conn

    def read_into(self, full: str, buffer: Any, limit: int | None, ttl_ms: int | None) -> tuple[memoryview | bytes | None, str | None]:
        """The value of ``full`` (a view of ``buffer``'s first bytes when it fits there, else bytes; None when absent,
        or empty: no stored blob is) and the error the server gave to setting its expiry again (``ttl_ms``; None
        when it did or none was asked). At most ``limit + 1`` bytes are transferred (a longer value reads as that
        many: the caller refuses it). One retry on a dropped connection; else ``ServerError``, ``OSError`` or
        ``ValueError`` (a reply that is not RESP)."""
        for attempt in range(2):
            conn = getattr(self._local, "conn", None)
            fresh = conn is None
            if conn is None:
                conn = self._local.conn = self._connect()
            try:
                return self._read(conn, full, buffer, limit, ttl_ms)
            except ServerError:
                raise  # the reply was read whole: the connection is still in step
            except (OSError, ValueError):
                self._drop(conn)
                if fresh or attempt:
                    raise
        raise AssertionError("unreachable")

    def _read(self, conn: _Conn, full: str, buffer: Any, limit: int | None, ttl_ms: int | None) -> tuple[memoryview | bytes | None, str | None]:
        end = -1 if limit is None else limit
        commands: list[tuple[Any, ...]] = [("GETRANGE", full, 0, end)]
        if ttl_ms is not None:
            commands.append(("PEXPIRE", full, ttl_ms))
        conn.send(*commands)
        try:
            head = conn.line()
        except ServerError:
            if ttl_ms is not None:
                _skip_reply(conn)
            raise
        if head[:1] != b"$":
            raise ValueError(f"not a bulk reply: {head[:40]!r}")
        n = int(head[1:])
        out: memoryview | bytes | None = None
        if n > 0:
            target = memoryview(buffer).cast("B")[:n] if n <= len(buffer) else memoryview(bytearray(n))
            conn.fill(target)
            out = target if n <= len(buffer) else bytes(target)
        if n >= 0:
            conn.fill(memoryview(bytearray(2)))  # its CRLF
        if ttl_ms is not None:
            try:
                conn.line()
            except ServerError as e:  # e.g. NOPERM: the value is good; the caller decides about expiries
                return out, str(e)
        return out, None

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def close(self) -> None:
        """Close every thread's socket."""
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()


def _skip_reply(conn: _Conn) -> None:
    """Read past one simple reply (the PEXPIRE behind a GETRANGE the server refused), whatever it says."""
    try:
        conn.line()
    except ServerError:
        pass
