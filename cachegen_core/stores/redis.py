"""``RedisStore``: a KV cache shared by several serving machines, on redis-py.

Connection options (``username``, ``password``, ``ssl`` and every other ``ssl_*`` or
socket option of ``redis.Redis``) pass straight through, or come from a
``redis://`` / ``rediss://`` / ``unix://`` URL. Defaults are chosen so that a dead or
hung server fails fast with ``StoreError`` instead of hanging a request: short
connect and socket timeouts, and one immediate retry (which also heals a pooled
connection that went stale across a server restart) instead of redis-py's default
of ten retries with backoff.

Reads are bounded: a value is fetched with ``GETRANGE 0 max_value_bytes`` beside an
``EXISTS`` (in a ``MULTI`` on one server), so a hostile oversized entry is never transferred
in full and is reported as ``StoreError``.

Tiers (``tiers.py``): Redis evicts by its own ``maxmemory-policy``, so the tiers are expiries:
``raw_ttl_s`` for the raw forms (default an hour), ``ttl_s`` for the rest (default none), each
counted from the entry's last use (a read sets it again). With ``maxmemory-policy volatile-ttl``
and both set, the entry nearest its expiry goes first: raw forms before levels, each tier least
recently used first (``docs/configuration.md``).

Cluster (``cluster=True``, or a ``redis-cluster://`` / ``rediss-cluster://`` URL): redis-py's
``RedisCluster``; ``get_many`` and ``put_many`` are pipelines it sends as one round trip per
node (no ``MULTI``: keys of several slots), and ``put_many`` returns once every node has
answered, so the writer's manifest, put after its blobs, never names a blob not yet stored. A
value deleted between its ``EXISTS`` and ``GETRANGE`` reads as empty, which the reader takes for
a miss (no stored blob or manifest is empty).

A server on a loopback address or a Unix socket runs on this machine's cores: ``same_host`` (detected
from the address; ``same_host=`` overrides it) makes the engine plan its fetches in turns with a CPU
decode, as for a local store (on 2 cores, planning them to overlap made the engine 10-17 % slower than
plain fp16 bytes from the same server: ``docs/results.md``).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from ..errors import StoreError
from .base import DEFAULT_NAMESPACE, BaseKVStore, Items, iter_items
from .resp import BulkReader, ServerError
from .tiers import RAW_TIER, tier_of

log = logging.getLogger(__name__)

#: Redis' own limit on a string value (proto-max-bulk-len default).
REDIS_MAX_VALUE_BYTES = 512 * (1 << 20)
#: Raw forms unused for this long expire (their chunks stay hits at their levels).
DEFAULT_RAW_TTL_S = 3600.0
CLUSTER_SCHEMES = {"redis-cluster://": "redis://", "rediss-cluster://": "rediss://"}

_GLOB_SPECIAL = "\\*?[]"


def _loopback(host: str | None) -> bool:
    """``localhost`` or a loopback IP address."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _escape_glob(s: str) -> str:
    return "".join("\\" + c if c in _GLOB_SPECIAL else c for c in s)


