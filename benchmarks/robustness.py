"""Robustness scenarios: hostile blobs, dead, slow, full and read-only stores, concurrency; JSON lines out.

    python -m benchmarks.robustness [--quick] [--only NAME ...]

One line per scenario, with at least ``scenario``, ``inputs``, ``crashes``, ``hangs``,
``wrong_kv_accepted``, ``answered`` and ``requests``:

- ``fuzz-container``, ``fuzz-codec``, ``fuzz-coder-<name>`` (every coder of
  ``available_coders()``), ``fuzz-native-libfuzzer``: the fuzzers of ``cachegen_core.testing.fuzz``.
  ``inputs``/``requests``: inputs tried; ``answered``: inputs that ended in a decoded KV
  or a ``CacheGenFormatError``; ``wrong_kv_accepted``: see ``cachegen_core.testing.fuzz``.
- the engine scenarios run the tiny random Llama of ``cachegen_core.testing`` with a real store
  (``redis-server``, diskcache). ``requests``: prompts sent; ``answered``: requests
  that returned exactly the plain model's greedy text; ``crashes``: requests that
  raised; ``hangs``: requests over ``HANG_S``; ``wrong_kv_accepted``: requests that used
  (counted as cached tokens) a chunk whose stored blob was foreign, corrupted or
  forged; ``warnings``: WARNING records logged by ``cachegen_core`` during the scenario
  (a failure must be logged once, not per chunk or token).

The same functions back ``tests/test_robustness.py``, which asserts on their results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cachegen_core.keys.chunks import blob_key  # noqa: E402
from cachegen_core.engine import KVEngine  # noqa: E402
from cachegen_core.stores import DiskCacheStore, MemoryStore, RedisStore  # noqa: E402
from cachegen_core.testing import make_tiny_llama, make_tiny_tokenizer, running_redis_server, words  # noqa: E402
from cachegen_core.testing import fuzz as H  # noqa: E402
from cachegen_core.testing.fuzz import native, repack_header  # noqa: E402

CHUNK = 64
NEW_TOKENS = 6
HANG_S = 60.0


# ------------------------------------------------------------------- model and prompts
@dataclass
class Bench:
    """The tiny model, its tokenizer and the plain greedy answers (computed once per prompt)."""

    model: Any
    tokenizer: Any
    _plain: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def tiny(cls, seed: int = 0) -> Bench:
        return cls(make_tiny_llama(seed), make_tiny_tokenizer())

    def plain(self, prompt: str) -> str:
        """The model's own greedy continuation, with no cache involved."""
        with self._lock:
            if prompt not in self._plain:
                ids = torch.tensor([self.tokenizer(prompt)["input_ids"]])
                with torch.no_grad():
                    out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                              do_sample=False, pad_token_id=self.tokenizer.eos_token_id)  # fmt: skip
                self._plain[prompt] = self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            return self._plain[prompt]

    def engine(self, store: Any, **kw: Any) -> KVEngine:
        kw.setdefault("background", False)
        kw.setdefault("store_options", [0])  # the scenarios spoil level-0 blobs (raw blobs: tests/test_raw.py)
        kw.setdefault("allow_text", False)  # ...and count the chunks fetched: never swapped for a recomputation
        return KVEngine(self.model, self.tokenizer, store=store, chunk_tokens=CHUNK, level=0, **kw)


def prompt(seed: int, chunks: int = 3, tail: int = 9) -> str:
    """A prompt of ``chunks`` complete chunks and a ``tail`` of words (tiny vocabulary).

    The seeds used below give prompts whose greedy answer is the same with the level-0 KV
    of any number of leading chunks (most seeds do; about one in seven flips a token on
    the random tiny model), so a wrong answer means a robustness failure, not codec noise."""
    return words(seed, chunks * CHUNK + tail)


