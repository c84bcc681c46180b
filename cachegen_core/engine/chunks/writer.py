"""ChunkWriter: encode a chunk's KV in every stored form and put it in the store, then its manifest.

It owns what writing needs and nothing of the engine: the codecs, the store, the options
kept, an optional background worker (``worker.py``: a daemon thread with a bounded queue, so storing is
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
partially written chunk. A partial chunk that a longer one superseded loses its raw forms
(:meth:`ChunkWriter.supersede`), its manifest rewritten before they are deleted. A partial chunk's pointers
(``keys/pointers.py``: from its shorter prefixes' keys) are written after its first manifest.

From a GPU (``stage_raw``) a request waits for nothing: ``submit`` queues the copy of each raw form's payloads
to pinned memory, asynchronously, straight where they will sit in the blob (``RawCodec.stage``), and
returns; the worker finishes those blobs (the copy waited for, hashed, framed) and writes them before any
level, then encodes the levels on the CPU from that same host copy.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from ...keys.chunks import Chunk, blob_key
from ...codec.kvcodec import KVCodec
from ...errors import CacheGenFormatError, StoreError
from ...kv import KVCache, copy_pending, host_ready, to_host
from ...keys.manifest import RAW_OPTIONS, Manifest, Option, manifest_key
from ...keys.pointers import pointers
from ...codec.raw import RawCodec, Staged
from ...pinned import HostArena, host_arena
from ...stores.base import KVStore
from ...streaming import rank
from ..serving.turns import TURNS, Turns
from .hot import HotTier
from .worker import DropRaw, Worker, wake_dropped

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
    """Writes chunks (every option of ``options``: levels of ``codec``, raw forms of ``raw``) into ``store``.

    ``background``: queue chunks for a worker thread (``submit`` returns at once, after the
    first stage on a local store; ``flush`` waits) instead of writing them in ``submit``.
    ``queue_size`` bounds the queue: when it is full a chunk is dropped (counted in
    ``stats``, logged once). ``first_stage_now``: write the first stage in ``submit``
    (default: when the store is local). ``stage_raw``: stage the raw forms for the worker instead (see the
    module doc; default: for a chunk on a GPU), in blocks of ``arena`` (default the process's pinned one).
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
        stage_raw: bool | None = None,
        arena: HostArena | None = None,
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
        self.stage_raw, self.arena = stage_raw, arena
        self.hot = HotTier()  # first stages encoded but not yet stored (see ``submit``)
        self._worker = Worker(self, queue_size) if background else None
        if self._worker is not None:
            atexit.register(_flush_at_exit, weakref.ref(self))
            weakref.finalize(self, wake_dropped, self._worker).atexit = False  # at exit _flush_at_exit stops it

    @property
    def turns(self) -> Turns:
        """The process's turns between requests and background work (``serving/turns.py``)."""
        return TURNS

    @property
    def idle(self) -> threading.Event:
        """Set while no request of any engine of this process holds :meth:`busy`."""
        return TURNS.idle

    def busy(self) -> AbstractContextManager[None]:
        """Held by a request while it computes: no background worker of this process starts a later
        stage (levels) meanwhile, as the cores are shared (encoding levels beside a prefill on 2
        cores slowed it by 10-40 %); first stages (the raw form, what the next request needs) are
        never held back. Under continuous load the schedulers lend the later stages a share of the time
        (``Turns.lend``)."""
        return TURNS.busy()

    @property
    def stages(self) -> list[list[Option]]:
        """The options written together, in order: the raw forms, then the levels (empty stages left out)."""
        stages = [[o for o in self.options if o in RAW_OPTIONS], [o for o in self.options if o not in RAW_OPTIONS]]
        return [st for st in stages if st]

    def encode(self, chunk: Chunk, kv: KVCache, option: Option) -> bytes:
        """``kv`` (the chunk's) in ``option``; a level codes its keys before the rotary embedding of the chunk's positions."""
        host_ready(kv)  # a chunk submitted from a GPU: its copy to the host is done
        if option in RAW_OPTIONS:
            return self.raw.encode(kv, option)  # type: ignore[arg-type]
        return self.codec.encode(kv, option, start=chunk.position)  # type: ignore[arg-type]

    def write(self, chunk: Chunk, kv: KVCache, stage: int | None = None, before: Manifest | None = None,
              blobs: dict[Option, bytes] | None = None) -> Manifest:  # fmt: skip
        """Store ``kv`` (the chunk's tokens) in every option (or those of one ``stage``, adding to the
        manifest ``before``; ``blobs``: that stage already encoded); raises ``StoreError``/``CacheGenError``."""
        options = self.options if stage is None else self.stages[stage]
        kv = to_host(kv)  # (from a GPU: ``store_kv``; the worker's chunks are on the host already)
        if blobs is not None and any(isinstance(b, Staged) for b in blobs.values()):
            blobs = self._finish(chunk, blobs)
        blobs = blobs if blobs is not None else {o: self.encode(chunk, kv, o) for o in options}
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
        if stage in (None, 0):
            self.point(chunk)
        return manifest

    def point(self, chunk: Chunk) -> None:
        """Store the pointers to a partial chunk from its shorter prefixes (``keys/pointers.py``; none for another
        chunk), once its manifest is there. A failure is logged (once while the store fails), never raised: the chunk
        itself is stored, and its later stages still are."""
        if entries := pointers(chunk):
            try:
                self.store.put_many(entries)
            except StoreError as e:
                self.health.failed(f"store write failed (pointers to a partial chunk): {e}")

    def _stored(self, chunk: Chunk) -> dict[Option, int]:
        """The options the chunk's manifest in the store names now ({} when none, or unreadable)."""
        raw = self.store.get(manifest_key(chunk.key))
        try:
            return dict(Manifest.from_bytes(raw).sizes) if raw is not None else {}
        except CacheGenFormatError:
            return {}

    def supersede(self, chunk: Chunk, floor: Option) -> None:
        """``chunk`` (a partial chunk) was extended by a longer one just submitted: once what was submitted
        before is written, keep only its levels (:meth:`drop_raw`). Raises what ``drop_raw`` raises without a worker."""
        if self._worker is None:
            self.drop_raw(chunk, floor)
        else:
            self._worker.submit_drop(DropRaw(chunk, floor))

    def drop_raw(self, chunk: Chunk, floor: Option) -> bool:
        """Delete the raw forms of a chunk that holds a level at least as fine as ``floor`` (else change nothing
        and return False): it stays reusable, at a level's size and decode time. Its manifest is rewritten first,
        so a reader never asks for a deleted blob (one that read the old manifest just before gets a plain miss).
        The raw form of a partial chunk is the next turn's fast path, useless once a longer one extends it; kept,
        it was ~3/4 of a chat's stored bytes (``docs/history/``). Pointers to it (``keys/pointers.py``) stay good: they
        lead to its levels. A prefix a request took from a longer chunk through a pointer has no manifest of its own
        (the longer chunk was not extended: the prompt branched off it), so nothing is dropped."""
        sizes = self._stored(chunk)
        levels = {o: n for o, n in sizes.items() if o not in RAW_OPTIONS}
        if len(levels) == len(sizes) or not any(rank(o) <= rank(floor) for o in levels):
            return False
        try:
            self.store.put(manifest_key(chunk.key), Manifest(levels).to_bytes())
            self.store.delete_many([blob_key(chunk.key, o) for o in sizes if o in RAW_OPTIONS])
        except StoreError as e:
            self.health.failed(f"store write failed: {e}")
            raise
        return True

    def submit(self, chunk: Chunk, kv: KVCache) -> bool:
        """Queue the chunk for the worker (False: the queue is full, dropped), or write it now without one.
        On a local store its first stage is ready before this returns: written (a store that holds the very
        objects, or ``first_stage_now=True``), else encoded into :attr:`hot`, where this engine's reader finds
        it until the worker has stored it (``hot.py``). Raises what ``write`` raises. KV on a GPU is copied to pinned
        host memory first, asynchronously: its raw forms staged for the worker (``stage_raw``), else by ``kv.to_host``;
        encoded on the CPU, off the device and the request's path."""
        stages = self.stages
        cheap = all(o in RAW_OPTIONS for o in stages[0])  # a conversion and a checksum, no entropy coding
        if self._worker is not None and cheap and self.first_stage_now is None and sys.byteorder == "little" and (
                self.stage_raw if self.stage_raw is not None else kv.keys.is_cuda):  # fmt: skip
            return self._stage(chunk, kv, stages[0])
        kv = to_host(kv)
        if self._worker is None:
            self.write(chunk, kv)
            return True
        now = self.first_stage_now if self.first_stage_now is not None else cheap and getattr(self.store, "local", False)
        if not now:
            return self._worker.submit(chunk, kv, 0, None)
        if self.first_stage_now is None and not getattr(self.store, "shares_values", False):
            return self._write_behind(chunk, kv, stages[0])
        manifest = self.write(chunk, kv, 0)
        if len(stages) == 1:
            self._worker.count("written")
            return True
        return self._worker.submit(chunk, kv, 1, manifest)

    def _stage(self, chunk: Chunk, kv: KVCache, options: list[Option]) -> bool:
        """Queue the chunk with its raw forms' payloads being copied into host blocks (``RawCodec.stage``); the levels
        are encoded from the copy whose dtype is the chunk's own (else from ``to_host``'s)."""
        assert self._worker is not None
        arena = self.arena or host_arena()
        staged = {o: self.raw.stage(kv, o, arena.alloc if arena is not None else None) for o in options}
        own = next((s for s in staged.values() if s.kv.dtype == kv.dtype), None)
        host = copy_pending(own.kv, own.event) if own is not None else to_host(kv)
        return self._worker.submit(chunk, host, 0, None, staged)  # type: ignore[arg-type]

    def _finish(self, chunk: Chunk, staged: dict[Option, bytes | Staged]) -> dict[Option, bytes]:
        """Staged raw forms made blobs (the worker's first stage); on a local store that does not hold the very
        objects, also put in :attr:`hot` until stored (the worker discards them then)."""
        blobs = {o: b.finish() if isinstance(b, Staged) else b for o, b in staged.items()}
        if getattr(self.store, "local", False) and not getattr(self.store, "shares_values", False):
            manifest = Manifest({**self._stored(chunk), **{o: len(b) for o, b in blobs.items()}})
            self.hot.put(chunk.key, {**{blob_key(chunk.key, o): b for o, b in blobs.items()}, manifest_key(chunk.key): manifest.to_bytes()})
            self.hot.put(chunk.key, dict(pointers(chunk)))  # after its manifest, as in the store
        return blobs  # type: ignore[return-value]

    def _write_behind(self, chunk: Chunk, kv: KVCache, options: list[Option]) -> bool:
        assert self._worker is not None
        blobs = {o: self.encode(chunk, kv, o) for o in options}
        manifest = Manifest({**self._stored(chunk), **{o: len(b) for o, b in blobs.items()}})
        self.hot.put(chunk.key, {**{blob_key(chunk.key, o): b for o, b in blobs.items()}, manifest_key(chunk.key): manifest.to_bytes()})
        self.hot.put(chunk.key, dict(pointers(chunk)))  # after its manifest, as in the store
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


def _flush_at_exit(ref: Callable[[], ChunkWriter | None]) -> None:
    writer = ref()
    if writer is None or writer._worker is None:
        return
    if writer.pending and not writer.flush(timeout=60):
        log.warning("exiting with %d KV chunks not yet stored", writer.pending)
    writer._worker.stop(timeout=60)
