"""HotTier: a chunk's first-stage blobs and manifest, readable by the engine while its writer stores them.

On a local store whose ``put`` costs real time (the disk store: 40 ms per 35 MB raw chunk on the
development machine's ext4, more while the kernel writes back; ``docs/history/``) a miss used to
write its chunks' 16-bit form before returning, so that the next request would find them. Now the
writer encodes that form before returning (a conversion and a checksum), keeps the bytes here, and
its background worker puts them into the store; this engine's reader looks here before the store, so
its next request hits at once. Other engines and processes see the chunk once it is stored
(``flush()`` waits for that). An entry leaves when the store holds it, or when writing it failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence


class HotTier:
    """Values by store key (blobs and manifests), grouped by the chunk they belong to."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._by_chunk: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def put(self, chunk_key: str, values: Mapping[str, bytes]) -> None:
        with self._lock:
            self._values.update(values)
            self._by_chunk.setdefault(chunk_key, []).extend(values)

    def discard(self, chunk_key: str) -> None:
        """Forget a chunk's values (stored now, or failed to be)."""
        with self._lock:
            for key in self._by_chunk.pop(chunk_key, []):
                self._values.pop(key, None)

    def get(self, key: str) -> bytes | None:
        return self._values.get(key)

    def get_many(self, keys: Sequence[str], from_store: Callable[[list[str]], list[bytes | None]]) -> list[bytes | None]:
        """The values of ``keys``, from here first, then ``from_store``. In that order: an entry leaves only
        once the store holds it, so a key is always found in one of them."""
        mine = [self._values.get(k) for k in keys]
        found = from_store(list(keys))
        return [m if m is not None else f for m, f in zip(mine, found)]

    def __len__(self) -> int:
        return len(self._by_chunk)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._values.values())
