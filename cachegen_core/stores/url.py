"""Open a store from a one-string description: what ``CACHEGEN_STORE`` and the ``cachegen`` commands take.

==========================  ===========================================================
``disk``                    ``DiskCacheStore()`` in the package cache (``$CACHEGEN_CACHE_DIR/kv``)
``disk:///path``, a path    ``DiskCacheStore(path)`` (a directory, created if missing)
``memory``                  ``MemoryStore()`` (this process only)
``redis://``, ``rediss://`` ``RedisStore(url)``: credentials (``rediss://user:pass@host:port/db``)
``unix://``                 and redis-py's query options (``?ssl_ca_certs=/ca.pem``) ride in the URL
==========================  ===========================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import DEFAULT_NAMESPACE, KVStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(url: str, *, namespace: str = DEFAULT_NAMESPACE, cache_dir: str | Path | None = None, **options: Any) -> KVStore:
    """The store ``url`` describes (see the module doc), with ``namespace``.

    ``cache_dir``: the directory of ``disk`` (default: the package cache's ``kv``).
    ``options`` go to the store's constructor (e.g. ``size_limit``, ``ttl_s``).
    """
    spec = url.strip()
    if not spec:
        raise ValueError("empty store URL: use disk, memory, a directory, or a redis:// / rediss:// URL")
    if spec == "memory":
        from .memory import MemoryStore  # noqa: PLC0415

        return MemoryStore(namespace=namespace, **options)
    if spec.startswith(REDIS_SCHEMES):
        from . import RedisStore  # noqa: PLC0415  (names the extra when redis-py is missing)

        return RedisStore(spec, namespace=namespace, **options)
    from .disk import DiskCacheStore  # noqa: PLC0415

    if spec == "disk":
        directory = Path(cache_dir) / "kv" if cache_dir is not None else None
        return DiskCacheStore(directory, namespace=namespace, **options)
    if spec.startswith("disk://"):
        spec = spec[len("disk://") :]
        if not spec:
            raise ValueError("disk:// needs a path: disk:///var/cache/cachegen")
    elif "://" in spec:
        raise ValueError(f"unknown store URL scheme in {describe(url)!r}: use disk, memory, a directory, redis:// or rediss://")
    return DiskCacheStore(Path(spec).expanduser(), namespace=namespace, **options)


def describe(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "@" not in netloc:
        return url
    creds, _, host = netloc.rpartition("@")
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}{slash}{path}"
