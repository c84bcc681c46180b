"""Who computes now: requests, or background work (the writer's levels, cost probes, the profile fit), which keeps a
share of the machine under continuous load.

The cores are shared: background work beside a request's prefill slowed it by 10-40 % on 2 cores, so background work
runs while no request of the process computes (``idle``, cleared while a request holds :meth:`Turns.busy`). Under
continuous batching some request is always computing, so that alone would never store a level or fit a profile.
The schedulers therefore lend background work a turn between their steps (:meth:`Turns.lend`): for every second of
steps since the load began (the credit starts at nothing when a request arrives at an idle process: a short request
is never interrupted), ``share / (1 - share)`` seconds of credit; once a waiting background thread has a slice's
worth, the scheduler stops stepping for that slice while ``granted`` is set. Background torch work pauses before each op when
its turn ends (``yielding.py``); a unit that cannot pause (a chunk's levels encoded by native code) holds a turn to
its end (:meth:`Turns.turn`), and the time it overran is taken from the next credit. One :data:`TURNS` per process:
engines share the cores.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

#: The share of the time background work gets while requests run without pause.
BACKGROUND_SHARE = 0.15
#: The longest turn a scheduler lends at once, seconds (background torch work pauses at its next op after it).
SLICE_S = 0.05


class Turns:
    """The process's requests and background work taking turns (see the module doc)."""

    def __init__(self, share: float = BACKGROUND_SHARE, slice_s: float = SLICE_S) -> None:
        self.share, self.slice_s = share, slice_s
        self.idle = threading.Event()  # no request of the process computes
        self.idle.set()
        self.granted = threading.Event()  # background work may run beside requests now
        self._cond = threading.Condition()
        self._busy = 0
        self._waiting = 0  # background threads waiting for a turn
        self._holding = 0  # background units running that cannot pause
        self._credit = 0.0
        self.lent_s = 0.0  # seconds lent so far (for tests and benchmarks)

    # ------------------------------------------------------------ requests
    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Held by a request while it computes (and by a scheduler while it steps)."""
        with self._cond:
            if not self._busy:  # load starts: background work had the machine until now, it earns its share anew
                self._credit = 0.0
            self._busy += 1
            self.idle.clear()
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                if not self._busy:
                    self.idle.set()
                    self._cond.notify_all()

    def lend(self, step_s: float) -> float:
        """After a scheduler step of ``step_s`` seconds: add its credit and, when background work waits and a slice is
        due, let it run for one (this thread waits meanwhile). Returns the seconds lent."""
        with self._cond:
            self._credit = min(self._credit + step_s * self.share / (1 - self.share), 4 * self.slice_s)
            if not self._waiting or self._credit < self.slice_s or self.idle.is_set():
                return 0.0
            self.granted.set()
            self._cond.notify_all()
        t = time.perf_counter()
        time.sleep(self.slice_s)
        with self._cond:
            while self._holding:  # a unit that cannot pause: its end is the turn's
                self._cond.wait(timeout=0.05)
            self.granted.clear()
            lent = time.perf_counter() - t
            self._credit -= lent
            self.lent_s += lent
        return lent

    # ------------------------------------------------------------ background work
    def may_run(self) -> bool:
        """Whether background work may compute now (no request computes, or a turn is lent)."""
        return self.idle.is_set() or self.granted.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until background work may compute (counted as waiting: schedulers lend turns only then); False if
        ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._waiting += 1
            try:
                while not (self.idle.is_set() or self.granted.is_set()):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(timeout=0.05 if left is None else min(left, 0.05))
                return True
            finally:
                self._waiting -= 1

    @contextlib.contextmanager
    def turn(self, timeout: float | None = None) -> Iterator[bool]:
        """Hold a turn for work that cannot pause (yields False, holding nothing, if ``timeout`` passed first)."""
        with self._cond:
            self._holding += 1  # counted before waiting: a turn lent now lasts until this unit ends
        try:
            yield self.wait(timeout)
        finally:
            with self._cond:
                self._holding -= 1
                self._cond.notify_all()


#: The process's turns: every engine's schedulers and background threads.
TURNS = Turns()
