"""``MemoryStore``: a thread-safe in-process store with an optional LRU byte limit."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from ..errors import StoreError
from .base import DEFAULT_NAMESPACE, BaseKVStore, Items, iter_items


class MemoryStore(BaseKVStore):
    """Values in a dict, least recently used evicted first once ``max_bytes`` is exceeded.

    ``max_bytes`` counts value bytes; ``None`` means unbounded. A single value larger
    than ``max_bytes`` is refused with ``StoreError``.
    """

    local = True
    shares_values = True

    def __init__(
        self,
        max_bytes: int | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        max_value_bytes: int | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if max_bytes is not None:
            max_value_bytes = max_bytes if max_value_bytes is None else min(max_bytes, max_value_bytes)
        super().__init__(namespace, max_value_bytes)
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def total_bytes(self) -> int:
        """Bytes of values held now."""
        return self._bytes

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("MemoryStore is closed")

    def _get_locked(self, full: str) -> bytes | None:
        value = self._data.get(full)
        if value is not None:
            self._data.move_to_end(full)
        return value

    def _put_locked(self, full: str, value: bytes) -> None:
        old = self._data.pop(full, None)
        if old is not None:
            self._bytes -= len(old)
        self._data[full] = value
        self._bytes += len(value)
        if self.max_bytes is not None:
            while self._bytes > self.max_bytes:
                _, evicted = self._data.popitem(last=False)
                self._bytes -= len(evicted)

    def get(self, key: str) -> bytes | None:
        full = self._full(key)
        with self._lock:
            self._check_open()
            return self._get_locked(full)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        fulls = [self._full(k) for k in keys]
        with self._lock:
            self._check_open()
            return [self._get_locked(f) for f in fulls]

    def put(self, key: str, value: bytes) -> None:
        full, data = self._full(key), self._value(value)
        with self._lock:
            self._check_open()
            self._put_locked(full, data)

    def put_many(self, items: Items) -> None:
        pairs = [(self._full(k), self._value(v)) for k, v in iter_items(items)]
        with self._lock:
            self._check_open()
            for full, data in pairs:
                self._put_locked(full, data)

    def contains(self, key: str) -> bool:
        full = self._full(key)
        with self._lock:
            self._check_open()
            return full in self._data

    def delete(self, key: str) -> None:
        full = self._full(key)
        with self._lock:
            self._check_open()
            old = self._data.pop(full, None)
            if old is not None:
                self._bytes -= len(old)

    def keys(self, prefix: str = "") -> Iterator[str]:
        start = self._full(prefix)
        with self._lock:
            self._check_open()
            matched = [self._strip(k) for k in self._data if k.startswith(start)]
        yield from matched

    def entries(self, prefix: str = "") -> Iterator[tuple[str, int, float | None]]:
        """(key, bytes, None: no store times are kept) of every entry whose key starts with ``prefix``."""
        start = self._full(prefix)
        with self._lock:
            self._check_open()
            matched = [(self._strip(k), len(v), None) for k, v in self._data.items() if k.startswith(start)]
        yield from matched

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0
            self._closed = True

    def __len__(self) -> int:
        return len(self._data)
