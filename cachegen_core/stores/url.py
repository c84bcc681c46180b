"""Open a store from a one-string description: what ``CACHEGEN_STORE`` and the ``cachegen`` commands take.

============================================  ===========================================================
``disk``                                      ``DiskCacheStore()`` in the package cache (``$CACHEGEN_CACHE_DIR/kv``)
``disk:///path``, a path                      ``DiskCacheStore(path)`` (a directory, created if missing)
``memory``                                    ``MemoryStore()`` (this process only)
``redis://``, ``rediss://``, ``unix://``      ``RedisStore(url)``: credentials (``rediss://user:pass@host:port/db``)
                                              and redis-py's query options (``?ssl_ca_certs=/ca.pem``) ride in the URL
``redis-cluster://``, ``rediss-cluster://``   ``RedisStore(url, cluster=True)``: any node of a Redis Cluster
============================================  ===========================================================

The budget rides in the URL's query too (``tiers.py``): ``disk?size_limit=50G&raw_share=0.2``,
``memory?max_bytes=4G``, ``redis://host:6379/0?ttl_s=604800&raw_ttl_s=3600`` (sizes in bytes or
with K, M, G, T: powers of 1024; ``none`` for no expiry or no tiers). ``same_host=1`` (or ``0``) says whether
a Redis server runs on this machine where its address does not say it (``RedisStore``'s ``same_host``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from .base import DEFAULT_NAMESPACE, KVStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis-cluster://", "rediss-cluster://")
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
#: The options a store URL's query may carry for each kind of store, and how each is read.
_OPTIONS = {
    "disk": {"size_limit": "size", "raw_share": "share"},
    "memory": {"max_bytes": "size", "raw_share": "share"},
    "redis": {"ttl_s": "seconds", "raw_ttl_s": "seconds", "same_host": "flag"},
}
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def parse_size(text: str) -> int:
    """``"50G"``, ``"512MiB"``, ``"1048576"``: bytes (K, M, G, T are powers of 1024)."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"bad size {text!r}: give bytes or a number with K, M, G or T")
    return int(float(m[1]) * 1024 ** " kmgt".index((m[2] or " ").lower()))


def _value(kind: str, text: str) -> Any:
    if text.strip().lower() == "none":
        return None
    if kind == "size":
        return parse_size(text)
    if kind == "flag":
        flag = _FLAGS.get(text.strip().lower())
        if flag is None:
            raise ValueError("give 1 or 0 (true or false)")
        return flag
    return float(text)


def _split_options(spec: str, kind: str) -> tuple[str, dict[str, Any]]:
    """``spec`` without the query options of ``_OPTIONS[kind]``, and those options read."""
    base, sep, query = spec.partition("?")
    if not sep:
        return spec, {}
    known = _OPTIONS[kind]
    options, rest = {}, []
    for name, text in parse_qsl(query, keep_blank_values=True):
        if name in known:
            try:
                options[name] = _value(known[name], text)
            except ValueError as e:
                raise ValueError(f"store URL option {name}={text!r}: {e}") from None
        elif kind == "redis":
            rest.append((name, text))  # redis-py's own
        else:
            raise ValueError(f"unknown option {name!r} for a {kind} store (known: {', '.join(known)})")
    if not options:
        return spec, options
    return (base + "?" + urlencode(rest) if rest else base), options


def open_store(url: str, *, namespace: str = DEFAULT_NAMESPACE, cache_dir: str | Path | None = None, create: bool = True,
               **options: Any) -> KVStore:  # fmt: skip
    """The store ``url`` describes (see the module doc), with ``namespace``.

    ``cache_dir``: the directory of ``disk`` (default: the package cache's ``kv``).
    ``create=False``: a disk store must exist already (``StoreError`` otherwise, and for a damaged one: nothing
    is created or moved aside), as the ``cachegen`` commands that read a store want.
    ``options`` go to the store's constructor (e.g. ``size_limit``, ``ttl_s``) and win over the URL's.
    """
    spec = url.strip()
    if not spec:
        raise ValueError("empty store URL: use disk, memory, a directory, or a redis:// / rediss:// URL")
    if spec.split("?")[0] == "memory":
        from .memory import MemoryStore  # noqa: PLC0415

        spec, given = _split_options(spec, "memory")
        return MemoryStore(namespace=namespace, **{**given, **options})
    if spec.startswith(REDIS_SCHEMES):
        from . import RedisStore  # noqa: PLC0415  (names the extra when redis-py is missing)

        spec, given = _split_options(spec, "redis")
        return RedisStore(spec, namespace=namespace, **{**given, **options})
    from .disk import DiskCacheStore  # noqa: PLC0415

    if spec.split("?")[0] == "disk":
        spec, given = _split_options(spec, "disk")
        directory = Path(cache_dir) / "kv" if cache_dir is not None else None
        return DiskCacheStore(directory, namespace=namespace, create=create, **{**given, **options})
    given = {}
    if spec.startswith("disk://"):
        spec, given = _split_options(spec[len("disk://") :], "disk")
        if not spec:
            raise ValueError("disk:// needs a path: disk:///var/cache/cachegen")
    elif "://" in spec:
        raise ValueError(f"unknown store URL scheme in {describe(url)!r}: use disk, memory, a directory, redis://, rediss:// "
                         "or redis-cluster://")
    return DiskCacheStore(Path(spec).expanduser(), namespace=namespace, create=create, **{**given, **options})


def describe(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "@" not in netloc:
        return url
    creds, _, host = netloc.rpartition("@")
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}{slash}{path}"
