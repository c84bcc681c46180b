"""CacheGen core: compress a context's KV cache into a compact bitstream, keep it in a store, stream it back.

No LangChain import anywhere in this package (``langchain_cachegen`` is the LangChain face).
The public API, importable from here (loaded on first use, so that ``import cachegen_core``
stays cheap):

- engine: :class:`KVEngine`, :class:`GenerationInfo`, :class:`ChunkReader`, :class:`ChunkWriter`, :class:`CostModel`;
- codec: :class:`KVCodec`, :class:`CodecConfig`, :class:`Profile`, :class:`KVCache`;
- stores: :class:`MemoryStore`, :class:`DiskCacheStore`, :class:`RedisStore` (extra ``redis``), :class:`KVStore`;
- chunks and manifests: :class:`Chunk`, :func:`chunk_keys`, :func:`blob_key`, :class:`Manifest`;
- models: :func:`load_model`; paths: :func:`cache_dir`;
- errors: :class:`CacheGenError`, :class:`CacheGenFormatError`, :class:`StoreError`, :class:`BlobMissing`,
  :class:`StoreURLError`, :class:`BackendUnavailable`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "KVEngine": "engine",
    "GenerationInfo": "engine",
    "ChunkReader": "engine",
    "ChunkWriter": "engine",
    "CostModel": "engine",
    "KVCodec": "codec.kvcodec",
    "CodecConfig": "codec.config",
    "Profile": "codec.profile",
    "KVCache": "kv",
    "MemoryStore": "stores",
    "DiskCacheStore": "stores",
    "RedisStore": "stores",
    "KVStore": "stores",
    "Chunk": "keys.chunks",
    "chunk_keys": "keys.chunks",
    "blob_key": "keys.chunks",
    "Manifest": "keys.manifest",
    "load_model": "models",
    "cache_dir": "paths",
    "CacheGenError": "errors",
    "CacheGenFormatError": "errors",
    "StoreError": "errors",
    "BlobMissing": "errors",
    "StoreURLError": "errors",
    "BackendUnavailable": "errors",
    "EngineBusy": "errors",
    "TooLarge": "errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .keys.chunks import Chunk, blob_key, chunk_keys
    from .codec.kvcodec import KVCodec
    from .codec.config import CodecConfig
    from .engine import ChunkReader, ChunkWriter, CostModel, GenerationInfo, KVEngine
    from .errors import BackendUnavailable, BlobMissing, CacheGenError, CacheGenFormatError, EngineBusy, StoreError, StoreURLError, TooLarge
    from .kv import KVCache
    from .keys.manifest import Manifest
    from .models import load_model
    from .paths import cache_dir
    from .codec.profile import Profile
    from .stores import DiskCacheStore, KVStore, MemoryStore, RedisStore


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cachegen_core' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
