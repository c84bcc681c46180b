"""KV stores: bytes in, bytes out, every failure a ``StoreError``.

``DiskCacheStore`` is the default (local disk, size-limited); ``RedisStore`` shares one
cache between serving machines; ``MemoryStore`` is for tests and single processes.
"""

from .base import DEFAULT_NAMESPACE, BaseKVStore, KVStore
from .disk import DiskCacheStore, default_directory
from .memory import MemoryStore
from .redis import RedisStore

__all__ = [
    "DEFAULT_NAMESPACE",
    "BaseKVStore",
    "DiskCacheStore",
    "KVStore",
    "MemoryStore",
    "RedisStore",
    "default_directory",
]