# ---------------------------------------------------------------------- observation
class WarningCounter(logging.Handler):
    """Counts WARNING+ records of ``cachegen_core`` while installed (see ``counting_warnings``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def counting_warnings() -> Iterator[WarningCounter]:
    counter = WarningCounter()
    logger = logging.getLogger("cachegen_core")
    old_level = logger.level
    logger.setLevel(min(logger.getEffectiveLevel(), logging.WARNING))
    logger.addHandler(counter)
    try:
        yield counter
    finally:
        logger.removeHandler(counter)
        logger.setLevel(old_level)


@dataclass
class Tally:
    """Outcome of a scenario's requests."""

    scenario: str
    requests: int = 0
    answered: int = 0
    crashes: int = 0
    hangs: int = 0
    wrong_kv_accepted: int = 0
    max_request_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def ask(self, bench: Bench, engine: KVEngine, text: str, *, bad_chunks: int | None = None, exact: bool = True) -> Any:
        """Send one request; ``bad_chunks``: index of the first chunk whose stored blob must not be used.

        ``exact``: the request counts as answered only with the plain model's greedy text
        (else any answer counts, and exact matches are tallied in ``extra["plain_text"]``)."""
        self.requests += 1
        t = time.perf_counter()
        try:
            out, info = engine.generate(text, max_new_tokens=NEW_TOKENS)
        except Exception as e:  # a crash: the request got no answer
            self.crashes += 1
            self.errors.append(f"{type(e).__name__}: {e}"[:300])
            return None
        finally:
            dt = time.perf_counter() - t
            self.max_request_s = max(self.max_request_s, dt)
            if dt > HANG_S:
                self.hangs += 1
        same = out == bench.plain(text)
        self.extra["plain_text"] = self.extra.get("plain_text", 0) + same
        if same or not exact:
            self.answered += 1
        if not same and exact:
            self.errors.append(f"wrong text for a prompt of {len(text.split())} words: {out!r} != {bench.plain(text)!r}")
        if bad_chunks is not None and info.cached_tokens > bad_chunks * CHUNK:
            self.wrong_kv_accepted += 1
        return info

    def row(self, warnings: WarningCounter | None = None, inputs: int | None = None) -> dict[str, Any]:
        r: dict[str, Any] = {
            "scenario": self.scenario,
            "inputs": self.requests if inputs is None else inputs,
            "crashes": self.crashes,
            "hangs": self.hangs,
            "wrong_kv_accepted": self.wrong_kv_accepted,
            "answered": self.answered,
            "requests": self.requests,
            "max_request_s": round(self.max_request_s, 3),
        }
        if warnings is not None:
            r["warnings"] = len(warnings.messages)
            r["warning_messages"] = [m[:160] for m in warnings.messages[:6]]
        r.update(self.extra)
        if self.errors:
            r["errors"] = self.errors[:5]
        return r


# -------------------------------------------------------------------- store plumbing
class HookedStore:
    """Delegates to ``inner``; ``on_get(key, value)`` and ``on_put(items)`` run around reads and writes."""

    def __init__(self, inner: Any, on_get: Callable[[str, bytes | None], None] | None = None,
                 on_put: Callable[[list[tuple[str, bytes]]], None] | None = None) -> None:  # fmt: skip
        self.inner, self.on_get, self.on_put = inner, on_get, on_put
        self.namespace = inner.namespace

    def get(self, key: str) -> bytes | None:
        value = self.inner.get(key)
        if self.on_get is not None:
            self.on_get(key, value)
        return value

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put(self, key: str, value: bytes) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Any) -> None:
        items = list(items.items() if hasattr(items, "items") else items)
        if self.on_put is not None:
            self.on_put(items)
        self.inner.put_many(items)

    def __getattr__(self, name: str) -> Any:  # contains, delete, keys, close...
        return getattr(self.inner, name)


