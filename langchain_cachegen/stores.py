"""Bridges between LangChain ``ByteStore``s and cachegen ``KVStore``s.

* :class:`ByteStoreKVStore` lets any LangChain ``BaseStore[str, bytes]``
  (``InMemoryByteStore``, ``LocalFileStore``, a Redis/Upstash/... ByteStore) hold
  KV blobs for the engine.
* :class:`KVByteStore` exposes any cachegen store as a LangChain ``ByteStore``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from langchain_core.stores import BaseStore, ByteStore

from cachegen_core.errors import StoreError
from cachegen_core.stores import BaseKVStore, KVStore

#: ``/`` rather than ``:`` so that keys stay valid for ``LocalFileStore``.
BYTESTORE_NAMESPACE = "cachegen/"


class ByteStoreKVStore(BaseKVStore):
    """A ``KVStore`` over a LangChain ``ByteStore``; its failures become ``StoreError``.

    The wrapped store's own errors are of arbitrary types, so any exception it
    raises is wrapped; a value that is not bytes is reported the same way.
    """

    def __init__(
        self,
        byte_store: ByteStore,
        *,
        namespace: str = BYTESTORE_NAMESPACE,
        max_value_bytes: int | None = None,
    ) -> None:
        super().__init__(namespace, max_value_bytes)
        self.byte_store = byte_store

    @contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        try:
            yield
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"{type(self.byte_store).__name__}.{op} failed: {type(exc).__name__}: {exc}") from exc

    def _checked(self, values: Sequence[object]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for v in values:
            if v is None:
                out.append(None)
            elif isinstance(v, (bytes, bytearray, memoryview)):
                data = bytes(v)
                if self.max_value_bytes is not None and len(data) > self.max_value_bytes:
                    raise StoreError(f"stored value of {len(data)} bytes exceeds max_value_bytes={self.max_value_bytes}")
                out.append(data)
            else:
                raise StoreError(f"{type(self.byte_store).__name__} returned {type(v).__name__}, expected bytes")
        return out

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        fulls = [self._full(k) for k in keys]
        if not fulls:
            return []
        with self._errors("mget"):
            values = self.byte_store.mget(fulls)
        if len(values) != len(fulls):
            raise StoreError(f"{type(self.byte_store).__name__}.mget returned {len(values)} values for {len(fulls)} keys")
        return self._checked(values)

    def put(self, key: str, value: bytes) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Iterable[tuple[str, bytes]] | Mapping[str, bytes]) -> None:
        pairs = [(self._full(k), self._value(v)) for k, v in (items.items() if isinstance(items, Mapping) else items)]
        if pairs:
            with self._errors("mset"):
                self.byte_store.mset(pairs)

    def contains(self, key: str) -> bool:
        return self.get(key) is not None

    def delete(self, key: str) -> None:
        self.delete_many([key])

    def delete_many(self, keys: Sequence[str]) -> None:
        fulls = [self._full(k) for k in keys]
        if fulls:
            with self._errors("mdelete"):
                self.byte_store.mdelete(fulls)

    def keys(self, prefix: str = "") -> Iterator[str]:
        start = self._full(prefix)
        with self._errors("yield_keys"):
            for k in self.byte_store.yield_keys(prefix=start):
                if k.startswith(start):  # some stores ignore or loosely apply the prefix
                    yield self._strip(k)


class KVByteStore(BaseStore[str, bytes]):
    """Any cachegen ``KVStore`` as a LangChain ``ByteStore`` (``BaseStore[str, bytes]``).

    Keys are passed as they are; the wrapped store applies its own namespace.
    Failures surface as ``StoreError``.
    """

    def __init__(self, kv_store: KVStore) -> None:
        self.kv_store = kv_store

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        return self.kv_store.get_many(list(keys))

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        self.kv_store.put_many(list(key_value_pairs))

    def mdelete(self, keys: Sequence[str]) -> None:
        self.kv_store.delete_many(list(keys))

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        yield from self.kv_store.keys(prefix or "")


__all__ = ["BYTESTORE_NAMESPACE", "ByteStoreKVStore", "KVByteStore"]
