"""``RedisStore``: a KV cache shared by several serving machines, on redis-py.

Connection options (``username``, ``password``, ``ssl`` and every other ``ssl_*`` or
socket option of ``redis.Redis``) pass straight through, or come from a
``redis://`` / ``rediss://`` / ``unix://`` URL. Defaults are chosen so that a dead or
hung server fails fast with ``StoreError`` instead of hanging a request: short
connect and socket timeouts, and one immediate retry (which also heals a pooled
connection that went stale across a server restart) instead of redis-py's default
of ten retries with backoff.

Reads are bounded: a value is fetched with ``GETRANGE 0 max_value_bytes`` inside a
``MULTI`` with ``EXISTS``, so a hostile oversized entry is never transferred in full
and is reported as ``StoreError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import StoreError
from .base import DEFAULT_NAMESPACE, BaseKVStore, Items, iter_items

#: Redis' own limit on a string value (proto-max-bulk-len default).
REDIS_MAX_VALUE_BYTES = 512 * (1 << 20)

_GLOB_SPECIAL = "\\*?[]"


def _escape_glob(s: str) -> str:
    return "".join("\\" + c if c in _GLOB_SPECIAL else c for c in s)


class RedisStore(BaseKVStore):
    """A ``KVStore`` on a Redis server (or anything speaking its protocol).

    ``url`` (if given) wins over ``host``/``port``/``db``. ``ttl_s`` sets an expiry on
    every value written (``None``: keep until Redis' own eviction policy removes it).
    ``client`` wraps an existing ``redis.Redis`` (its own options are then used).
    ``**redis_kwargs`` go to ``redis.Redis`` (e.g. ``ssl_ca_certs``, ``ssl_certfile``,
    ``max_connections``).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        ssl: bool = False,
        namespace: str = DEFAULT_NAMESPACE,
        socket_timeout: float = 2.0,
        socket_connect_timeout: float = 1.0,
        retries: int = 1,
        max_value_bytes: int | None = REDIS_MAX_VALUE_BYTES,
        ttl_s: float | None = None,
        client: redis.Redis | None = None,
        **redis_kwargs: Any,
    ) -> None:
        super().__init__(namespace, max_value_bytes)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._owns_client = client is None
        if client is not None:
            self._client = client
        else:
            opts: dict[str, Any] = {
                "socket_timeout": socket_timeout,
                "socket_connect_timeout": socket_connect_timeout,
                "retry": Retry(NoBackoff(), retries),
                **redis_kwargs,
            }
            if url is not None:
                for name, value in (("username", username), ("password", password)):
                    if value is not None:
                        opts[name] = value
                if ssl:
                    opts["ssl"] = True
                self._client = redis.Redis.from_url(url, **opts)
            else:
                self._client = redis.Redis(
                    host=host, port=port, db=db, username=username, password=password, ssl=ssl, **opts
                )
        self._where = self._describe()

    def _describe(self) -> str:
        """Server address for messages (never the password)."""
        kw = getattr(self._client.connection_pool, "connection_kwargs", {})
        if "path" in kw:
            return f"unix://{kw['path']}"
        return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client."""
        return self._client

    @contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        try:
            yield
        except StoreError:
            raise
        except (redis.RedisError, OSError) as exc:
            raise StoreError(f"RedisStore {op} failed on {self._where}: {type(exc).__name__}: {exc}") from exc

    def _read(self, fulls: list[str]) -> list[bytes | None]:
        if not fulls:
            return []
        limit = self.max_value_bytes
        if limit is None:
            values: list[bytes | None] = self._client.mget(fulls)  # type: ignore[assignment]
            return [None if v is None else bytes(v) for v in values]
        pipe = self._client.pipeline(transaction=True)
        for f in fulls:
            pipe.exists(f)
            pipe.getrange(f, 0, limit)  # at most limit + 1 bytes come back
        res = pipe.execute()
        out: list[bytes | None] = []
        for i, f in enumerate(fulls):
            exists, data = res[2 * i], res[2 * i + 1]
            if not exists:
                out.append(None)
            elif len(data) > limit:
                raise StoreError(f"RedisStore: value of {f!r} on {self._where} exceeds max_value_bytes={limit}")
            else:
                out.append(bytes(data))
        return out

    def get(self, key: str) -> bytes | None:
        full = self._full(key)
        with self._errors("get"):
            return self._read([full])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        fulls = [self._full(k) for k in keys]
        with self._errors("get_many"):
            return self._read(fulls)

    def put(self, key: str, value: bytes) -> None:
        full, data = self._full(key), self._value(value)
        with self._errors("put"):
            self._client.set(full, data, px=self.ttl_ms)

    def put_many(self, items: Items) -> None:
        pairs = [(self._full(k), self._value(v)) for k, v in iter_items(items)]
        if not pairs:
            return
        with self._errors("put_many"):
            pipe = self._client.pipeline(transaction=False)
            for full, data in pairs:
                pipe.set(full, data, px=self.ttl_ms)
            pipe.execute()

    def contains(self, key: str) -> bool:
        full = self._full(key)
        with self._errors("contains"):
            return bool(self._client.exists(full))

    def delete(self, key: str) -> None:
        full = self._full(key)
        with self._errors("delete"):
            self._client.delete(full)

    def delete_many(self, keys: Sequence[str]) -> None:
        fulls = [self._full(k) for k in keys]
        if not fulls:
            return
        with self._errors("delete_many"):
            self._client.delete(*fulls)

    def keys(self, prefix: str = "") -> Iterator[str]:
        pattern = _escape_glob(self._full(prefix)) + "*"
        with self._errors("keys"):
            for k in self._client.scan_iter(match=pattern, count=1000):
                yield self._strip(k.decode("utf-8", "surrogateescape") if isinstance(k, bytes) else k)

    def entries(self, prefix: str = "", batch: int = 500) -> Iterator[tuple[str, int, float | None]]:
        """(key, bytes, seconds since last read or written) of every entry whose key starts with ``prefix``.

        Bytes are Redis' ``MEMORY USAGE`` (the value plus a few dozen bytes of overhead) and
        the time is ``OBJECT IDLETIME``: neither command counts as an access, so listing
        does not make entries look recently used.
        """
        keys = iter(self.keys(prefix))
        while True:
            part = [k for _, k in zip(range(batch), keys)]
            if not part:
                return
            with self._errors("entries"):
                pipe = self._client.pipeline(transaction=False)
                for k in part:
                    pipe.execute_command("MEMORY", "USAGE", self._full(k), "SAMPLES", "0")
                    pipe.object("idletime", self._full(k))
                res = pipe.execute(raise_on_error=False)
            for i, k in enumerate(part):
                size, idle = res[2 * i], res[2 * i + 1]
                if isinstance(size, int) and isinstance(idle, int):  # else deleted meanwhile
                    yield k, size, float(idle)

    def head(self, key: str, n: int) -> bytes | None:
        """The first ``n`` bytes of ``key``'s value (None when absent), without reading the rest."""
        full = self._full(key)
        with self._errors("head"):
            pipe = self._client.pipeline(transaction=True)
            pipe.exists(full)
            pipe.getrange(full, 0, max(0, n - 1))
            exists, data = pipe.execute()
        return bytes(data) if exists else None

    def ping(self) -> bool:
        """True when the server answers; ``StoreError`` otherwise."""
        with self._errors("ping"):
            return bool(self._client.ping())

    def close(self) -> None:
        if self._owns_client:
            with self._errors("close"):
                self._client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self._where!r}, namespace={self.namespace!r})"
