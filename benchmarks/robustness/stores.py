"""Failing stores: redis killed mid-stream, restarted, a cluster master killed, slow and stuck; diskcache full; a read-only cache directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.robustness.bench import CHUNK, HANG_S, Bench, Tally, counting_warnings, prompt
from benchmarks.robustness.plumbing import DelayProxy, HookedStore, redis_server
from cachegen_core.engine import KVEngine
from cachegen_core.stores import DiskCacheStore, RedisStore

ROOT = Path(__file__).resolve().parents[2]


def scenario_redis_killed_mid_stream(bench: Bench) -> dict[str, Any]:
    """The server is SIGKILLed right after the first chunk of a hit is fetched, then restarted."""
    tally = Tally("redis killed mid-stream")
    with redis_server() as server, counting_warnings() as w:
        killed = threading.Event()

        def kill_after_first_get(key: str, value: bytes | None) -> None:
            if not killed.is_set() and not key.endswith("-M"):  # after the first blob, not the manifests
                killed.set()
                server.stop(kill=True)

        store = RedisStore(server.url, socket_timeout=1.0)
        eng = bench.engine(store)
        text = prompt(133)
        tally.ask(bench, eng, text)  # miss: computes and stores 3 chunks
        eng.store = HookedStore(store, on_get=kill_after_first_get)
        info = tally.ask(bench, eng, text)  # hit on chunk 0, dies fetching chunk 1
        tally.extra["cached_tokens_while_dying"] = info.cached_tokens if info else None
        for s in (134, 135):  # dead server: answered by recomputation, no new warnings
            tally.ask(bench, eng, prompt(s))
        tally.extra["warnings_while_down"] = len(w.messages)
        server.start()  # empty after the restart (no persistence)
        eng.store = store
        tally.ask(bench, eng, text)  # miss again, writes work again
        info = tally.ask(bench, eng, text)
        tally.extra["cached_tokens_after_restart"] = info.cached_tokens if info else None
    return tally.row(w)


def scenario_redis_restarted(bench: Bench) -> dict[str, Any]:
    """A clean restart between requests: pooled connections go stale, the store heals itself."""
    tally = Tally("redis restarted")
    with redis_server() as server, counting_warnings() as w:
        eng = bench.engine(RedisStore(server.url, socket_timeout=1.0))
        text = prompt(140)
        tally.ask(bench, eng, text)
        tally.ask(bench, eng, text)
        server.stop()
        server.start()
        tally.ask(bench, eng, text)  # stale pooled connection: one retry reconnects; the cache is empty
        info = tally.ask(bench, eng, text)
        tally.extra["cached_tokens_after_restart"] = info.cached_tokens if info else None
    return tally.row(w)


def scenario_redis_cluster_failover(bench: Bench) -> dict[str, Any]:
    """A Redis Cluster (3 masters, 3 replicas) loses a master right after the first chunk of a hit is fetched;
    requests keep coming while a replica takes over (the exact form stored: every answer must be the model's own)."""
    from cachegen_core.testing.redis_cluster import running_redis_cluster  # noqa: PLC0415

    tally = Tally("redis cluster master killed mid-stream")
    with running_redis_cluster() as cluster, counting_warnings() as w:
        killed: list[Any] = []

        def kill_after_first_get(key: str, value: bytes | None) -> None:
            if not killed and not key.endswith("-M"):  # after the first blob, not the manifests
                killed.append((cluster.kill_master(), time.monotonic()))

        store = RedisStore(cluster.url, socket_timeout=1.0)
        eng = KVEngine(bench.model, bench.tokenizer, store=store, chunk_tokens=CHUNK, level="lossless",
                       store_options=["lossless"], background=False, allow_text=False)  # fmt: skip
        texts = [prompt(s) for s in (180, 181, 182)]
        for text in texts:  # misses: stored, and replicated before the kill
            tally.ask(bench, eng, text)
        cluster.wait_ok()
        eng.store = HookedStore(store, on_get=kill_after_first_get)
        info = tally.ask(bench, eng, texts[0])  # a hit that loses a master under its stream
        tally.extra["cached_tokens_while_dying"] = info.cached_tokens if info else None
        eng.store = store
        resumed = None
        while resumed is None and time.monotonic() - killed[0][1] < 30:  # until every prompt is reused whole again
            infos = [tally.ask(bench, eng, text) for text in texts]
            if all(i is not None and i.cached_tokens == 3 * CHUNK for i in infos):
                resumed = time.monotonic() - killed[0][1]
        tally.extra["master_failed_over"] = cluster.roles().get(killed[0][0].address) == "fail"
        tally.extra["reuse_back_after_s"] = None if resumed is None else round(resumed, 2)
    return tally.row(w)


def scenario_slow_redis(bench: Bench) -> dict[str, Any]:
    """Redis behind a delaying proxy: slow (answers from cache) and slower than the socket timeout (recomputes)."""
    tally = Tally("slow redis")
    with redis_server() as server, counting_warnings() as w:
        slow = DelayProxy(server.port, 0.02)
        stuck = DelayProxy(server.port, 3.0)
        try:
            eng = bench.engine(RedisStore(port=slow.port, host="127.0.0.1", socket_timeout=2.0))
            text = prompt(150)
            tally.ask(bench, eng, text)
            info = tally.ask(bench, eng, text)
            tally.extra["cached_tokens_slow"] = info.cached_tokens if info else None
            stuck_store = RedisStore(port=stuck.port, host="127.0.0.1", socket_timeout=0.5, socket_connect_timeout=0.5)
            eng = bench.engine(stuck_store, background=True)  # writes off the request path, as by default
            t = time.perf_counter()
            for s in (150, 151):
                tally.ask(bench, eng, prompt(s))
            tally.extra["seconds_past_timeout"] = round(time.perf_counter() - t, 2)
            eng.flush(timeout=HANG_S)
            tally.extra["store_stats_past_timeout"] = eng.store_stats
        finally:
            slow.close()
            stuck.close()
    return tally.row(w)


def scenario_diskcache_full(bench: Bench) -> dict[str, Any]:
    """diskcache at its size limit: a limit below one blob (every write refused) and one of a few chunks (eviction)."""
    tally = Tally("diskcache full")
    with tempfile.TemporaryDirectory() as d, counting_warnings() as w:
        tiny = DiskCacheStore(Path(d) / "tiny", size_limit=2_000)
        eng = bench.engine(tiny)
        for s in (160, 161, 162):
            tally.ask(bench, eng, prompt(s))
        tally.extra["entries_tiny"] = len(list(tiny.keys()))
        tally.extra["warnings_tiny"] = len(w.messages)
        small = DiskCacheStore(Path(d) / "small", size_limit=200_000, cull_limit=100)
        eng = bench.engine(small, background=True, queue_size=4)
        for s in (163, 164, 165, 166, 163):
            tally.ask(bench, eng, prompt(s, chunks=4))
            eng.flush(timeout=60)
        tally.extra["volume_bytes"] = small.volume
        tally.extra["size_limit"] = small.size_limit
        tally.extra["store_stats"] = eng.store_stats
    return tally.row(w)


_READ_ONLY_SCRIPT = r"""
import json, logging, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
import codecs; codecs.encode(b"", "hex")  # diskcache names files with it: load it before losing access
from benchmarks.robustness import Bench, Tally, counting_warnings, prompt
from cachegen_core.stores import DiskCacheStore
bench = Bench.tiny()
d = tempfile.mkdtemp(prefix="cachegen-ro-")
# disk_min_file_size=0: every blob in its own file, as the MB-sized blobs of real models are
# (small values live inline in SQLite, which an already-open handle may still write)
eng = bench.engine(DiskCacheStore(d, disk_min_file_size=0))
tally = Tally("read-only cache dir")
tally.ask(bench, eng, prompt(170))                # writable: stores the chunks
for p in (170, 171, 172):                          # warm every lazy import before dropping privileges
    bench.plain(prompt(p))
for root, dirs, files in os.walk(d):
    for f in files:
        os.chmod(os.path.join(root, f), 0o444)
    os.chmod(root, 0o555)
if os.geteuid() == 0:                              # root ignores file modes: become nobody
    os.setgid(65534)
    os.setuid(65534)
with counting_warnings() as w:
    # the same store object: a DiskCacheStore cannot be (re)opened on a read-only directory
    info = tally.ask(bench, eng, prompt(170))      # a hit: reads still work
    tally.extra["cached_tokens_read_only"] = info.cached_tokens if info else None
    for p in (171, 172, 170):                      # misses: every write fails
        tally.ask(bench, eng, prompt(p))
print(json.dumps({"dir": d, **tally.row(w)}))
"""


def scenario_read_only_dir(bench: Bench | None = None) -> dict[str, Any]:
    """The cache directory is read-only (run as ``nobody`` in a subprocess when we are root)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ro.py"
        script.write_text(_READ_ONLY_SCRIPT)
        os.chmod(tmp, 0o755)
        os.chmod(script, 0o644)
        proc = subprocess.run([sys.executable, str(script), str(ROOT)], check=False, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"scenario": "read-only cache dir", "inputs": 0, "crashes": 1, "hangs": 0, "wrong_kv_accepted": 0,
                "answered": 0, "requests": 0, "errors": [proc.stderr[-1500:]]}  # fmt: skip
    row = json.loads(lines[-1])
    d = row.pop("dir")
    for root, _, _ in os.walk(d):
        os.chmod(root, 0o755)
    import shutil  # noqa: PLC0415

    shutil.rmtree(d, ignore_errors=True)
    return row
