"""Pinned host memory for KV on its way to or from a GPU: a slab allocator, as LMCache keeps its CPU KV.

A copy between a GPU and host memory that is not pinned goes through a driver bounce buffer at a
fraction of the link's rate (6.7 against 54.7 GB/s measured on an H200 host, ``docs/history/``), and
``torch.empty(pin_memory=True)`` costs a ``cudaHostAlloc`` per call (tens of milliseconds for a 7B
chunk). So blobs that cross the link (a memory store's values, the engine's hot tier, the read buffers
of the disk and Redis stores, a chunk stored from a GPU) live in :class:`HostArena` blocks: slabs of
pinned memory, pinned once and carved up by a first-fit free list in address order whose free blocks
merge with their free neighbours (no fragmentation grows from freeing in any order).

A block is a 1-D uint8 numpy array (:class:`HostBlock`); it goes back to the free list once nothing
refers to it, or to a view of it (numpy views and memoryviews keep it alive), and once every CUDA event
recorded against it (:func:`hold_until`: a copy out of it or into it still running) has completed.
When the arena is full ``alloc`` returns None and the caller uses plain memory: slower, never wrong.

Only where torch sees a CUDA device (:func:`host_arena`): CPU-only torch cannot pin, and there nothing
crosses a link, so the CPU path never allocates here. Tests inject the memory (``allocate=``).
``CACHEGEN_PINNED_BYTES`` bounds the process's arena (``16G``, ``512M``; ``0`` turns it off).
"""

from __future__ import annotations

import bisect
import collections
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

GiB = 1 << 30
#: Bytes pinned at a time (one ``cudaHostAlloc``); a bigger block gets a slab of its own size.
SLAB_BYTES = GiB
#: Block starts and sizes are multiples of this (DMA likes whole pages).
ALIGN = 4096
#: The process arena's bound unless ``CACHEGEN_PINNED_BYTES`` says otherwise: a quarter of RAM, at most this.
DEFAULT_LIMIT = 16 * GiB


