"""ChunkWriter: encode a chunk's KV in every stored form and put it in the store, then its manifest.

It owns what writing needs and nothing of the engine: the codecs, the store, the options
kept, an optional background worker (a daemon thread with a bounded queue, so storing is
off the request's path), and the store's health (a failing store is logged once, not per
chunk, until it recovers). A chunk is written in two stages: its raw forms (cheap: a
conversion and a checksum) with a manifest naming them, then its compression levels with a
manifest naming everything. On a local store (``store.local``: memory, disk) the first
stage is ready before the request answers, so the next request finds its chunks: written to a
store that holds the very objects (memory), else encoded into the :class:`~.hot.HotTier` the
engine's reader looks in first, and stored by the worker (a disk write, 40 ms per 35 MB chunk, is
off the request's path). On a remote store the worker runs every queued chunk's first stage
before any later stage. Each
manifest goes after the blobs it names (see ``manifest.py``), so a reader never sees a
partially written chunk.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

from ..chunks import Chunk, blob_key
from ..codec import KVCodec
from ..errors import CacheGenFormatError, StoreError
from ..kv import KVCache
from ..manifest import RAW_OPTIONS, Manifest, Option, manifest_key
from ..raw import RawCodec
from ..stores.base import KVStore
from .hot import HotTier

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


class _RequestGate:
    """How many requests of this process are computing; ``idle`` is set when none is."""

    def __init__(self) -> None:
        self.idle = threading.Event()
        self.idle.set()
        self._count = 0
        self._lock = threading.Lock()

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            self._count += 1
            self.idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
                if not self._count:
                    self.idle.set()


_GATE = _RequestGate()


class ChunkWriter:
    """Writes chunks (every option of ``options``: levels of ``codec``, raw forms of ``raw``) into ``store``.

    ``background``: queue chunks for a worker thread (``submit`` returns at once, after the
    first stage on a local store; ``flush`` waits) instead of writing them in ``submit``.
    ``queue_size`` bounds the queue: when it is full a chunk is dropped (counted in
    ``stats``, logged once). ``first_stage_now``: write the first stage in ``submit``
    (default: when the store is local).
    """

    def __init__(
        self,
        codec: KVCodec,
        store: KVStore,
        options: Sequence[Option],
        *,
        raw: RawCodec | None = None,
        background: bool = True,
        queue_size: int = 64,
        health: StoreHealth | None = None,
        first_stage_now: bool | None = None,
    ) -> None:
        if not options:
            raise ValueError("a writer needs at least one option to store")
        bad = [o for o in options if o not in RAW_OPTIONS and o not in codec.levels]
        if bad:
            raise ValueError(f"options {bad} are neither raw forms {RAW_OPTIONS} nor in the codec's levels {codec.levels}")
        self.codec = codec
        self.raw = raw or RawCodec(codec.fingerprint)
        self.store = store
        self.options = list(dict.fromkeys(options))
        self.health = health or StoreHealth()
        self.first_stage_now = first_stage_now
        self.hot = HotTier()  # first stages encoded but not yet stored (see ``submit``)
        self._worker = _Worker(self, queue_size) if background else None
        if self._worker is not None:
            atexit.register(_flush_at_exit, weakref.ref(self))
            weakref.finalize(self, _wake_dropped, self._worker).atexit = False  # at exit _flush_at_exit stops it

    @property
    def idle(self) -> threading.Event:
        """Set while no request of any engine of this process holds :meth:`busy`."""
        return _GATE.idle

    def busy(self) -> AbstractContextManager[None]:
        """Held by a request while it computes: no background worker of this process starts a later
        stage (levels) meanwhile, as the cores are shared (encoding levels beside a prefill on 2
        cores slowed it by 10-40 %); first stages (the raw form, what the next request needs) are
        never held back."""
        return _GATE.busy()

    @property
    def stages(self) -> list[list[Option]]:
        """The options written together, in order: the raw forms, then the levels (empty stages left out)."""
        stages = [[o for o in self.options if o in RAW_OPTIONS], [o for o in self.options if o not in RAW_OPTIONS]]
        return [st for st in stages if st]

    def encode(self, kv: KVCache, option: Option) -> bytes:
        return self.raw.encode(kv, option) if option in RAW_OPTIONS else self.codec.encode(kv, option)  # type: ignore[arg-type]

    def write(self, chunk: Chunk, kv: KVCache, stage: int | None = None, before: Manifest | None = None,
              blobs: dict[Option, bytes] | None = None) -> Manifest:  # fmt: skip
        """Store ``kv`` (the chunk's tokens) in every option (or those of one ``stage``, adding to the
        manifest ``before``; ``blobs``: that stage already encoded); raises ``StoreError``/``CacheGenError``."""
        options = self.options if stage is None else self.stages[stage]
        blobs = blobs if blobs is not None else {o: self.encode(kv, o) for o in options}
        try:
            self.store.put_many([(blob_key(chunk.key, o), b) for o, b in blobs.items()])
            # Another writer (another engine configuration) may have stored other forms of this chunk:
            # keep what its manifest names, so that neither hides the other's blobs.
            sizes = {**self._stored(chunk), **(before.sizes if before is not None else {}), **{o: len(b) for o, b in blobs.items()}}
            manifest = Manifest(sizes)
            self.store.put(manifest_key(chunk.key), manifest.to_bytes())  # last: it vouches for every blob above
        except StoreError as e:
            self.health.failed(f"store write failed: {e}")
            raise
        self.health.recovered("writable")
        return manifest

    def _stored(self, chunk: Chunk) -> dict[Option, int]:
        """The options the chunk's manifest in the store names now ({} when none, or unreadable)."""
        raw = self.store.get(manifest_key(chunk.key))
        try:
            return dict(Manifest.from_bytes(raw).sizes) if raw is not None else {}
        except CacheGenFormatError:
            return {}

    def submit(self, chunk: Chunk, kv: KVCache) -> bool:
        """Queue the chunk for the worker (False: the queue is full, dropped), or write it now without one.
        On a local store its first stage is ready before this returns: written (a store that holds the very
        objects, or ``first_stage_now=True``), else encoded into :attr:`hot`, where this engine's reader finds
        it until the worker has stored it (``hot.py``). Raises what ``write`` raises."""
        if self._worker is None:
            self.write(chunk, kv)
            return True
        stages = self.stages
        cheap = all(o in RAW_OPTIONS for o in stages[0])  # a conversion and a checksum, no entropy coding
        now = self.first_stage_now if self.first_stage_now is not None else cheap and getattr(self.store, "local", False)
        if not now:
            return self._worker.submit(chunk, kv, 0, None)
        if self.first_stage_now is None and not getattr(self.store, "shares_values", False):
            return self._write_behind(chunk, kv, stages[0])
        manifest = self.write(chunk, kv, 0)
        if len(stages) == 1:
            self._worker.written += 1
            return True
        return self._worker.submit(chunk, kv, 1, manifest)

    def _write_behind(self, chunk: Chunk, kv: KVCache, options: list[Option]) -> bool:
        assert self._worker is not None
        blobs = {o: self.encode(kv, o) for o in options}
        manifest = Manifest({**self._stored(chunk), **{o: len(b) for o, b in blobs.items()}})
        self.hot.put(chunk.key, {**{blob_key(chunk.key, o): b for o, b in blobs.items()}, manifest_key(chunk.key): manifest.to_bytes()})
        if not self._worker.submit(chunk, kv, 0, None, blobs):
            self.hot.discard(chunk.key)
            return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk is written (or failed); False if ``timeout`` passed first."""
        return True if self._worker is None else self._worker.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued (up to ``timeout``), then stop the worker thread; chunks submitted later are
        written in ``submit``. False if chunks were still queued at the timeout (they are not written)."""
        worker, self._worker = self._worker, None
        if worker is None:
            return True
        done = worker.flush(timeout)
        worker.stop(timeout=60)
        return done

    @property
    def stats(self) -> dict[str, int]:
        """Chunks written, failed and dropped (queue full) by the worker, and still queued ({} without one)."""
        w = self._worker
        return {"written": w.written, "failed": w.failed, "dropped": w.dropped, "queued": w.queue.qsize()} if w else {}

    @property
    def pending(self) -> int:
        return 0 if self._worker is None else self._worker.queue.unfinished_tasks