class RedisStore(BaseKVStore):
    """A ``KVStore`` on a Redis server (or anything speaking its protocol).

    ``url`` (if given) wins over ``host``/``port``/``db``. ``ttl_s`` sets an expiry on
    every value written but raw forms, ``raw_ttl_s`` on raw forms (at most ``ttl_s``), both
    from the last use (``None``: keep until Redis' own eviction policy removes it).
    ``cluster``: a Redis Cluster (``host``/``port`` or ``url`` name one of its nodes).
    ``client`` wraps an existing ``redis.Redis`` or ``RedisCluster`` (its own options are then
    used). ``**redis_kwargs`` go to the client (e.g. ``ssl_ca_certs``, ``ssl_certfile``,
    ``max_connections``). ``same_host``: the server runs on this machine (``None``: a loopback
    address or a Unix socket; see ``BaseKVStore.same_host``).
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
        raw_ttl_s: float | None = DEFAULT_RAW_TTL_S,
        cluster: bool = False,
        client: redis.Redis | redis.RedisCluster | None = None,
        same_host: bool | None = None,
        **redis_kwargs: Any,
    ) -> None:
        super().__init__(namespace, max_value_bytes)
        for name, value in (("ttl_s", ttl_s), ("raw_ttl_s", raw_ttl_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0")
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        raw_ms = None if raw_ttl_s is None else max(1, int(raw_ttl_s * 1000))
        self.raw_ttl_ms = raw_ms if self.ttl_ms is None or raw_ms is None else min(raw_ms, self.ttl_ms)
        for scheme, plain in CLUSTER_SCHEMES.items():
            if url is not None and url.startswith(scheme):
                url, cluster = plain + url[len(scheme) :], True
        self.cluster = cluster or (client is not None and isinstance(client, redis.RedisCluster))
        self._owns_client = client is None
        self._refresh = True  # reads set expiries again (off for a user without PEXPIRE)
        self._lock = threading.Lock()
        self._cluster_args: tuple[Any, ...] | None = None
        self._client: Any = None
        self._reader: BulkReader | bool | None = None  # read_into's sockets (False: this client cannot, ``resp.py``)
        if client is not None:
            self._client = client
        elif self.cluster:  # connected on first use: a cluster client asks a node for the slot map when made
            self._cluster_args = (url, host, port, username, password, ssl, socket_timeout, socket_connect_timeout, retries,
                                  redis_kwargs)  # fmt: skip
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
                self._client = redis.Redis(host=host, port=port, db=db, username=username, password=password, ssl=ssl, **opts)
        self._where = self._describe()
        self._same_host = self._on_loopback() if same_host is None else bool(same_host)

    def _describe(self) -> str:
        """Server address for messages (never the password)."""
        if self._cluster_args is not None:
            url, host, port = self._cluster_args[:3]
            where = urlsplit(url).netloc.rpartition("@")[2] if url is not None else f"{host}:{port}"
            return f"cluster {where}"
        if self.cluster:
            node = self._client.get_default_node()
            return f"cluster {node.name if node is not None else '?'}"
        kw = getattr(self._client.connection_pool, "connection_kwargs", {})
        if "path" in kw:
            return f"unix://{kw['path']}"
        return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"

    def _on_loopback(self) -> bool:
        """Whether the server's address is a Unix socket or a loopback host (a cluster: the node given)."""
        if self._cluster_args is not None:
            url, host = self._cluster_args[:2]
            return _loopback(urlsplit(url).hostname if url is not None else host)
        if self.cluster:
            return False
        kw = getattr(self._client.connection_pool, "connection_kwargs", {})
        return "path" in kw or _loopback(kw.get("host"))

    @property
    def same_host(self) -> bool:
        """Whether the server runs on this machine, so a fetch takes this machine's cores (``BaseKVStore.same_host``)."""
        return self._same_host

    @property
    def client(self) -> redis.Redis | redis.RedisCluster:
        """The underlying redis-py client (on a cluster, made on first use: ``RedisClusterException`` when no node answers)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = _cluster_client(*self._cluster_args)  # type: ignore[misc]
        return self._client

    def _ttl(self, full: str) -> int | None:
        """The expiry (ms) of a key's tier."""
        return self.raw_ttl_ms if tier_of(full) == RAW_TIER else self.ttl_ms

    def _pipeline(self) -> Any:
        """A pipeline that is one ``MULTI`` on one server; on a cluster, one round trip per node (no ``MULTI``)."""
        return self.client.pipeline(transaction=not self.cluster)

    @contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        try:
            yield
        except StoreError:
            raise
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            raise StoreError(f"RedisStore {op} failed on {self._where}: {type(exc).__name__}: {exc}") from exc

    def _read(self, fulls: list[str]) -> list[bytes | None]:
        """The values of ``fulls``, bounded, in one pipeline that also sets each found key's expiry again (unless
        this user may not: then reads read only, and entries expire from their writes)."""
        if not fulls:
            return []
        limit = self.max_value_bytes
        refresh = [self._refresh and self._ttl(f) is not None for f in fulls]
        pipe = self._pipeline()
        for f, touch in zip(fulls, refresh):
            pipe.exists(f)
            if limit is None:
                pipe.get(f)
            else:
                pipe.getrange(f, 0, limit)  # at most limit + 1 bytes come back
            if touch:
                pipe.pexpire(f, self._ttl(f))  # from the last use (a no-op on an absent key)
        try:
            res = iter(pipe.execute())
        except redis.exceptions.NoPermissionError as e:
            if not any(refresh) or "pexpire" not in str(e).lower():
                raise
            self._refresh = False
            log.warning("%s: this user may not PEXPIRE, so reads leave expiries as the writes set them", self._where)
            return self._read(fulls)
        out: list[bytes | None] = []
        for f, touch in zip(fulls, refresh):
            exists, data = next(res), next(res)
            if touch:
                next(res)
            if not exists or data is None:
                out.append(None)
            elif limit is not None and len(data) > limit:
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
            self.client.set(full, data, px=self._ttl(full))

    def put_many(self, items: Items) -> None:
        pairs = [(self._full(k), self._value(v)) for k, v in iter_items(items)]
        if not pairs:
            return
        with self._errors("put_many"):
            pipe = self.client.pipeline(transaction=False)
            for full, data in pairs:
                pipe.set(full, data, px=self._ttl(full))
            pipe.execute()  # every node has answered: a manifest put after this never names a blob not yet stored

    def contains(self, key: str) -> bool:
        full = self._full(key)
        with self._errors("contains"):
            return bool(self.client.exists(full))

    def delete(self, key: str) -> None:
        full = self._full(key)
        with self._errors("delete"):
            self.client.delete(full)

    def delete_many(self, keys: Sequence[str]) -> None:
        fulls = [self._full(k) for k in keys]
        if not fulls:
            return
        with self._errors("delete_many"):
            self.client.delete(*fulls)

    def keys(self, prefix: str = "") -> Iterator[str]:
        pattern = _escape_glob(self._full(prefix)) + "*"
        with self._errors("keys"):
            for k in self.client.scan_iter(match=pattern, count=1000):
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
                pipe = self.client.pipeline(transaction=False)
                for k in part:
                    pipe.execute_command("MEMORY", "USAGE", self._full(k), "SAMPLES", "0")
                    pipe.object("idletime", self._full(k))
                res = pipe.execute(raise_on_error=False)
            for i, k in enumerate(part):
                size, idle = res[2 * i], res[2 * i + 1]
                if isinstance(size, int) and isinstance(idle, int):  # else deleted meanwhile
                    yield k, size, float(idle)

    def read_into(self, key: str, buffer: Any) -> memoryview | bytes | None:
        """The value of ``key`` received straight into ``buffer`` when it fits (a view of its first bytes), else as
        bytes; None when absent (``resp.py``: a single server over TCP or a Unix socket; elsewhere ``get``). For big
        values read again and again into the same (on a GPU host, pinned) buffers: ``get`` returns each in fresh memory."""
        if self._reader is None:
            with self._lock:
                if self._reader is None:
                    self._reader = (
                        BulkReader(self.client.connection_pool.connection_kwargs) if not self.cluster and BulkReader.supports(self.client) else False
                    )
        if self._reader is False:
            return self.get(key)
        full, limit = self._full(key), self.max_value_bytes
        with self._errors("read_into"):
            try:
                value, expiry_error = self._reader.read_into(full, buffer, limit, self._ttl(full) if self._refresh else None)
            except (ServerError, ValueError) as e:  # an error reply, or one that is not RESP
                raise redis.exceptions.ResponseError(str(e)) from None
        if expiry_error is not None:
            self._refresh = False
            log.warning("%s: this user may not PEXPIRE (%s), so reads leave expiries as the writes set them", self._where, expiry_error)
        if value is not None and limit is not None and len(value) > limit:
            raise StoreError(f"RedisStore: value of {full!r} on {self._where} exceeds max_value_bytes={limit}")
        return value

    def head(self, key: str, n: int) -> bytes | None:
        """The first ``n`` bytes of ``key``'s value (None when absent), without reading the rest."""
        full = self._full(key)
        with self._errors("head"):
            pipe = self._pipeline()
            pipe.exists(full)
            pipe.getrange(full, 0, max(0, n - 1))
            exists, data = pipe.execute()
        return bytes(data) if exists else None

    def ping(self) -> bool:
        """True when the server answers; ``StoreError`` otherwise."""
        with self._errors("ping"):
            return bool(self.client.ping())

    def close(self) -> None:
        if self._reader:
            self._reader.close()
        if self._owns_client and self._client is not None:
            with self._errors("close"):
                self._client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self._where!r}, namespace={self.namespace!r})"


def _cluster_client(url: str | None, host: str, port: int, username: str | None, password: str | None, ssl: bool,
                    socket_timeout: float, socket_connect_timeout: float, retries: int,
                    kwargs: dict[str, Any]) -> redis.RedisCluster:  # fmt: skip
    """A ``RedisCluster`` failing as fast as the single-server client: a dead node's slots fail over, its requests fail."""
    opts: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_connect_timeout,
                            "retry": Retry(NoBackoff(), retries), **kwargs}  # fmt: skip
    for name, value in (("username", username), ("password", password)):
        if value is not None:
            opts[name] = value
    if ssl:
        opts["ssl"] = True
    if url is not None:
        return redis.RedisCluster.from_url(url, **opts)
    return redis.RedisCluster(host=host, port=port, **opts)
