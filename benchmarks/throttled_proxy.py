"""A link shaped to a bandwidth trace: a loopback TCP proxy for real sockets, a store wrapper for unit tests.

A trace is a list of Gbit/s samples, one per time slice of ``slice_s`` seconds, cycled
(``../shared/data/bandwidth_traces_dev.jsonl``, field ``bw_gbps``). :class:`TraceLink`
is the shaping maths: a token bucket whose rate follows the trace and holds at most
``burst_s`` seconds of it, so a sender that wakes late catches up without bursting.

    with ThrottledProxy(redis_port, gbps=[1.0, 0.3, 2.0], slice_s=0.5) as proxy:
        r = redis.Redis(host=proxy.host, port=proxy.port)   # every reply crosses the trace

The proxy runs its own asyncio loop in a background thread, binds 127.0.0.1 on a free
port, and shapes server->client and (by default) client->server, each direction one
link shared by all connections. Pure-Python pacing tops out around a few Gbit/s on
loopback. :class:`ThrottledStore` wraps any ``KVStore`` and sleeps on reads as the trace
says, with an injectable clock and sleep for deterministic tests.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "bandwidth_traces_dev.jsonl"


def load_traces(path: str | Path = TRACES) -> list[list[float]]:
    """The ``bw_gbps`` list of every line of a JSON-lines trace file."""
    with open(path) as f:
        return [json.loads(line)["bw_gbps"] for line in f if line.strip()]


class TraceLink:
    """A link whose rate follows ``gbps`` (one sample per ``slice_s`` s from ``t0``, cycled).

    Transfers queue behind each other (``reserve``); ``finish`` is the pure maths.
    Thread-safe.
    """

    def __init__(self, gbps: Sequence[float], slice_s: float = 1.0, *, burst_s: float = 0.005, t0: float = 0.0) -> None:
        if not gbps or min(gbps) < 0 or max(gbps) <= 0 or not all(math.isfinite(g) for g in gbps):
            raise ValueError("a trace needs finite, non-negative samples, one of them positive")
        if slice_s <= 0 or burst_s < 0:
            raise ValueError("slice_s must be > 0 and burst_s >= 0")
        self.bps = [g * 1e9 / 8 for g in gbps]
        self.slice_s, self.burst_s = slice_s, burst_s
        self._lock = threading.Lock()
        self.restart(t0)

    def restart(self, t0: float) -> None:
        """Start the trace (and an idle link) at time ``t0``."""
        with self._lock:
            self.t0, self.free_at = t0, -math.inf

    def _slice(self, t: float) -> tuple[int, float]:
        """The index of the slice holding ``t`` and the end of that slice (always > t)."""
        k = math.floor((t - self.t0) / self.slice_s)
        end = self.t0 + (k + 1) * self.slice_s
        if end <= t:  # float rounding at a boundary
            k, end = k + 1, self.t0 + (k + 2) * self.slice_s
        return k, end

    def rate_at(self, t: float) -> float:
        """Bytes/s at time ``t``."""
        return self.bps[self._slice(t)[0] % len(self.bps)]

    def finish(self, start: float, nbytes: float) -> float:
        """The time at which ``nbytes`` sent from ``start`` on an idle link have arrived."""
        t, left = start, float(nbytes)
        while left > 0:
            k, slice_end = self._slice(t)
            bw = self.bps[k % len(self.bps)]
            if bw * (slice_end - t) >= left:
                return t + left / bw
            left -= bw * (slice_end - t)
            t = slice_end
        return t

    def reserve(self, nbytes: int, now: float) -> float:
        """Queue ``nbytes`` sent at ``now``; returns when they have arrived."""
        with self._lock:
            start = max(self.free_at, now - self.burst_s, self.t0)  # capacity unused in the last burst_s is still there
            self.free_at = self.finish(start, nbytes)
            return self.free_at


class ThrottledProxy:
    """A loopback TCP proxy to ``upstream_host:upstream_port`` shaped to a trace; a context manager."""

    host = "127.0.0.1"

    def __init__(
        self,
        upstream_port: int,
        gbps: Sequence[float],
        slice_s: float = 1.0,
        *,
        upstream_host: str = "127.0.0.1",
        shape_upload: bool = True,
        burst_s: float = 0.005,
        piece_bytes: int = 64 * 1024,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.down = TraceLink(gbps, slice_s, burst_s=burst_s)
        self.up = TraceLink(gbps, slice_s, burst_s=burst_s) if shape_upload else None
        self.piece_bytes = piece_bytes
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None

    def __enter__(self) -> ThrottledProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Bind a free port and serve in a background thread; returns once it listens."""
        if self._thread is not None:
            return
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="throttled-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError(f"throttled proxy could not start: {self._error}") from self._error

    def restart_trace(self) -> None:
        """Replay the trace from its first slice, now (call before a measurement)."""
        now = time.monotonic()  # the clock of asyncio's loop.time()
        for link in (self.down, self.up):
            if link is not None:
                link.restart(now)

    def close(self) -> None:
        """Drop every connection and stop the thread."""
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None

    # ------------------------------------------------------------ the event loop thread
    def _run(self, ready: threading.Event) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(asyncio.start_server(self._handle, self.host, 0))
            self.port = int(server.sockets[0].getsockname()[1])
            self.restart_trace()
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for task in list(self._conns):
                task.cancel()
            loop.run_until_complete(asyncio.gather(*self._conns, return_exceptions=True))
            loop.run_until_complete(server.wait_closed())
            loop.close()

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)  # type: ignore[arg-type]
        swriter: asyncio.StreamWriter | None = None
        pumps: list[asyncio.Task[None]] = []
        try:
            sreader, swriter = await asyncio.open_connection(*self.upstream)
            pumps = [asyncio.create_task(self._pump(creader, swriter, self.up)),
                     asyncio.create_task(self._pump(sreader, cwriter, self.down))]  # fmt: skip
            await asyncio.gather(*pumps)
        except (OSError, asyncio.CancelledError):  # upstream down, or the proxy closing: hang up
            pass
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (cwriter, swriter):
                if w is not None:
                    w.close()
            self._conns.discard(task)  # type: ignore[arg-type]

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: TraceLink | None) -> None:
        """Copy until EOF, each piece released when the link says it has arrived; then pass the EOF on."""
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(self.piece_bytes):
                if link is not None:
                    delay = link.reserve(len(data), loop.time()) - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            writer.close()  # the other side goes down with it


class ThrottledStore:
    """A ``KVStore`` whose reads take as long as a trace link says (it sleeps); other calls pass through.

    ``clock`` and ``sleep`` are injectable: a fake pair makes a deterministic simulated link.
    """

    views = False  # reads go through ``get`` (a memory store's ``view`` would skip the link)

    def __init__(
        self,
        store: Any,
        gbps: Sequence[float],
        slice_s: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.clock, self.sleep = clock, sleep
        self.link = TraceLink(gbps, slice_s, burst_s=0.0, t0=clock())

    def _transfer(self, nbytes: int) -> None:
        now = self.clock()
        delay = self.link.reserve(nbytes, now) - now
        if delay > 0:
            self.sleep(delay)

    def get(self, key: str) -> bytes | None:
        blob = self.store.get(key)
        if blob is not None:
            self._transfer(len(blob))
        return blob

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        blobs = self.store.get_many(keys)
        self._transfer(sum(len(b) for b in blobs if b is not None))
        return blobs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)
