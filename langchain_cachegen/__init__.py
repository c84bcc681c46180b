"""LangChain integration of CacheGen: reuse long contexts' KV caches from a store."""

from .chat_models import ChatCacheGen
from .documents import format_documents
from .llms import CacheGenLLM
from .stores import ByteStoreKVStore, KVByteStore

__all__ = ["CacheGenLLM", "ChatCacheGen", "ByteStoreKVStore", "KVByteStore", "format_documents"]
