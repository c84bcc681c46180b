"""Document caches of answered requests, computed after the answer in the background.

A request whose documents were not stored answers first: each such document is then computed on its own (after
the preamble, as ``DocumentCaches.compute`` does) by a background thread, and its pieces are queued for the writer,
so that the next prompt holding it, in any place, finds it. The thread gives way to requests as the profile fit
does (``serving/yielding.py``): it computes while no request does, or in the share of the time the schedulers lend
under continuous load, pausing before each torch op otherwise, the model lock let go. It starts when there is work
and ends when there is none; ``join`` waits for the queue (``KVEngine.flush`` does), and an engine built with
``background=False`` computes them before the request returns.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import CacheGenError, StoreError
from ..model import hf
from ..serving.background import JobQueue
from ..serving.yielding import Stopped, Yielding

log = logging.getLogger("cachegen_core.engine")


class DocumentIndexer:
    """Computes queued documents (token ids, without the preamble) and hands their pieces to ``engine``'s writer;
    ``pieces(doc_ids)`` names a document's pieces (``DocumentCaches.pieces``). Holds the engine weakly."""

    def __init__(self, engine: Any, preamble: Sequence[int], pieces: Callable[[Sequence[int]], list[Any]], *,
                 background: bool = True, quiet_s: float = 0.5) -> None:  # fmt: skip
        self._engine = weakref.proxy(engine)
        self.preamble, self.pieces, self.background = tuple(preamble), pieces, background
        self.yielding = Yielding(engine.writer.turns, quiet_s=quiet_s, device=engine.model.device)
        self._queue: JobQueue[list[int]] = JobQueue(self._one, self.yielding, name="cachegen-documents", background=background)
        self.computed = self.failed = 0

    def submit(self, documents: Sequence[Sequence[int]]) -> None:
        """Queue documents to compute and store (now, without a background thread)."""
        self._queue.submit(list(map(int, d)) for d in documents)
        self._queue.drain()

    def _one(self, doc: list[int]) -> None:
        e = self._engine
        try:
            with self.yielding.holding(e.scheduler.lock) if self.background else e.scheduler.exclusive():
                kv = hf.prefill(e.model, [*self.preamble, *doc]).slice(len(self.preamble))
            for c in self.pieces(doc):
                e.writer.submit(c, kv.slice(c.start, c.end))
            self.computed += 1
        except (Stopped, ReferenceError):
            raise
        except StoreError:  # the writer logs a failing store once
            self.failed += 1
        except (CacheGenError, RuntimeError, ValueError) as err:  # a document that cannot be stored is recomputed later
            self.failed += 1
            log.warning("storing a document failed: %s", err)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until no document is queued or being computed; False if ``timeout`` passed first."""
        return self._queue.join(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Compute no other document (the one being computed stops at its next op)."""
        self._queue.stop(timeout)
