"""Open a store from a one-string description: what ``CACHEGEN_STORE`` and the ``cachegen`` commands take.

============================================  ===========================================================
``disk``                                      ``DiskCacheStore()`` in the package cache (``$CACHEGEN_CACHE_DIR/kv``)
``./kv``, ``/var/kv``, ``kv/a``, ``~/kv``,    ``DiskCacheStore(path)``: a path with a separator (or ``~``) says a store is
``disk:///var/kv``, ``disk://kv``             meant, so its directory is created if missing (logged once, by its absolute path)
``kv``: a bare word naming no store           a directory in the working directory that holds a store (its ``cache.db``):
                                              opened; otherwise a ``StoreURLError`` (a typo of ``disk``, say)
``memory``                                    ``MemoryStore()`` (this process only)
``redis://``, ``rediss://``, ``unix://``      ``RedisStore(url)``: credentials (``rediss://user:pass@host:port/db``)
                                              and redis-py's query options (``?ssl_ca_certs=/ca.pem``) ride in the URL
``redis-cluster://``, ``rediss-cluster://``   ``RedisStore(url, cluster=True)``: any node of a Redis Cluster
============================================  ===========================================================

The budget rides in the URL's query too (``tiers.py``): ``disk?size_limit=50G&raw_share=0.2``,
``disk:///var/kv?size_limit=50G``, ``memory?max_bytes=4G``, ``redis://host:6379/0?ttl_s=604800&raw_ttl_s=3600``
(sizes in bytes or with K, M, G, T: powers of 1024; ``none`` for no expiry or no tiers). ``same_host=1`` (or ``0``)
says whether a Redis server runs on this machine where its address does not say it (``RedisStore``'s ``same_host``).
A plain path takes no query (``disk://`` does), and an option that neither this module nor redis-py knows is an
error, never ignored: a typo must not leave a store with its defaults, or make a new one, without a word.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from ..errors import StoreURLError
from .base import DEFAULT_NAMESPACE, KVStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis-cluster://", "rediss-cluster://")
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
#: The options a store URL's query may carry for each kind of store, and how each is read.
_OPTIONS = {
    "disk": {"size_limit": "size", "raw_share": "share"},
    "memory": {"max_bytes": "size", "raw_share": "share"},
    "redis": {"ttl_s": "seconds", "raw_ttl_s": "seconds", "same_host": "flag"},
}
#: The words a store name is made of: each bare, or as a URL's scheme (``memory`` only bare).
_NAMES = ("disk", "memory", "redis", "rediss", "unix", "redis-cluster", "rediss-cluster")
#: What a store URL may be, for the messages of the errors.
FORMS = (
    "disk, memory, a directory (./kv, /var/cache/kv, ~/kv, disk:///path: created if missing), the name of a directory "
    "holding a store, or a redis://, rediss://, unix://, redis-cluster:// or rediss-cluster:// URL"
)
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
                raise StoreURLError(f"store URL option {name}={text!r}: {e}") from None
        elif kind == "redis" and name in _redis_options():
            rest.append((name, text))  # redis-py's own
        else:
            names = [*known, *(_redis_options() if kind == "redis" else ())]
            also = " and redis-py's connection options" if kind == "redis" else ""
            raise StoreURLError(f"unknown option {name!r} for a {kind} store{_closest(name, {n: n for n in names})} "
                                f"(known: {', '.join(known)}{also})")  # fmt: skip
    if not options:
        return spec, options
    return (base + "?" + urlencode(rest) if rest else base), options


@functools.cache
def _redis_options() -> frozenset[str]:
    """The query options redis-py takes in a URL: those its URL parser reads and those a connection accepts."""
    from redis.cluster import KWARGS_DISABLED_KEYS, REDIS_ALLOWED_KEYS  # noqa: PLC0415
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS  # noqa: PLC0415

    return frozenset(URL_QUERY_ARGUMENT_PARSERS) | frozenset(REDIS_ALLOWED_KEYS) - frozenset(KWARGS_DISABLED_KEYS)


def _closest(word: str, names: dict[str, str]) -> str:
    """``": did you mean 'x'?"`` with ``names[n]`` for the key ``n`` closest to ``word``, or ``""`` when none is close."""
    near = difflib.get_close_matches(word.lower(), list(names), n=1, cutoff=0.6)
    return f": did you mean {names[near[0]]!r}?" if near else ""


def _store_names(scheme: bool) -> dict[str, str]:
    """Each store word, and how a suggestion writes it: bare (``disk``, ``memory``) or as a scheme (``redis://``)."""
    return {n: n if n == "memory" or (n == "disk" and not scheme) else f"{n}://" for n in _NAMES}


def _explicit(path: str) -> bool:
    """Whether ``path`` says a directory is meant: a separator in it, ``~`` before it, or ``.`` / ``..``."""
    return path.startswith("~") or path in (".", "..") or any(sep and sep in path for sep in (os.sep, os.altsep))


def _holds_store(directory: Path) -> bool:
    """Whether ``directory`` holds a disk store: its diskcache database (a damaged one too: it is recovered)."""
    from .disk_recovery import DB_NAME  # noqa: PLC0415

    return directory.is_dir() and os.path.lexists(directory / DB_NAME)


def _plain_path(spec: str) -> Path:
    """The directory a plain path names (``./kv``, ``/var/kv``, ``kv/a``, ``~/kv``, or a bare word naming a store).

    A bare word naming no store is an error, never a new store: ``dsik`` or ``memroy`` would otherwise make one in
    the working directory, and the application would miss on every request.
    """
    base, sep, query = spec.partition("?")
    path = Path(base).expanduser()
    if not _explicit(base) and not _holds_store(path):
        what = "a directory without cache.db" if path.is_dir() else "a file" if path.exists() else "no such directory"
        raise StoreURLError(f"unknown store {base!r}{_closest(base, _store_names(False)) or ':'} {str(path.absolute())!r} "
                            f"holds no store ({what}); write ./{base} to make one there. A store is {FORMS}")  # fmt: skip
    if sep:
        raise StoreURLError(f"a plain path takes no options ({spec!r}): write disk://{spec}")
    return path


def open_store(url: str, *, namespace: str = DEFAULT_NAMESPACE, cache_dir: str | Path | None = None, create: bool = True,
               **options: Any) -> KVStore:  # fmt: skip
    """The store ``url`` describes (see the module doc), with ``namespace``.

    ``cache_dir``: the directory of ``disk`` (default: the package cache's ``kv``).
    ``create=False``: a disk store must exist already (``StoreError`` otherwise, and for a damaged one: nothing
    is created or moved aside), as the ``cachegen`` commands that read a store want.
    ``options`` go to the store's constructor (e.g. ``size_limit``, ``ttl_s``) and win over the URL's.
    A bare word is ``disk``, ``memory`` or the name of a directory holding a store; anything naming no store (a
    typo, an unknown scheme or option, a query on a plain path) raises ``StoreURLError`` (a ``ValueError``) before
    anything is created.
    """
    spec = url.strip()
    if not spec:
        raise StoreURLError(f"empty store URL: a store is {FORMS}")
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
            raise StoreURLError("disk:// needs a path: disk:///var/cache/cachegen, disk://./kv")
        path = Path(spec).expanduser()
    elif "://" in spec:
        scheme = spec.partition("://")[0]
        near = _closest(scheme, _store_names(True)) or "."
        raise StoreURLError(f"unknown store URL scheme in {describe(url)!r}{near} A store is {FORMS}")
    else:
        path = _plain_path(spec)
    return DiskCacheStore(path, namespace=namespace, create=create, **{**given, **options})


def describe(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "@" not in netloc:
        return url
    creds, _, host = netloc.rpartition("@")
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}{slash}{path}"
