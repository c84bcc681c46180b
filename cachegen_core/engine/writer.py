"""ChunkWriter: encode a chunk's KV at every stored level and put it in the store, then its manifest.

It owns what writing needs and nothing of the engine: the codec, the store, the levels
kept, an optional background worker (a daemon thread with a bounded queue, so storing
is off the request's path), and the store's health (a failing store is logged once,
not per chunk, until it recovers). The manifest goes last (see ``manifest.py``), so a
reader never sees a partially written chunk.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from ..chunks import Chunk, blob_key
from ..codec import KVCodec
from ..errors import StoreError
from ..kv import KVCache
from ..manifest import Manifest, manifest_key
from ..stores.base import KVStore

log = logging.getLogger("cachegen_core.engine")


class StoreHealth:
    """Whether the store is failing, so that a dead store is logged once, not per request."""

    def __init__(self) -> None:
        self.failing = False

    def failed(self, msg: str) -> None:
        if not self.failing:
            log.warning("%s (further store failures not logged until it recovers)", msg)
        self.failing = True

    def recovered(self, what: str = "reachable") -> None:
        if self.failing:
            log.info("store is %s again", what)
        self.failing = False


class ChunkWriter:
    """Writes chunks (every level of ``levels``, then the manifest) into ``store``.

    ``background``: queue chunks for a worker thread (``submit`` returns at once;
    ``flush`` waits) instead of writing them in ``submit``. ``queue_size`` bounds the
    queue: when it is full a chunk is dropped (counted in ``stats``, logged once).
    """

    def __init__(
        self,
        codec: KVCodec,
        store: KVStore,
        levels: Sequence[int],
        *,
        background: bool = True,
        queue_size: int = 64,
        health: StoreHealth | None = None,
    ) -> None:
        if not levels:
            raise ValueError("a writer needs at least one level to store")
        bad = [lv for lv in levels if lv not in codec.levels]
        if bad:
            raise ValueError(f"levels {bad} not in the codec's {codec.levels}")
        self.codec = codec
        self.store = store
        self.levels = list(levels)
        self.health = health or StoreHealth()
        self._worker = _Worker(self, queue_size) if background else None
        if self._worker is not None:
            atexit.register(_flush_at_exit, weakref.ref(self))

    def write(self, chunk: Chunk, kv: KVCache) -> Manifest:
        """Encode ``kv`` (the chunk's tokens) at every level and store it; raises ``StoreError``/``CacheGenError``."""
        blobs = {lv: self.codec.encode(kv, lv) for lv in self.levels}
        manifest = Manifest({lv: len(b) for lv, b in blobs.items()})
        try:
            self.store.put_many([(blob_key(chunk.key, lv), b) for lv, b in blobs.items()])
            self.store.put(manifest_key(chunk.key), manifest.to_bytes())  # last: it vouches for every blob above
        except StoreError as e:
            self.health.failed(f"store write failed: {e}")
            raise
        self.health.recovered("writable")
        return manifest

    def submit(self, chunk: Chunk, kv: KVCache) -> bool:
        """Queue the chunk for the worker (False: the queue is full, dropped), or write it now without one."""
        if self._worker is None:
            self.write(chunk, kv)
            return True
        return self._worker.submit(chunk, kv)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk is written (or failed); False if ``timeout`` passed first."""
        return True if self._worker is None else self._worker.flush(timeout)

    @property
    def stats(self) -> dict[str, int]:
        """Chunks written, failed and dropped (queue full) by the worker, and still queued ({} without one)."""
        w = self._worker
        return {"written": w.written, "failed": w.failed, "dropped": w.dropped, "queued": w.queue.qsize()} if w else {}

    @property
    def pending(self) -> int:
        return 0 if self._worker is None else self._worker.queue.unfinished_tasks


class _Worker:
    """A daemon thread writing queued chunks; holds its writer weakly, so a dropped writer is reported."""

    def __init__(self, writer: ChunkWriter, maxsize: int) -> None:
        self._writer = weakref.proxy(writer)
        self.queue: queue.Queue[tuple[Chunk, KVCache] | None] = queue.Queue(maxsize=maxsize)
        self.dropped = self.failed = self.written = 0
        self._full = False  # dropping chunks since the queue last had room (logged once)
        self._thread = threading.Thread(target=self._run, name="cachegen-store", daemon=True)
        self._thread.start()

    def submit(self, chunk: Chunk, kv: KVCache) -> bool:
        try:
            self.queue.put_nowait((chunk, kv))
            self._full = False
            return True
        except queue.Full:
            self.dropped += 1
            if not self._full:  # once per overload, not per dropped chunk
                log.warning("store queue full (%d chunks): chunk %s not stored (further drops counted in "
                            "store_stats, not logged, until it drains)", self.queue.maxsize, chunk.key[:12])  # fmt: skip
            self._full = True
            return False

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                self._writer.write(*item)
                self.written += 1
            except ReferenceError:
                lost = 1 + self.queue.qsize()
                log.warning("the KV engine's writer was garbage-collected with %d KV chunk(s) not stored "
                            "(call flush() first)", lost)  # fmt: skip
                return
            except StoreError:  # the writer logs a failing store once, not per chunk
                self.failed += 1
            except Exception as e:  # a failed write is reported, never raised into a request
                self.failed += 1
                log.warning("storing chunk failed: %s", e)
            finally:
                self.queue.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        if timeout is None:
            self.queue.join()
            return True
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


def _flush_at_exit(ref: Callable[[], ChunkWriter | None]) -> None:
    writer = ref()
    if writer is None or not writer.pending:
        return
    if not writer.flush(timeout=60):
        log.warning("exiting with %d KV chunks not yet stored", writer.pending)