class _Worker:
    """A daemon thread writing queued chunks, first stages first; holds its writer weakly, so a dropped
    writer is reported. It runs at the lowest CPU priority (Linux: nice +19, inherited by the native
    coder's and OpenMP's threads it starts): at +10 it still slowed the requests' prefill beside it
    by 10-40 % on 2 cores (``benchmarks.warm_path`` miss-path rows). Its torch thread count is left
    alone: ``torch.set_num_threads`` would also set the default of threads started later."""

    def __init__(self, writer: ChunkWriter, maxsize: int) -> None:
        self._writer = weakref.proxy(writer)
        self._hot = writer.hot
        self.queue: queue.Queue[tuple[Chunk, KVCache, int, Manifest | None, dict[Option, bytes] | None] | None] = queue.Queue(maxsize=maxsize)
        self._later: deque[tuple[Chunk, KVCache, Manifest | None, int]] = deque()  # chunks with later stages to write
        self.dropped = self.failed = self.written = 0
        self._full = False  # dropping chunks since the queue last had room (logged once)
        self._stopping = False  # at exit: finish the write in hand, start no other
        self._thread = threading.Thread(target=self._run, name="cachegen-store", daemon=True)
        self._thread.start()

    def submit(self, chunk: Chunk, kv: KVCache, stage: int, manifest: Manifest | None, blobs: dict[Option, bytes] | None = None) -> bool:
        """Queue stages ``stage`` on of a chunk (``manifest``: what earlier stages wrote; ``blobs``: the first stage, encoded)."""
        try:
            self.queue.put_nowait((chunk, kv, stage, manifest, blobs))
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
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        while not self._stopping:
            try:  # a new chunk's first stage before any chunk's later stages, which wait for no request to run
                if not self._later:
                    item = self.queue.get()
                elif self._writer.idle.is_set():
                    item = self.queue.get_nowait()
                else:
                    item = self.queue.get(timeout=0.05)
            except queue.Empty:
                if self._writer.idle.is_set():
                    self._later_stage()
                continue
            except ReferenceError:
                return self._dropped_writer()
            try:
                if item is None:
                    return
                chunk, kv, stage, manifest, blobs = item
                if stage == 0:
                    self._write(chunk, kv, self._writer.stages, blobs)
                else:  # a later stage waits for every new chunk's first stage
                    with self.queue.mutex:
                        self.queue.unfinished_tasks += 1
                    self._later.append((chunk, kv, manifest, stage))
            except ReferenceError:
                return self._dropped_writer()
            finally:
                self.queue.task_done()

    def _write(self, chunk: Chunk, kv: KVCache, stages: list[list[Option]], blobs: dict[Option, bytes] | None = None) -> None:
        """The first stage now (``blobs``: encoded already, held in the hot tier until stored); the others queued
        (counted as written when the last is)."""
        try:
            manifest = self._writer.write(chunk, kv, 0, blobs=blobs)
            if len(stages) > 1:
                with self.queue.mutex:  # flush() waits for the later stages too
                    self.queue.unfinished_tasks += 1
                self._later.append((chunk, kv, manifest, 1))
            else:
                self.written += 1
        except ReferenceError:
            raise
        except StoreError:  # the writer logs a failing store once, not per chunk
            self.failed += 1
        except Exception as e:  # a failed write is reported, never raised into a request
            self.failed += 1
            log.warning("storing chunk failed: %s", e)
        finally:
            if blobs is not None:
                self._hot.discard(chunk.key)  # stored, or not to be: the store answers for it now

    def _later_stage(self) -> None:
        chunk, kv, manifest, first = self._later.popleft()
        try:
            for stage in range(first, len(self._writer.stages)):
                manifest = self._writer.write(chunk, kv, stage, before=manifest)
            self.written += 1
        except ReferenceError:
            self._dropped_writer()
        except StoreError:
            self.failed += 1
        except Exception as e:
            self.failed += 1
            log.warning("storing chunk failed: %s", e)
        finally:
            self.queue.task_done()

    def _dropped_writer(self) -> None:
        lost = 1 + self.queue.qsize() + len(self._later)
        log.warning("the KV engine's writer was garbage-collected with %d KV chunk(s) not stored "
                    "(call flush() first)", lost)  # fmt: skip

    def wake(self) -> None:
        """Unblock a worker waiting for work, so that it notices its writer is gone."""
        try:
            self.queue.put_nowait(None)
        except queue.Full:  # it is busy with the queue and will notice anyway
            pass

    def stop(self, timeout: float) -> None:
        """Start no other write and wait (up to ``timeout``) for the one in hand: native and torch code
        must not be running in this thread while the interpreter shuts down."""
        self._stopping = True
        self.wake()
        self._thread.join(timeout)

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


_ENDING: list[threading.Thread] = []  # threads of dropped writers, woken to end: joined before the interpreter goes


def _wake_dropped(worker: _Worker) -> None:
    """A dropped writer's thread reports what it could not write and ends."""
    worker.wake()
    _ENDING[:] = [t for t in _ENDING if t.is_alive()] + [worker._thread]


@atexit.register  # registered first, so it runs after every writer's _flush_at_exit
def _join_ending() -> None:
    """A thread still ending while the interpreter finalises aborted the process ("terminate called without an
    active exception", after an engine dropped just before exit): wait for them."""
    for t in _ENDING:
        t.join(timeout=10)


def _flush_at_exit(ref: Callable[[], ChunkWriter | None]) -> None:
    writer = ref()
    if writer is None or writer._worker is None:
        return
    if writer.pending and not writer.flush(timeout=60):
        log.warning("exiting with %d KV chunks not yet stored", writer.pending)
    writer._worker.stop(timeout=60)
