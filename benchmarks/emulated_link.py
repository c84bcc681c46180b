"""A network link emulated inside the process: a store whose reads arrive at the link's rate (issue 46).

The loopback proxy (``throttled_proxy.py``) relays every byte through Python and tops out near 1.6 Gbit/s on
a GPU host, so links of 10-100 Gbit/s are emulated as the CacheGen paper does: a read returns the inner
store's value once a clock of the link says its bytes have crossed it. One link per store, shared by every
read (``TraceLink``: concurrent fetches queue on it), a round trip added per request (``rtt_s``). The engine
sees a remote store (not ``local``, not ``same_host``: its fetch thread receives chunk i+1 while chunk i
decodes), so transfer and decoding pipeline exactly as on a real link. What arrives is a fresh copy, made
before the wait (a NIC writes the bytes while they arrive): into the reader's (on a GPU pinned) buffer with
``read_into``, else new memory. Writes pass through unshaped (the engine writes off the measured path).

    store = LinkStore(MemoryStore(), gbps=10.0)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.throttled_proxy import TraceLink
from cachegen_core.pinned import parallel_copy


class LinkStore:
    """``store`` behind an emulated link of ``gbps`` (see the module doc); ``clock``/``sleep`` injectable for tests."""

    local = False
    same_host = False
    shares_values = False
    views = False

    def __init__(self, store: Any, gbps: float, *, rtt_s: float = 0.0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        if gbps <= 0 or rtt_s < 0:
            raise ValueError("gbps must be > 0 and rtt_s >= 0")
        self.store, self.gbps, self.rtt_s = store, gbps, rtt_s
        self.clock, self.sleep = clock, sleep
        self.link = TraceLink([gbps], slice_s=1e9, burst_s=0.0, t0=clock())
        self.bytes_sent = 0

    def _arrive(self, nbytes: int, sent: float) -> None:
        """Wait until ``nbytes`` asked for at ``sent`` have crossed the link (behind the bytes queued before them)."""
        done = self.link.reserve(nbytes, sent + self.rtt_s / 2) + self.rtt_s / 2
        self.bytes_sent += nbytes
        delay = done - self.clock()
        if delay > 0:
            self.sleep(delay)

    def _held(self, key: str) -> Any:
        view = getattr(self.store, "view", None)
        return view(key) if view is not None else self.store.get(key)

    def get(self, key: str) -> bytes | None:
        sent = self.clock()
        value = self._held(key)
        out = None if value is None else memoryview(value).tobytes()  # received: a copy in fresh memory
        self._arrive(len(out) if out is not None else 0, sent)
        return out

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        sent = self.clock()
        out = [None if v is None else memoryview(v).tobytes() for v in self.store.get_many(keys)]
        self._arrive(sum(len(v) for v in out if v is not None), sent)
        return out

    def read_into(self, key: str, buffer: Any) -> memoryview | bytes | None:
        """The value received into ``buffer`` when it fits (a view of its first bytes), else as bytes."""
        sent = self.clock()
        value = self._held(key)
        if value is None:
            self._arrive(0, sent)
            return None
        src = np.frombuffer(value, dtype=np.uint8)
        if src.size > len(buffer):
            out: memoryview | bytes = src.tobytes()
        else:
            out = memoryview(buffer).cast("B")[: src.size]
            parallel_copy(np.frombuffer(out, dtype=np.uint8), src)
        self._arrive(src.size, sent)
        return out

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> LinkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:  # put, put_many, delete, keys, namespace, ...: unshaped
        return getattr(self.store, name)

    def __repr__(self) -> str:
        return f"LinkStore({self.store!r}, {self.gbps} Gbit/s)"
