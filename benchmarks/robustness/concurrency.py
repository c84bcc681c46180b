"""Many threads on one engine and one store: no torn read, no deadlock, a bounded queue, every chunk accounted for."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.robustness.bench import CHUNK, HANG_S, Bench, Tally, counting_warnings
from benchmarks.robustness.plumbing import HookedStore
from cachegen_core.stores import DiskCacheStore
from cachegen_core.testing import words


def scenario_concurrent(bench: Bench, threads: int = 8, rounds: int = 3, store: Any = None) -> dict[str, Any]:
    """``threads`` threads, one engine (background store worker), one store, overlapping prompts.

    Requests count as answered when they return (``exact=False``): chunks computed on top
    of other requests' decoded chunks shift a random tiny model's greedy text now and then,
    so exact text is checked by the sequential scenarios; here ``plain_text`` says how many matched.

    Every blob the store returns must be byte-identical to one that was written under its
    key (no torn value is ever decoded); every request must finish (no deadlock) with the
    right text; the store queue stays bounded; ``flush`` accounts for every queued chunk.
    """
    tally = Tally(f"concurrent {threads} threads")
    written: dict[str, set[bytes]] = {}
    torn: list[str] = []
    lock = threading.Lock()

    def on_put(items: list[tuple[str, bytes]]) -> None:
        with lock:
            for k, v in items:
                written.setdefault(k, set()).add(bytes(v))

    checked = [0]

    def on_get(key: str, value: bytes | None) -> None:
        if value is not None:
            with lock:
                checked[0] += 1
                if bytes(value) not in written.get(key, ()):
                    torn.append(key)

    with tempfile.TemporaryDirectory() as d, counting_warnings() as w:
        inner = store if store is not None else DiskCacheStore(Path(d) / "kv")
        queue_size = 4
        eng = bench.engine(HookedStore(inner, on_get=on_get, on_put=on_put), background=True, queue_size=queue_size)
        base = words(180, 2 * CHUNK).split()
        prompts = [" ".join(base + words(181 + i % 4, CHUNK + 5).split()) for i in range(threads)]
        for p in prompts:
            bench.plain(p)  # outside the timed region
        infos: list[Any] = []
        max_queued = [0]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                max_queued[0] = max(max_queued[0], eng.store_stats.get("queued", 0))
                time.sleep(0.002)

        def worker(i: int) -> None:
            for r in range(rounds):
                info = tally.ask(bench, eng, prompts[(i + r) % threads], exact=False)
                with lock:
                    infos.append(info)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join(timeout=HANG_S * rounds)
        deadlocked = sum(t.is_alive() for t in pool)
        flushed = eng.flush(timeout=HANG_S)
        for p in prompts[:2]:  # read back from the store itself: while its writes lag, the engine reads its hot tier
            infos.append(tally.ask(bench, eng, p, exact=False))
        flushed = eng.flush(timeout=HANG_S) and flushed  # what they recomputed (chunks dropped when the queue was full)
        stop.set()
        watcher.join()
        stats = eng.store_stats
        queued = sum(i.chunks_queued for i in infos if i is not None)
        tally.hangs += deadlocked
        tally.extra.update(
            seconds=round(time.perf_counter() - t0, 2),
            deadlocked_threads=deadlocked,
            torn_reads=len(torn),
            reads_checked=checked[0],
            flushed=flushed,
            queue_size=queue_size,
            max_queued=max_queued[0],
            chunks_queued=queued,
            store_stats=stats,
            cached_tokens=sum(i.cached_tokens for i in infos if i is not None),
        )
        tally.wrong_kv_accepted += len(torn)
    return tally.row(w)
