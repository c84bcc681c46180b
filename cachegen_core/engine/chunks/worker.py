"""The background worker of a ``ChunkWriter`` (``writer.py``): a daemon thread storing queued chunks.

A chunk's first stage (its raw forms: what the next request needs) goes before any chunk's later
stages (its levels), and later stages wait until no request of this process is computing (the
writer's ``idle``). Dropping a superseded partial chunk's raw forms (:class:`DropRaw`) is queued
in order with the later stages, so it runs after that chunk's own levels are stored. The thread
holds its writer weakly: a writer dropped with chunks queued is reported, and its thread is woken
to end and joined at exit.
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
from dataclasses import dataclass
from typing import Protocol

from ... import openmp
from ...keys.chunks import Chunk
from ...errors import StoreError
from ...kv import KVCache
from ...keys.manifest import Manifest, Option
from ..serving.turns import Turns
from .hot import HotTier

log = logging.getLogger("cachegen_core.engine")


class Writes(Protocol):
    """What the worker needs of its writer (``ChunkWriter``)."""

    hot: HotTier

    @property
    def turns(self) -> Turns: ...

    @property
    def stages(self) -> list[list[Option]]: ...

    def write(self, chunk: Chunk, kv: KVCache, stage: int | None = None, before: Manifest | None = None,
              blobs: dict[Option, bytes] | None = None) -> Manifest: ...  # fmt: skip

    def drop_raw(self, chunk: Chunk, floor: Option) -> bool: ...


class Worker:
    """A daemon thread writing queued chunks, first stages first; holds its writer weakly, so a dropped
    writer is reported. It runs at the lowest CPU priority (Linux: nice +19, inherited by the native
    coder's and OpenMP's threads it starts): at +10 it still slowed the requests' prefill beside it
    by 10-40 % on 2 cores (``benchmarks.warm_path`` miss-path rows). Its torch thread count is left
    alone: ``torch.set_num_threads`` would also set the default of threads started later."""

    def __init__(self, writer: Writes, maxsize: int) -> None:
        self._writer = weakref.proxy(writer)
        self._hot = writer.hot
        self._turns = writer.turns
        self.queue: queue.Queue[tuple[Chunk, KVCache, int, Manifest | None, dict[Option, bytes] | None] | DropRaw | None] = queue.Queue(
            maxsize=maxsize
        )
        self._later: deque[tuple[Chunk, KVCache, Manifest | None, int] | DropRaw] = deque()  # later stages to write, in order
        self.dropped = self.failed = self.written = 0  # counted by count(): request threads count too
        self._counting = threading.Lock()
        self._full = False  # dropping chunks since the queue last had room (logged once)
        self._stopping = False  # at exit: finish the write in hand, start no other
        self._thread = threading.Thread(target=self._run, name="cachegen-store", daemon=True)
        self._thread.start()

    def count(self, what: str) -> None:
        """Add one chunk ``written``, ``failed`` or ``dropped`` (``+=`` alone loses updates between threads)."""
        with self._counting:
            setattr(self, what, getattr(self, what) + 1)

    def submit(self, chunk: Chunk, kv: KVCache, stage: int, manifest: Manifest | None, blobs: dict[Option, bytes] | None = None) -> bool:
        """Queue stages ``stage`` on of a chunk (``manifest``: what earlier stages wrote; ``blobs``: the first stage, encoded)."""
        try:
            self.queue.put_nowait((chunk, kv, stage, manifest, blobs))
            self._full = False
            return True
        except queue.Full:
            self.count("dropped")
            if not self._full:  # once per overload, not per dropped chunk
                log.warning("store queue full (%d chunks): chunk %s not stored (further drops counted in "
                            "store_stats, not logged, until it drains)", self.queue.maxsize, chunk.key[:12])  # fmt: skip
            self._full = True
            return False

    def submit_drop(self, item: DropRaw) -> None:
        """Queue dropping a chunk's raw forms, after the stages queued before it (skipped when the queue is full)."""
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            pass

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        while not self._stopping:
            if self.queue.empty():  # idle, or waiting for a turn: its OpenMP threads would slow the requests' steps
                openmp.release()
            try:  # a new chunk's first stage before any chunk's later stages, which wait for a turn (no request runs)
                if not self._later:
                    item = self.queue.get()
                elif self._turns.may_run():
                    item = self.queue.get_nowait()
                else:
                    item = self.queue.get(timeout=0.05)
            except queue.Empty:
                with self._turns.turn(timeout=0.05) as ok:  # waiting for it: a scheduler lends one under load
                    if ok:
                        self._later_stage()
                continue
            except ReferenceError:
                return self._dropped_writer()
            try:
                if item is None:
                    return
                if isinstance(item, DropRaw):  # in order with later stages: after the chunk's own levels
                    with self.queue.mutex:
                        self.queue.unfinished_tasks += 1
                    self._later.append(item)
                    continue
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
                self.count("written")
        except ReferenceError:
            raise
        except StoreError:  # the writer logs a failing store once, not per chunk
            self.count("failed")
        except Exception as e:  # noqa: BLE001  a failed write is reported, never raised into a request
            self.count("failed")
            log.warning("storing chunk failed: %s", e)
        finally:
            if blobs is not None:
                self._hot.discard(chunk.key)  # stored, or not to be: the store answers for it now

    def _later_stage(self) -> None:
        entry = self._later.popleft()
        try:
            if isinstance(entry, DropRaw):
                self._writer.drop_raw(entry.chunk, entry.floor)
                return
            chunk, kv, manifest, first = entry
            for stage in range(first, len(self._writer.stages)):
                manifest = self._writer.write(chunk, kv, stage, before=manifest)
            self.count("written")
        except ReferenceError:
            self._dropped_writer()
        except StoreError:
            self.count("failed")
        except Exception as e:  # noqa: BLE001
            self.count("failed")
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


@dataclass(frozen=True)
class DropRaw:
    """A queued :meth:`ChunkWriter.drop_raw`."""

    chunk: Chunk
    floor: Option


_ENDING: list[threading.Thread] = []  # threads of dropped writers, woken to end: joined before the interpreter goes


def wake_dropped(worker: Worker) -> None:
    """A dropped writer's thread reports what it could not write and ends."""
    worker.wake()
    _ENDING[:] = [t for t in _ENDING if t.is_alive()] + [worker._thread]


@atexit.register  # registered first, so it runs after every writer's _flush_at_exit
def _join_ending() -> None:
    """A thread still ending while the interpreter finalises aborted the process ("terminate called without an
    active exception", after an engine dropped just before exit): wait for them."""
    for t in _ENDING:
        t.join(timeout=10)