class DelayProxy:
    """A loopback TCP proxy that holds every server->client read for ``delay_s`` (a slow link)."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="delay-proxy").start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.delay_s), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for s in self._conns:
            s.close()


@contextmanager
def redis_server() -> Iterator[Any]:
    """A private ``redis-server`` (``cachegen_core.testing.redis_server``), stopped afterwards."""
    with running_redis_server() as server:
        yield server


# ------------------------------------------------------------------ engine scenarios
def plant(engine: KVEngine, text: str, blobs: Callable[[int, bytes], bytes], chunks: Sequence[int]) -> None:
    """Replace the stored blob of each of ``chunks`` (at the engine's level) by ``blobs(index, blob)``."""
    for c in engine.chunks(text):
        if c.index in chunks:
            key = blob_key(c.key, engine.level)
            engine.store.put(key, blobs(c.index, engine.store.get(key)))


def scenario_foreign_blob(bench: Bench, n: int = 3) -> dict[str, Any]:
    """Blobs of another model (same tokenizer and vocabulary) planted under this model's keys."""
    tally = Tally("foreign-model blob")
    other = Bench.tiny(seed=1)
    with counting_warnings() as w:
        for i in range(n):
            text = prompt(100 + i)
            eng = bench.engine(MemoryStore())
            eng.generate(text, max_new_tokens=1)  # stores our chunks
            foreign = other.engine(MemoryStore())
            kv = foreign.calculate_kv(text)
            plant(eng, text, lambda j, _, f=foreign, kv=kv: f.codec.encode(kv.slice(j * CHUNK, (j + 1) * CHUNK), 0), range(3))
            tally.ask(bench, eng, text, bad_chunks=0)
    return tally.row(w)


def scenario_other_codec_blob(bench: Bench, n: int = 3) -> dict[str, Any]:
    """Blobs of this model under another codec configuration / profile planted under our keys."""
    from cachegen_core.codec.kvcodec import KVCodec  # noqa: PLC0415
    from cachegen_core.codec.config import CodecConfig  # noqa: PLC0415
    from cachegen_core.codec.profile import Profile  # noqa: PLC0415

    tally = Tally("other-codec blob")
    with counting_warnings() as w:
        for i in range(n):
            text = prompt(110 + i)
            eng = bench.engine(MemoryStore())
            eng.generate(text, max_new_tokens=1)
            kv = eng.calculate_kv(text)
            cfg = CodecConfig(sink_tokens=4) if i % 2 == 0 else CodecConfig()
            prof = None if i % 2 == 0 else Profile.fit(cfg, [kv], chunk_tokens=CHUNK, model_fingerprint=eng.fingerprint)
            other = KVCodec(cfg, prof, fingerprint=eng.fingerprint)  # same model, other codec or profile
            plant(eng, text, lambda j, _, o=other, kv=kv: o.encode(kv.slice(j * CHUNK, (j + 1) * CHUNK), 0), range(3))
            tally.ask(bench, eng, text, bad_chunks=0)
    return tally.row(w)


def corruptions(engine: KVEngine, rng: random.Random) -> list[tuple[str, Callable[[int, bytes], bytes]]]:
    """Ways to spoil a stored blob: byte damage, truncation, garbage, and forged well-formed blobs
    of this very model and codec (valid CRCs) with the wrong shape, tokens or non-finite values."""
    def flip(_: int, b: bytes) -> bytes:
        x = bytearray(b)
        x[rng.randrange(len(x))] ^= 1 << rng.randrange(8)
        return bytes(x)

    def forge(change: Callable[[Any], Any]) -> Callable[[int, bytes], bytes]:
        def make(_: int, b: bytes) -> bytes:
            kv = engine.codec.decode(b)
            return engine.codec.encode(change(kv), engine.level)

        return make

    from cachegen_core.kv import KVCache  # noqa: PLC0415

    return [
        ("bit flip", flip),
        ("truncated", lambda _, b: b[: rng.randrange(len(b))]),
        ("garbage", lambda _, b: rng.randbytes(len(b))),
        ("empty", lambda _, b: b""),
        ("forged header: level", lambda _, b: repack_header(b, lambda h: h.update(level=3))),  # valid CRC, other level
        ("forged: fewer layers", forge(lambda kv: KVCache(kv.keys[:-1], kv.values[:-1]))),
        ("forged: fewer kv heads", forge(lambda kv: KVCache(kv.keys[:, :1], kv.values[:, :1]))),
        ("forged: smaller head_dim", forge(lambda kv: KVCache(kv.keys[..., :8], kv.values[..., :8]))),
        ("forged: fewer tokens", forge(lambda kv: kv.slice(0, CHUNK - 3))),
    ]


def scenario_corrupted_blob(bench: Bench) -> dict[str, Any]:
    """Every kind of spoiled blob in the store, in the first and in a middle chunk."""
    tally = Tally("corrupted blob in store")
    rng = random.Random(0)
    kinds: list[str] = []
    with counting_warnings() as w:
        for i, where in enumerate((0, 1)):
            text = prompt(120 + i)
            eng = bench.engine(MemoryStore())
            eng.generate(text, max_new_tokens=1)
            good = {c.index: eng.store.get(blob_key(c.key, 0)) for c in eng.chunks(text)}
            for name, spoil in corruptions(eng, rng):
                kinds.append(name)
                for idx, blob in good.items():
                    eng.store.put(blob_key(eng.chunks(text)[idx].key, 0), blob)
                plant(eng, text, spoil, [where])
                info = tally.ask(bench, eng, text, bad_chunks=where)
                if name == "forged header: level" and info is not None:  # a relabelled blob is the same KV: fine
                    tally.wrong_kv_accepted -= int(info.cached_tokens > where * CHUNK)
    row = tally.row(w)
    row["corruptions"] = sorted(set(kinds))
    return row


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
    for root, dirs, files in os.walk(d):
        os.chmod(root, 0o755)
    import shutil  # noqa: PLC0415

    shutil.rmtree(d, ignore_errors=True)
    return row


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
        eng.flush(timeout=HANG_S)  # chunks dropped while the queue was full are queued again by these two
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


# -------------------------------------------------------------------------- fuzzing
def scenario_fuzz(inputs: int, seconds: float, seed: int = 0) -> list[dict[str, Any]]:
    """The structured fuzzer, one row per target (container, codec, every coder)."""
    H.warm_up()
    rep = H.run(inputs, seconds, seed=seed)
    rows = []
    for name, t in rep.targets.items():
        s = t.summary()
        o = t.outcomes
        rows.append({
            "scenario": f"fuzz-{name}",
            "inputs": s["inputs"],
            "crashes": o["crash"],
            "hangs": o["hang"],
            "wrong_kv_accepted": o["wrong_kv_accepted"],
            "answered": o["decoded"] + o["rejected"] + o["forged_accepted"],
            "requests": s["inputs"],
            "decoded": o["decoded"],
            "rejected": o["rejected"],
            "forged_accepted": o["forged_accepted"],
            "overalloc": o["overalloc"],
            "max_input_s": s["max_input_s"],
            "max_peak_over_bound": s["max_peak_over_bound"],
        })  # fmt: skip
    prof = H.run_profiles(max(200, inputs // 20), seed=seed)
    o = prof.outcomes
    rows.append({"scenario": "fuzz-profile-file", "inputs": prof.inputs, "crashes": o["crash"], "hangs": o["hang"],
                 "wrong_kv_accepted": 0, "answered": o["decoded"] + o["rejected"], "requests": prof.inputs,
                 "rejected": o["rejected"], "loaded": o["decoded"], "overalloc": o["overalloc"]})  # fmt: skip
    return rows


def scenario_libfuzzer(seconds: float) -> dict[str, Any]:
    res = native.run(seconds)
    if not res.get("available"):
        return {"scenario": "fuzz-native-libfuzzer", "skipped": res.get("reason", "")[:200]}
    return {"scenario": "fuzz-native-libfuzzer", "inputs": res["inputs"], "crashes": res["crashes"], "hangs": res["hangs"],
            "wrong_kv_accepted": 0, "answered": res["inputs"] if not res["crashes"] else 0, "requests": res["inputs"],
            "seconds": res["seconds"], "sanitizers": "address,undefined"}  # fmt: skip


# ----------------------------------------------------------------------------- main
ENGINE_SCENARIOS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "foreign-model blob": scenario_foreign_blob,
    "other-codec blob": scenario_other_codec_blob,
    "corrupted blob in store": scenario_corrupted_blob,
    "redis killed mid-stream": scenario_redis_killed_mid_stream,
    "redis restarted": scenario_redis_restarted,
    "redis cluster failover": scenario_redis_cluster_failover,
    "slow redis": scenario_slow_redis,
    "diskcache full": scenario_diskcache_full,
    "read-only cache dir": scenario_read_only_dir,
    "concurrent 8 threads": scenario_concurrent,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer fuzz inputs (2000 instead of 20000; the 100k run is benchmarks.fuzz), shorter libFuzzer run",
    )
    ap.add_argument("--only", nargs="*", default=None, help="scenario names (or prefixes) to run")
    ap.add_argument("--fuzz-inputs", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # warnings are counted per scenario, not printed
    torch.manual_seed(args.seed)

    def wanted(name: str) -> bool:
        return args.only is None or any(name.startswith(o) for o in args.only)

    bad = 0

    def emit(row: dict[str, Any]) -> None:
        nonlocal bad
        print(json.dumps(row), flush=True)
        bad += row.get("crashes", 0) + row.get("hangs", 0) + row.get("wrong_kv_accepted", 0)
        bad += row.get("requests", 0) - row.get("answered", 0) if "skipped" not in row else 0

    if wanted("fuzz"):
        inputs = args.fuzz_inputs or (2000 if args.quick else 20_000)
        for row in scenario_fuzz(inputs, 3600, args.seed):
            emit(row)
        emit(scenario_libfuzzer(10 if args.quick else 120))
    bench = Bench.tiny()
    for name, fn in ENGINE_SCENARIOS.items():
        if wanted(name):
            t = time.perf_counter()
            row = fn(bench)
            row.setdefault("seconds", round(time.perf_counter() - t, 2))
            emit(row)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
