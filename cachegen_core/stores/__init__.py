"""KV stores: bytes in, bytes out, every failure a ``StoreError``.

``DiskCacheStore`` is the default (local disk, size-limited); ``RedisStore`` shares one
cache between serving machines; ``MemoryStore`` is for tests and single processes.
``SignedStore`` wraps any of them to authenticate every value with a deployment key;
``open_store`` opens one from a URL (``disk``, a directory, ``memory``, ``redis(s)://``);
``admin`` lists and evicts chunks (``cachegen stats`` / ``cachegen gc``).
``RedisStore`` needs redis-py (``pip install 'langchain-cachegen[redis]'``), so it is
imported on first use: the other stores work without it.

May import: ``errors``, ``paths`` and ``codec.format`` (``admin`` reads blob headers).
"""

from __future__ import annotations

from typing import Any

from .base import DEFAULT_NAMESPACE, BaseKVStore, KVStore
from .disk import DiskCacheStore, default_directory
from .memory import MemoryStore
from .signed import SignedStore
from .url import open_store

__all__ = [
    "DEFAULT_NAMESPACE",
    "BaseKVStore",
    "DiskCacheStore",
    "KVStore",
    "MemoryStore",
    "RedisStore",
    "SignedStore",
    "default_directory",
    "open_store",
]

REDIS_HINT = "RedisStore needs redis-py: pip install 'langchain-cachegen[redis]'"


def __getattr__(name: str) -> Any:
    if name != "RedisStore":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from .redis import RedisStore  # noqa: PLC0415
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "redis":
            raise
        raise ImportError(REDIS_HINT, name=e.name) from e
    globals()["RedisStore"] = RedisStore  # later look-ups skip this function
    return RedisStore
