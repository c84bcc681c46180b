"""A queue of background jobs run one at a time, giving way to requests: what the cost probes and the document caches
are computed with.

:class:`JobQueue` runs each job it is given (``run(job)``) in order, on a daemon thread started when there is work
and ending when there is none, inside ``yielding.active()`` (``yielding.py``: paused before each torch op while a
request computes), so that it costs no thread while idle. A queue built with ``background=False`` runs nothing by
itself: :meth:`JobQueue.drain` runs the queued jobs on the caller's thread (an engine without background threads runs
them when a request has answered, deterministic for scripts and tests). Stopped (or at the interpreter's exit) it
runs no other job; the one running stops at its next op (:class:`~.yielding.Stopped`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from .yielding import Stopped, Yielding, stop_at_exit

J = TypeVar("J")


class JobQueue(Generic[J]):
    """Jobs handed to ``run`` one at a time (see the module doc); ``name``: the thread's."""

    def __init__(self, run: Callable[[J], None], yielding: Yielding, *, name: str, background: bool = True) -> None:
        self._do, self.yielding, self.name, self.background = run, yielding, name, background
        self._jobs: deque[J] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        stop_at_exit(self)

    def submit(self, jobs: Iterable[J]) -> None:
        """Queue ``jobs`` (none once stopped); in the background, start the thread if none runs."""
        if self.yielding.stop.is_set():
            return
        with self._lock:
            self._jobs.extend(jobs)
            if self.background and self._jobs and self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def drain(self) -> None:
        """Run the queued jobs now, on this thread (a queue without a background thread; else nothing)."""
        if self.background:
            return
        while (job := self._pop()) is not None:
            self._do(job)

    def _pop(self) -> J | None:
        with self._lock:
            return self._jobs.popleft() if self._jobs else None

    def _run(self) -> None:
        try:
            with self.yielding.active():
                while not self.yielding.stop.is_set():
                    with self._lock:
                        if not self._jobs:
                            self._thread = None
                            return
                        job = self._jobs.popleft()
                    self._do(job)
        except (Stopped, ReferenceError):  # stopped, or the engine the jobs belong to is gone
            pass
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

    def join(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; False if ``timeout`` passed first (without a background thread:
        True, the jobs waiting for :meth:`drain`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                thread = self._thread
                if thread is None:
                    return not self._jobs or not self.background
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False

    def stop(self, timeout: float | None = None) -> None:
        """Run no other job; wait (at most ``timeout``) for the one running, which stops at its next op."""
        self.yielding.stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