class HostBlock(np.ndarray):
    """A block of a :class:`HostArena`: uint8, 1-D; freed when it and every view of it are gone."""

    _cg_events: list[Any]  # only on a block's root array (views are HostBlock arrays too)


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _Slab:
    """One pinned tensor and its free blocks (start -> size, starts kept sorted)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.array = tensor.numpy()
        self.size = tensor.numel()
        self.address = self.array.__array_interface__["data"][0]
        self.starts = [0]
        self.free = {0: self.size}

    def take(self, need: int) -> int | None:
        """The start of a free run of ``need`` bytes (the lowest one), now in use; None when none is that long."""
        for start in self.starts:
            size = self.free[start]
            if size >= need:
                del self.free[start]
                self.starts.remove(start)
                if size > need:
                    self.free[start + need] = size - need
                    bisect.insort(self.starts, start + need)
                return start
        return None

    def give(self, start: int, size: int) -> None:
        """Return ``[start, start + size)`` to the free list, merged with free neighbours."""
        i = bisect.bisect_left(self.starts, start)
        if i < len(self.starts) and self.starts[i] == start + size:  # the next run is free: one run
            size += self.free.pop(self.starts.pop(i))
        if i > 0 and (prev := self.starts[i - 1]) + self.free[prev] == start:  # so is the one before
            self.free[prev] += size
            return
        self.starts.insert(i, start)
        self.free[start] = size

    @property
    def free_bytes(self) -> int:
        return sum(self.free.values())


class HostArena:
    """Pinned host memory handed out in blocks (see the module doc); thread-safe.

    ``limit_bytes`` bounds the memory pinned (slabs of ``slab_bytes``, made on demand); ``allocate(n)``
    makes a slab's uint8 CPU tensor (default pinned: tests pass plain memory)."""

    def __init__(self, limit_bytes: int, *, slab_bytes: int = SLAB_BYTES, align: int = ALIGN,
                 allocate: Callable[[int], torch.Tensor] = _pinned) -> None:  # fmt: skip
        if limit_bytes < 0 or slab_bytes < 1 or align < 1 or align & (align - 1):
            raise ValueError("limit_bytes >= 0, slab_bytes >= 1 and align a power of two are required")
        self.limit_bytes, self.slab_bytes, self.align = limit_bytes, slab_bytes, align
        self._allocate = allocate
        self._slabs: list[_Slab] = []
        self._lock = threading.Lock()
        self._released: collections.deque[tuple[_Slab, int, int, list[Any]]] = collections.deque()  # from finalisers
        self._waiting: list[tuple[_Slab, int, int, list[Any]]] = []  # freed, an event still pending
        self.fallbacks = 0  # requests it could not serve (the caller used plain memory)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the slabs made so far."""
        return sum(s.size for s in self._slabs)

    @property
    def free_bytes(self) -> int:
        """Bytes free in the slabs made so far (blocks waiting for a copy to end not counted)."""
        with self._lock:
            self._reclaim(wait=False)
            return sum(s.free_bytes for s in self._slabs)

    def alloc(self, nbytes: int, *, reserve: int = 0) -> HostBlock | None:
        """A block of ``nbytes`` (uninitialised), or None when the arena cannot hold it (use plain memory then).
        ``reserve``: None as well unless that many bytes of the limit stay free after it (for a holder of many
        blocks, the memory store, to leave room for the copies in flight)."""
        need = max(self.align, -(-nbytes // self.align) * self.align)
        if reserve and self.limit_bytes - self.pinned_bytes + self.free_bytes - need < reserve:
            with self._lock:
                self.fallbacks += 1
            return None
        with self._lock:
            found = self._take(need)
            if found is None and self._waiting:  # a block a copy still reads: wait for it rather than fall back
                self._reclaim(wait=True)
                found = self._take(need)
            if found is None:
                found = self._grow(need)
            if found is None:
                self.fallbacks += 1
                return None
        slab, start = found
        block = slab.array[start : start + nbytes].view(HostBlock)
        block._cg_events = events = []
        weakref.finalize(block, self._released.append, (slab, start, need, events))
        return block

    def _take(self, need: int) -> tuple[_Slab, int] | None:
        self._reclaim(wait=False)
        for slab in self._slabs:
            start = slab.take(need)
            if start is not None:
                return slab, start
        return None

    def _grow(self, need: int) -> tuple[_Slab, int] | None:
        size = max(need, min(self.slab_bytes, self.limit_bytes))
        if self.pinned_bytes + size > self.limit_bytes:
            return None
        try:
            tensor = self._allocate(size)
        except (RuntimeError, MemoryError):  # the driver would not pin more: this is the limit
            self.limit_bytes = self.pinned_bytes
            return None
        slab = _Slab(tensor)
        self._slabs.append(slab)
        start = slab.take(need)
        return (slab, start) if start is not None else None

    def _reclaim(self, wait: bool) -> None:
        """Free the released blocks whose copies are done (``wait``: wait for every one)."""
        while self._released:
            self._waiting.append(self._released.popleft())
        still = []
        for slab, start, size, events in self._waiting:
            if wait:
                for e in events:
                    e.synchronize()
            if all(e.query() for e in events):
                slab.give(start, size)
            else:
                still.append((slab, start, size, events))
        self._waiting = still

    def tensor(self, buf: Any) -> torch.Tensor | None:
        """The uint8 tensor over ``buf``'s bytes (a block, a view of one, a memoryview of either) when they lie in one
        of this arena's slabs, else None: a copy from it to a GPU is then a DMA from pinned memory."""
        try:
            a = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError):
            return None
        at = a.__array_interface__["data"][0]
        for slab in self._slabs:
            if slab.address <= at and at + a.size <= slab.address + slab.size:
                return slab.tensor[at - slab.address : at - slab.address + a.size]
        return None


def root_block(buf: Any) -> HostBlock | None:
    """The block ``buf`` (a block, a numpy view or a memoryview of one) is part of, or None."""
    seen = 0
    while buf is not None and seen < 32:
        if isinstance(buf, HostBlock) and "_cg_events" in buf.__dict__:
            return buf
        buf = buf.obj if isinstance(buf, memoryview) else getattr(buf, "base", None)
        seen += 1
    return None


def hold_until(buf: Any, event: Any) -> None:
    """Keep ``buf``'s block (if it is in one) from being reused before ``event`` (a CUDA event: ``query``,
    ``synchronize``) completes: a copy into or out of it was queued on a stream."""
    root = root_block(buf)
    if root is not None:
        root._cg_events[:] = [e for e in root._cg_events if not e.query()] + [event]


def settle(buf: Any) -> None:
    """Wait for every copy :func:`hold_until` recorded against ``buf``'s block (before writing into it again)."""
    root = root_block(buf)
    if root is not None:
        for e in root._cg_events:
            e.synchronize()
        root._cg_events.clear()


def parse_bytes(text: str) -> int:
    """``16G``, ``512M``, ``64K`` or a plain number of bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": GiB, "T": 1 << 40}.get(t[-1:], 1)
    return int(float(t[:-1] if scale > 1 else t) * scale)


def default_limit() -> int:
    """``CACHEGEN_PINNED_BYTES``, else a quarter of this machine's memory, at most :data:`DEFAULT_LIMIT`."""
    value = os.environ.get("CACHEGEN_PINNED_BYTES", "").strip()
    if value:
        try:
            return max(0, parse_bytes(value))
        except ValueError:
            raise ValueError(f"CACHEGEN_PINNED_BYTES={value!r} is not a size (e.g. 16G, 512M, 0)") from None
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 4 * DEFAULT_LIMIT
    return min(DEFAULT_LIMIT, ram // 4)


_arena: HostArena | None = None
_arena_lock = threading.Lock()


def host_arena() -> HostArena | None:
    """The process's arena of pinned memory, where torch sees a CUDA device and the limit is not 0; else None."""
    global _arena
    if _arena is None and torch.cuda.is_available():
        with _arena_lock:
            if _arena is None and (limit := default_limit()) > 0:
                _arena = HostArena(limit)
    return _arena


def pinned_tensor(buf: Any) -> torch.Tensor | None:
    """``buf``'s bytes as a tensor in the process's pinned arena (:meth:`HostArena.tensor`), or None."""
    arena = _arena
    return arena.tensor(buf) if arena is not None else None


#: Copies from this size on are split between threads (``parallel_copy``).
PARALLEL_COPY_BYTES = 8 << 20
_copy_pool: tuple[int, Any] | None = None  # (pid, pool)


def parallel_copy(dst: np.ndarray, src: np.ndarray, *, threads: int | None = None) -> None:
    """``dst[:] = src`` (1-D uint8, equal sizes), split between up to ``threads`` threads past
    :data:`PARALLEL_COPY_BYTES` (numpy releases the GIL while it copies): one core copies a 7B chunk's
    200 MB into pinned memory at a fraction of what the memory system moves."""
    global _copy_pool
    n = src.size
    if dst.size != n:
        raise ValueError(f"cannot copy {n} bytes into {dst.size}")
    workers = min(threads or os.cpu_count() or 1, 8, max(1, n // PARALLEL_COPY_BYTES))
    if workers < 2:
        dst[:] = src
        return
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    with _arena_lock:
        if _copy_pool is None or _copy_pool[0] != os.getpid():  # a forked child has the pool but not its threads
            _copy_pool = (os.getpid(), ThreadPoolExecutor(max_workers=8, thread_name_prefix="cachegen-copy"))
        pool = _copy_pool[1]
    bounds = [n * i // workers // ALIGN * ALIGN for i in range(workers)] + [n]

    def part(i: int) -> None:
        dst[bounds[i] : bounds[i + 1]] = src[bounds[i] : bounds[i + 1]]

    futures = [pool.submit(part, i) for i in range(1, workers)]
    part(0)
    for f in futures:
        f.result()
