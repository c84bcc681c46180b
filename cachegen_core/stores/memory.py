"""``MemoryStore``: a thread-safe in-process store with an optional byte budget, in two tiers (``tiers.py``).

Where torch sees a GPU, big values (a chunk's raw forms and levels) are held in pinned host memory
(``pinned.py``), so the engine's reader copies them to the GPU at the link's rate, straight from where they
are (``view``); ``get`` then hands back a copy of such a value as ``bytes``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np

from ..errors import StoreError
from ..pinned import HostArena, host_arena, parallel_copy, root_block
from .base import DEFAULT_NAMESPACE, BaseKVStore, Items, iter_items
from .tiers import CAPACITY_TIER, DEFAULT_RAW_SHARE, RAW_TIER, Tier, check_share, chunk_of, raw_keys, tier_of, yielding_tier

#: Values from this size on are held in pinned memory where a GPU is (smaller ones: manifests, profiles).
PIN_MIN_BYTES = 1 << 20
Value = bytes | np.ndarray  # an array: bytes in a pinned block (a ``HostBlock`` or a view of one)


class MemoryStore(BaseKVStore):
    """Values in dicts, least recently used evicted first once ``max_bytes`` is exceeded.

    ``max_bytes`` counts value bytes; ``None`` means unbounded. A single value larger
    than ``max_bytes`` is refused with ``StoreError``. Two tiers (``tiers.py``): raw forms are
    evicted first, one at a time, the rest a whole chunk at a time; ``raw_share``: a share of
    ``max_bytes`` kept for raw forms all the same (default none); ``None``: one plain LRU over every key.
    ``pinned``: hold values of ``PIN_MIN_BYTES`` and more in pinned memory where torch sees a GPU (``True``,
    the process's ``pinned.host_arena``), in a given ``HostArena``, or never (``False``); a value the arena
    has no room for, an eighth of it kept free for the copies in flight, is held as plain bytes.
    """

    local = True
    shares_values = True

    def __init__(
        self,
        max_bytes: int | None = None,
        *,
        raw_share: float | None = DEFAULT_RAW_SHARE,
        namespace: str = DEFAULT_NAMESPACE,
        max_value_bytes: int | None = None,
        pinned: bool | HostArena = True,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if max_bytes is not None:
            max_value_bytes = max_bytes if max_value_bytes is None else min(max_bytes, max_value_bytes)
        super().__init__(namespace, max_value_bytes)
        self.max_bytes = max_bytes
        self.raw_share = check_share(raw_share)
        self.arena = pinned if isinstance(pinned, HostArena) else host_arena() if pinned else None
        # the engine's reader fetches with ``view`` (no copy) when this store holds pinned values and reads them
        # as this class does (a subclass with its own ``get``, e.g. one that counts or delays reads, keeps it)
        self.views = self.arena is not None and type(self).get is MemoryStore.get and type(self).view is MemoryStore.view
        self._raw: OrderedDict[str, Value] = OrderedDict()  # the raw tier, least recently used first
        self._units: OrderedDict[str, dict[str, Value]] = OrderedDict()  # the capacity tier: chunk -> its values
        self._bytes = {RAW_TIER: 0, CAPACITY_TIER: 0}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def total_bytes(self) -> int:
        """Bytes of values held now."""
        return self._bytes[RAW_TIER] + self._bytes[CAPACITY_TIER]

    @property
    def tier_bytes(self) -> dict[str, int]:
        """Bytes of values held now in each tier."""
        return dict(self._bytes)

    def budget(self) -> dict[str, int | float | None]:
        """The byte budget and the raw tier's share of it (for ``cachegen stats``)."""
        return {"limit": self.max_bytes, "raw_share": self.raw_share if self.max_bytes is not None else None}

    def _tier(self, full: str) -> Tier:
        return tier_of(full) if self.raw_share is not None else CAPACITY_TIER

    def _unit(self, full: str) -> str:
        return chunk_of(full) if self.raw_share is not None else full

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("MemoryStore is closed")

    def _get_locked(self, full: str) -> Value | None:
        if self._tier(full) == RAW_TIER:
            value = self._raw.get(full)
            if value is not None:
                self._raw.move_to_end(full)
            return value
        unit = self._unit(full)
        values = self._units.get(unit)
        value = values.get(full) if values is not None else None
        if value is not None:
            self._units.move_to_end(unit)
        return value

    def _pop_locked(self, full: str) -> Value | None:
        if self._tier(full) == RAW_TIER:
            old = self._raw.pop(full, None)
            tier = RAW_TIER
        else:
            unit, tier = self._unit(full), CAPACITY_TIER
            values = self._units.get(unit)
            old = values.pop(full, None) if values is not None else None
            if values is not None and not values:
                del self._units[unit]
        if old is not None:
            self._bytes[tier] -= len(old)
        return old

    def _put_locked(self, full: str, value: Value) -> None:
        self._pop_locked(full)
        tier = self._tier(full)
        if tier == RAW_TIER:
            self._raw[full] = value
        else:
            unit = self._unit(full)
            self._units.setdefault(unit, {})[full] = value
            self._units.move_to_end(unit)
        self._bytes[tier] += len(value)
        if self.max_bytes is not None:
            self._evict_locked(self.max_bytes)

    def _evict_locked(self, limit: int) -> None:
        share = self.raw_share if self.raw_share is not None else 0.0
        while (tier := yielding_tier(limit, share, self._bytes[RAW_TIER], self._bytes[CAPACITY_TIER])) is not None:
            if tier == RAW_TIER:
                _, old = self._raw.popitem(last=False)
                self._bytes[RAW_TIER] -= len(old)
                continue
            unit, values = self._units.popitem(last=False)  # a whole chunk: manifest, levels, and its raw forms
            self._bytes[CAPACITY_TIER] -= sum(len(v) for v in values.values())
            if self.raw_share is not None:
                for key in raw_keys(unit):
                    old = self._raw.pop(key, None)
                    if old is not None:
                        self._bytes[RAW_TIER] -= len(old)

    def view(self, key: str) -> Value | None:
        """The value of ``key`` as held (a pinned block, or the bytes object), not copied: read it, never write it.
        What the engine's reader fetches with (a block goes to a GPU straight from pinned memory)."""
        full = self._full(key)
        with self._lock:
            self._check_open()
            return self._get_locked(full)

    def get(self, key: str) -> bytes | None:
        value = self.view(key)
        return value if value is None or isinstance(value, bytes) else value.tobytes()

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        fulls = [self._full(k) for k in keys]
        with self._lock:
            self._check_open()
            values = [self._get_locked(f) for f in fulls]
        return [v if v is None or isinstance(v, bytes) else v.tobytes() for v in values]

    def _held(self, value: object) -> Value:
        """What the store holds for ``value``: pinned when it is big and the arena has room (bytes already in a block of
        that arena, as a memoryview or a view, are taken as they are: a chunk a GPU staged there), else its bytes."""
        arena = self.arena
        size = len(value) if isinstance(value, (bytes, bytearray, memoryview, np.ndarray)) else -1
        if arena is None or size < PIN_MIN_BYTES or (self.max_value_bytes is not None and size > self.max_value_bytes):
            return self._value(value)
        if root_block(value) is not None and arena.tensor(value) is not None:
            return np.frombuffer(value, dtype=np.uint8)  # type: ignore[arg-type]  # its block kept alive through it
        block = arena.alloc(size, reserve=arena.limit_bytes // 8)  # room left for copies in flight and read buffers
        if block is None:
            return self._value(value)
        parallel_copy(block, np.frombuffer(value, dtype=np.uint8))  # type: ignore[arg-type]
        return block

    def put(self, key: str, value: bytes) -> None:
        full, data = self._full(key), self._held(value)
        with self._lock:
            self._check_open()
            self._put_locked(full, data)

    def put_many(self, items: Items) -> None:
        pairs = [(self._full(k), self._held(v)) for k, v in iter_items(items)]
        with self._lock:
            self._check_open()
            for full, data in pairs:
                self._put_locked(full, data)

    def contains(self, key: str) -> bool:
        full = self._full(key)
        with self._lock:
            self._check_open()
            if self._tier(full) == RAW_TIER:
                return full in self._raw
            return full in self._units.get(self._unit(full), ())

    def delete(self, key: str) -> None:
        full = self._full(key)
        with self._lock:
            self._check_open()
            self._pop_locked(full)

    def _items_locked(self) -> Iterator[tuple[str, Value]]:
        yield from self._raw.items()
        for values in self._units.values():
            yield from values.items()

    def keys(self, prefix: str = "") -> Iterator[str]:
        start = self._full(prefix)
        with self._lock:
            self._check_open()
            matched = [self._strip(k) for k, _ in self._items_locked() if k.startswith(start)]
        yield from matched

    def entries(self, prefix: str = "") -> Iterator[tuple[str, int, float | None]]:
        """(key, bytes, None: no store times are kept) of every entry whose key starts with ``prefix``."""
        start = self._full(prefix)
        with self._lock:
            self._check_open()
            matched = [(self._strip(k), len(v), None) for k, v in self._items_locked() if k.startswith(start)]
        yield from matched

    def close(self) -> None:
        with self._lock:
            self._raw.clear()
            self._units.clear()
            self._bytes = {RAW_TIER: 0, CAPACITY_TIER: 0}
            self._closed = True

    def __len__(self) -> int:
        return len(self._raw) + sum(len(v) for v in self._units.values())
