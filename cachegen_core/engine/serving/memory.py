"""The bound on the KV memory of running requests, and the queue of those waiting for room.

Every request's own KV buffer is counted against :class:`KVMemory` (``limit`` bytes: the engine's ``kv_memory``, by
default a share of the device's memory, :func:`default_limit`) before it is allocated, and given back when the last
request reading it lets go (a shared prefix is counted once). A request that does not fit waits, first come first
served, in a queue of at most ``queue`` requests; past it, or when it could never fit, it fails at once with
:class:`EngineBusy` or :class:`TooLarge`, never an out-of-memory crash.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

from ...errors import EngineBusy, TooLarge

#: The share of the device's memory the KV of running requests may take by default: of the RAM on the CPU (the model
#: and the process take the rest), of the GPU's memory left free once the model is loaded.
CPU_SHARE, GPU_SHARE = 0.4, 0.8
#: Requests that may wait for memory by default.
DEFAULT_QUEUE = 64


def default_limit(device: torch.device | str) -> int:
    """Bytes the KV of running requests may take on ``device`` by default (see :data:`CPU_SHARE`)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_SHARE)
    try:
        import os  # noqa: PLC0415

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return int(total * CPU_SHARE)


class Grant:
    """Bytes of KV memory held by one buffer; :meth:`free` gives them back (once)."""

    def __init__(self, memory: KVMemory, nbytes: int) -> None:
        self.memory, self.nbytes, self._freed = memory, nbytes, False

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            self.memory._free(self.nbytes)


class KVMemory:
    """Counts the KV memory of running requests against ``limit`` bytes; at most ``queue`` requests wait (see the
    module doc). ``make_room``: called before a request waits (the engine frees its spare buffers)."""

    def __init__(self, limit: int, queue: int = DEFAULT_QUEUE, make_room: Any = None) -> None:
        if limit < 1 or queue < 0:
            raise ValueError("the KV memory limit must be positive and the queue non-negative")
        self.limit, self.queue_limit, self.make_room = int(limit), int(queue), make_room
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()
        self._waiting: deque[object] = deque()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def admit(self, nbytes: int, cancel: threading.Event | None = None) -> Grant | None:
        """Hold ``nbytes`` once they fit (first come, first served); None when ``cancel`` was set while waiting. Raises
        :class:`TooLarge` (it never fits) or :class:`EngineBusy` (the queue is full)."""
        if nbytes > self.limit:
            raise TooLarge(f"this request's KV needs {nbytes / 2**20:.1f} MiB and the engine's KV memory is "
                           f"{self.limit / 2**20:.1f} MiB (kv_memory): shorten the prompt or max_tokens, or raise kv_memory")  # fmt: skip
        with self._cond:
            if not self._waiting and self.used + nbytes <= self.limit:
                return self._take(nbytes)
            if len(self._waiting) >= self.queue_limit:
                raise EngineBusy(f"{len(self._waiting)} requests are already waiting for KV memory (kv_queue={self.queue_limit}): "
                                 "try again later, or raise kv_queue or kv_memory")  # fmt: skip
            ticket = object()
            self._waiting.append(ticket)
        if self.make_room is not None:
            self.make_room()
        with self._cond:
            try:
                while not (self._waiting[0] is ticket and self.used + nbytes <= self.limit):
                    if cancel is not None and cancel.is_set():
                        return None
                    self._cond.wait(timeout=0.1)
                return self._take(nbytes)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()

    def _take(self, nbytes: int) -> Grant:
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return Grant(self, nbytes)

    def _free(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()
