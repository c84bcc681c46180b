"""KV held once for every request that starts with it: reference-counted buffers and the prefixes found in them.

Each request computes into a buffer of its own (a :class:`Held` buffer, counted against the engine's KV memory).
Once a request's buffer holds the KV of a prefix of its prompt (streamed from the store, or computed), it publishes
that prefix under the keys of its chunks and partial chunks (prefix-chained: a key names every token before its
end) in :class:`SharedPrefixes`; a request arriving with a prompt that starts with the same tokens finds the longest
such key and reads those positions of that buffer in place (its :class:`RequestKV`: the shared prefix, then its own
buffer for the rest), holding a reference, so the buffer lives until the last request reading it ends. A request
that will fill a prefix others may want (it streams or computes it) announces its keys first (:meth:`SharedPrefixes.
announce`), so that requests arriving meanwhile wait for it instead of streaming or computing the same prefix again
(vLLM's block pool and SGLang's radix cache hold a shared prefix once too; here the unit is a chunk's or a partial
chunk's key, 64 tokens apart).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ...kv import KVCache

#: A prefix a request's KV could share: the key of a chunk or partial chunk of its prompt and the token it ends at.
Prefix = tuple[str, int]


class Held:
    """A KV buffer read by one or more requests; ``release`` by the last one runs the ``on_free`` callbacks, given
    the buffer (memory given back, the buffer to its pool, its published prefixes withdrawn)."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.refs = 1
        self.lent = False  # views of it were handed to the writer: its memory is not reused when freed
        self._on_free: list[Callable[[Held], None]] = []
        self._lock = threading.Lock()

    def acquire(self) -> Held:
        with self._lock:
            if self.refs < 1:
                raise RuntimeError("a released KV buffer was shared")
            self.refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            last = self.refs == 0
        if last:
            callbacks, self._on_free = self._on_free, []
            for fn in reversed(callbacks):
                fn(self)

    def on_free(self, fn: Callable[[Held], None]) -> None:
        with self._lock:
            self._on_free.append(fn)


@dataclass(eq=False)
class RequestKV:
    """A request's KV: positions ``[0, offset)`` read from ``shared`` (another request's buffer, held), the rest in
    ``own`` (position ``offset + i`` at ``own``'s token ``i``). :meth:`slice` takes positions of the prompt."""

    own: KVCache
    holder: Held
    offset: int = 0
    shared: Held | None = None
    _released: bool = field(default=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.offset + self.own.num_tokens

    @property
    def prefix(self) -> KVCache | None:
        """The shared prefix's KV (positions ``[0, offset)``), None without one."""
        return self.shared.kv.slice(0, self.offset) if self.shared is not None else None

    def slice(self, start: int, end: int) -> KVCache:
        """The KV of positions ``[start, end)``: a view of the request's own buffer or (read-only) of the shared
        prefix; across the end of the shared prefix, a copy of both parts."""
        if start >= self.offset:
            return self.own.slice(start - self.offset, end - self.offset)
        if self.shared is None:
            raise ValueError(f"positions [{start}, {end}) before the first of this KV ({self.offset})")
        if end <= self.offset:
            return self.shared.kv.slice(start, end)
        return KVCache.concat([self.shared.kv.slice(start, self.offset), self.own.slice(0, end - self.offset)])

    def release(self) -> None:
        """Let go of both buffers (once)."""
        if self._released:
            return
        self._released = True
        if self.shared is not None:
            self.shared.release()
        self.holder.release()


@dataclass(eq=False)
class _Announced:
    """Prefixes a request is filling: others wait for ``ready``."""

    keys: tuple[str, ...]
    ready: threading.Event = field(default_factory=threading.Event)


class SharedPrefixes:
    """The prefixes held in running requests' buffers, by key (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, tuple[Held, int]] = {}
        self._announced: dict[str, _Announced] = {}
        self.shared = 0  # requests that read a prefix held by another (for tests and metrics)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def take(self, prefixes: Sequence[Prefix], skip: Sequence[_Announced] = (), cancel: threading.Event | None = None,
             wait: bool = True) -> tuple[Held, int] | None:  # fmt: skip
        """The longest of ``prefixes`` held now, acquired (release it when done), with the token it ends at; None when
        none is. A prefix another request announced (not one of ``skip``: the caller's own) is waited for (``wait``),
        then looked up again (not once ``cancel`` is set)."""
        while True:
            with self._lock:
                for key, end in sorted(prefixes, key=lambda p: -p[1]):
                    if key in self._live:
                        held, at = self._live[key]
                        try:
                            held.acquire()
                        except RuntimeError:  # freed, its entries about to go
                            continue
                        self.shared += 1
                        return held, min(end, at)
                pending = next((self._announced[k] for k, _ in sorted(prefixes, key=lambda p: -p[1])
                                if k in self._announced and not any(self._announced[k] is s for s in skip)), None)  # fmt: skip
            if pending is None or not wait:
                return None
            while not pending.ready.wait(0.05):
                if cancel is not None and cancel.is_set():
                    return None

    def announce(self, prefixes: Sequence[Prefix]) -> _Announced:
        """Say that this request is filling ``prefixes`` (none held or announced): requests wanting them wait until
        :meth:`settle`."""
        note = _Announced(tuple(k for k, _ in prefixes))
        with self._lock:
            for k in note.keys:
                self._announced.setdefault(k, note)
        return note

    def settle(self, note: _Announced | None) -> None:
        """The announced prefixes are published or will not be: wake those waiting for them."""
        if note is None:
            return
        with self._lock:
            for k in note.keys:
                if self._announced.get(k) is note:
                    del self._announced[k]
        note.ready.set()

    def publish(self, held: Held, prefixes: Sequence[Prefix]) -> None:
        """``held``'s buffer holds the KV of each of ``prefixes`` from position 0: requests may read them in place
        until the buffer is freed."""
        if not prefixes:
            return
        with self._lock:
            for key, end in prefixes:
                self._live[key] = (held, end)
        held.on_free(self._withdraw)

    def _withdraw(self, held: Held) -> None:
        with self._lock:
            for key in [k for k, (h, _) in self._live.items() if h is held]:
                del self._live[key]
