"""Warm time to first token of every way to reuse a stored context, on every store and link (issue 15).

    python -m benchmarks.warm_path [--quick] [--runs N] [--data F] [--device cpu|cuda] [--out F] [--plot F.png]
    python -m benchmarks.warm_path --device cuda --model llama-7b-shaped --contexts 7680 30720 \
        --stores memory disk emulated@10gbps emulated@25gbps   # the GPU table: a 7B-shaped model, timing only

For contexts of about 3K and 7.5K tokens (held-out LongChat transcripts, a question after
them), the time from the request to the first generated token of:

- ``text``: no cache, the whole prompt prefilled;
- ``fp16``, ``uniform8``: the naive formats, the same chunks stored as plain fp16 bytes or as
  8-bit codes (per-channel keys, per-token values, fp16 scales: KIVI/KVQuant practice) under
  plain keys of the same store, fetched with the next chunk's fetch overlapping this chunk's
  conversion, converted into a cache the model extends in place, allocated once and reused by
  every request as the engine reuses its own (the strongest honest version of "keep the KV");
- ``fp16-pinned``: the hardware's floor, transformers alone: the context's KV in pinned host memory
  (plain memory without a GPU), copied to the device, the question prefilled on it (``naive_kv.py``);
- ``cachegen-L``: the engine pinned to level L (only L stored, text never chosen); ``cachegen-raw``: pinned
  to the 16-bit raw form;
- ``cachegen-auto``: the engine as shipped (default stored options, no deadline: the fastest
  option at least as fine as the default level).

``miss-path`` rows: the cost of storing on a miss. Several distinct contexts answered cold, one
after the other, by an engine that stores them (its background writer running beside the next
requests) and by an engine over the same model whose writer drops every chunk (nothing encoded,
nothing written), alternating per context; ``overhead`` is the ratio of their total latencies
minus one. The contexts share their first tokens (the transcripts' common header), so after the
first one a storing engine reuses a 64-token partial chunk and prefills the rest after it.

Stores: ``memory``, ``disk`` (diskcache in a temp dir), ``redis`` (a real redis-server on
loopback), and the same server behind a TCP proxy shaped to 1 and 0.2 Gbit/s (and to 10 Gbit/s,
``redis@10gbps``, when asked: the proxy forwards about 8.4 Gbit/s at most on a 2-core box,
``docs/history/2026-11-24-results-journal.md``, "What the shaped links deliver", so that link is for bigger hosts), and links
emulated in the process at 0.5, 1, 10, 25 and 100 Gbit/s (``emulated@10gbps``: a memory store behind
the link clock of ``emulated_link.py``, reads pipelined with decoding; at 0.5 and 1 Gbit/s it can be
checked against the proxy, ``redis@0.5gbps``/``redis@1gbps``, in the same run). ``--model llama-7b-shaped`` (``benchmarks.common.load``): a Llama of 7B shape
with random weights and the reference tokenizer, in ``--dtype`` (bfloat16 by default), for timing
only: its rows say ``"random_init": true``; its answers and any quality mean nothing. Every policy
is warmed up (the engine learns its costs and the link) before it is timed; a row is the
median of ``--reps`` runs, the policies taking turns run by run (a drift of a shared box reaches them alike), each
timed once every engine's background work is done (its writer's stages, its cost probes: ``quiet``).
``bound_s`` = bytes / link bandwidth (none for local stores) + decoding the levels' symbols at the native coder's rANS
rate measured here + the question's prefill on the reused KV (measured here): what no implementation of that policy
could beat.
JSON lines: ``{"store", "link_gbps", "context_tokens", "policy", "ttft_s", "bytes", "fetch_s", "decode_s",
"bound_s", "run", ...}`` (the engine's rows: ``options`` chosen per chunk and ``requests``, every timed request's
figures); a summary line per (store, context, run) gives ``cachegen-auto``'s ratio to ``fp16``. ``--runs N`` (default 5)
repeats the whole measurement N times, each with a fresh store and fresh engines (an engine learns its costs anew, so
its choices may differ run to run: one run says little), the runs taking turns with the stores; after them a
``vs_fp16_over_runs`` line per (store, context, policy: ``compared``) gives the median, min and max over the runs of ``fp16``'s TTFT
over the policy's (above 1: sooner than fp16 bytes from the same store).
``--plot F.png``: TTFT against context length, a panel per store (the median of the runs).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from benchmarks.common import HELD_OUT, Rows, best_time, fresh_store, is_shaped, load, long_transcripts, parser, setup_threads
from benchmarks.naive_kv import NAIVE, pinned_copy, pinned_ttft
from benchmarks.warm_summary import plot, run_summary, runs_summary
from cachegen_core.engine import KVEngine
from cachegen_core.engine.model import hf
from cachegen_core.engine.chunks.options import exact16
from cachegen_core.kv import KVCache, empty_tensor

QUESTION = "\nUSER: What is the first topic we discussed? ASSISTANT:"
LINKS = {"redis@1gbps": 1.0, "redis@0.5gbps": 0.5, "redis@0.2gbps": 0.2, "redis@10gbps": 10.0}
#: Links emulated in the process (``emulated_link.py``): a memory store behind a link clock, for rates the proxy cannot pace.
EMULATED = {f"emulated@{g}gbps": float(g) for g in ("0.5", "1", "10", "25", "100")}
DEFAULT_STORES = ["memory", "disk", "redis", "redis@1gbps", "redis@0.2gbps"]
POLICIES = ["text", "fp16", "uniform8", "fp16-pinned", "cachegen-auto", "cachegen-raw", *(f"cachegen-{lv}" for lv in range(5))]


# ------------------------------------------------------------------ stores and links
def open_store(kind: str, redis_url: str | None) -> contextlib.AbstractContextManager[Any]:
    """An empty store of ``kind``; Redis kinds (the server itself or a shaped link to it) at ``redis_url``.
    A shaped link stands for a server on another machine: not ``same_host``, though its proxy listens on loopback.
    An emulated link: a memory store behind a link clock (``emulated_link.LinkStore``), remote to the engine."""
    if kind in EMULATED:
        from benchmarks.emulated_link import LinkStore  # noqa: PLC0415
        from cachegen_core.stores import MemoryStore  # noqa: PLC0415

        return LinkStore(MemoryStore(namespace=f"warm-{kind}:"), EMULATED[kind])
    assert redis_url is not None or not kind.startswith("redis")
    remote = {"same_host": False} if kind in LINKS else {}
    return fresh_store(kind, redis_url, socket_timeout=600.0, namespace=f"warm-{kind}:", **remote)


@contextlib.contextmanager
def redis_links(kinds: list[str]) -> Iterator[dict[str, str]]:
    """URLs per store kind that needs Redis: the server itself, and proxies shaped to LINKS."""
    if not any(k.startswith("redis") for k in kinds):
        yield {}
        return
    from benchmarks.throttled_proxy import ThrottledProxy  # noqa: PLC0415
    from cachegen_core.testing import running_redis_server  # noqa: PLC0415

    with running_redis_server() as server, contextlib.ExitStack() as stack:
        urls = {"redis": server.url}
        for kind, gbps in LINKS.items():
            if kind in kinds:
                piece = max(64 << 10, int(gbps * 1e9 / 8 * 2e-4))  # 0.2 ms of the link a piece: 64 KB up to 2.6 Gbit/s
                proxy = stack.enter_context(ThrottledProxy(server.port, [gbps], slice_s=3600.0, shape_upload=False, piece_bytes=piece))
                urls[kind] = f"redis://{proxy.host}:{proxy.port}/0"
        yield urls


# ------------------------------------------------------------------ one context
class Context:
    """One prompt (transcript cut to ``tokens`` + the question), its KV, chunks and timing helpers."""

    def __init__(self, model: Any, tok: Any, text: str, tokens: int, chunk_tokens: int) -> None:
        ids = tok(text, add_special_tokens=True)["input_ids"][:tokens]
        self.model, self.tok, self.chunk_tokens = model, tok, chunk_tokens
        self.ids = ids + tok(QUESTION, add_special_tokens=False)["input_ids"]
        self.n_chunks = len(ids) // chunk_tokens
        self.covered = self.n_chunks * chunk_tokens
        self.kv = hf.prefill(model, self.ids[: self.covered])
        self.gen = {"max_new_tokens": 1}
        self._buffer: KVCache | None = None
        self.host: list[tuple[torch.Tensor, torch.Tensor]] = []  # the KV per layer in pinned host memory (fp16-pinned)

    def buffer(self) -> KVCache:
        """The context's cache, allocated once and reused by every request, as the engine reuses its buffers
        (``engine/serving/buffers.py``): no baseline pays for faulting in fresh memory the engine does not pay for."""
        if self._buffer is None:
            layers, heads, _, dim = self.kv.shape
            shape = (layers, heads, len(self.ids) + 2, dim)
            dtype, dev = hf.model_dtype(self.model), self.model.device
            self._buffer = KVCache(empty_tensor(shape, dtype, dev), empty_tensor(shape, dtype, dev))
        return self._buffer

    def text_ttft(self) -> float:
        out = hf.generate(self.model, self.tok, self.ids, None, time.perf_counter(), self.gen)
        return out.ttft_s or 0.0

    def question_ttft(self) -> float:
        """The question's prefill on the whole reused KV, nothing to fetch: part of every bound."""
        buf = self.buffer()
        buf.keys[:, :, : self.covered].copy_(self.kv.keys)
        buf.values[:, :, : self.covered].copy_(self.kv.values)
        out = hf.generate(self.model, self.tok, self.ids, buf, time.perf_counter(), self.gen, filled=self.covered)
        return out.ttft_s or 0.0

    def naive_ttft(self, store: Any, fmt: str, prefix: str) -> dict[str, float]:
        """Fetch the chunks in ``fmt`` (next fetch overlapping this conversion), convert into the cache, generate."""
        unpack = NAIVE[fmt][1]
        t0 = time.perf_counter()
        buf, got, convert_s = self.buffer(), 0, 0.0
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(store.get, f"{prefix}{fmt}-{0}")
            for i in range(self.n_chunks):
                blob = pending.result()
                if i + 1 < self.n_chunks:
                    pending = pool.submit(store.get, f"{prefix}{fmt}-{i + 1}")
                t = time.perf_counter()
                unpack(blob, buf.slice(i * self.chunk_tokens, (i + 1) * self.chunk_tokens))
                convert_s += time.perf_counter() - t
                got += len(blob)
        out = hf.generate(self.model, self.tok, self.ids, buf, t0, self.gen, filled=self.covered)
        return {"ttft_s": out.ttft_s or 0.0, "bytes": got, "decode_s": convert_s}

    def store_naive(self, store: Any, prefix: str, formats: list[str]) -> None:
        for fmt, (pack, _) in NAIVE.items():
            for i in range(self.n_chunks if fmt in formats else 0):
                store.put(f"{prefix}{fmt}-{i}", pack(self.kv.slice(i * self.chunk_tokens, (i + 1) * self.chunk_tokens)))


def settled(engine: KVEngine) -> KVEngine:
    """``engine`` once the profile it may be fitting in the background (a model without one) is done: its fit
    would share the device and cores with every row timed (the engine keeps coding without it)."""
    if engine.profile_fitter is not None:
        t = time.perf_counter()
        engine.profile_fitter.done.wait()
        print(f"# waited {time.perf_counter() - t:.0f} s for the background profile fit", file=sys.stderr)
    return engine


def quiet(engines: dict[str, KVEngine]) -> None:
    """Every engine's background work done: the writer's queued stages and the cost probes (a level's decode, one native
    call a request cannot pause). The policies take turns, so a probe an engine started after its request would
    otherwise run beside the next policy's timed request, on the same cores (without this wait, on 2 cores, the memory
    store's cachegen-auto once answered in 0.59 s with the raw chunks it had answered with in 0.23 s just before, a
    probe's level decode timed at 0.71 s meanwhile)."""
    for e in engines.values():
        e.flush()
        e.prober.join(120)


def engine_ttft(engine: KVEngine, ids: list[int]) -> dict[str, Any]:
    _, info = engine.generate(ids, max_new_tokens=1)
    if info.errors:
        raise RuntimeError(f"the engine reported errors: {info.errors}")
    return {"ttft_s": info.ttft_s, "bytes": info.bytes_fetched, "fetch_s": info.fetch_s, "decode_s": info.decode_s,
            "cached_tokens": info.cached_tokens, "options": list(info.levels)}  # fmt: skip


def rans_rate(engine: KVEngine, kv: KVCache) -> float:
    """Symbols per second of the native rANS decoder alone on this chunk (tables built outside the timing)."""
    codec = engine.codec
    p = codec.prepare(kv, codec.config.default_level, start=0)
    payloads = codec.coder.encode(p.symbols, p.layout, p.freqs)
    codec.coder.decode(payloads, p.layout, p.freqs)  # warm-up: tables converted and cached
    best = best_time(lambda: codec.coder.decode(payloads, p.layout, p.freqs), 3)[0]
    return p.layout.n_symbols / best


# ------------------------------------------------------------------ the run
def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, device=True, quick_help="one 3K context, one transcript, one rep a run (unless --reps says)")
    ap.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="the model's dtype (default: as saved; bfloat16 for a shaped model)"
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[3072, 7680], help="context tokens (multiples of the chunk)")
    ap.add_argument("--transcripts", type=int, default=2, help=f"held-out transcripts ({HELD_OUT}, {HELD_OUT + 1}, ...) per context length")
    ap.add_argument("--stores", nargs="+", default=DEFAULT_STORES, choices=["memory", "disk", "redis", *LINKS, *EMULATED])
    ap.add_argument("--reps", type=int, default=None, help="timed requests per policy, a row their median (default 3, 1 with --quick)")
    ap.add_argument("--runs", type=int, default=5, help="whole measurements, each with a fresh store and engines (default: %(default)s)")
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    ap.add_argument("--miss-contexts", type=int, default=None, help="distinct contexts for the miss-path rows (0: none; default 4, 2 with --quick)")
    ap.add_argument(
        "--policies",
        nargs="+",
        default=POLICIES,
        choices=POLICIES,
        help="the policies timed (default: all; e.g. a longer A/B of a few, without text's long prefills)",
    )
    ap.add_argument("--plot", default=None, metavar="F.png", help="TTFT against context length, a panel per store (PNG)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    with Rows("warm_path", args.out, argv) as out:
        run(args, out)


def run(args: argparse.Namespace, out: Rows) -> None:
    if args.quick:
        args.contexts, args.transcripts = [3072], 1
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.miss_contexts is None:
        args.miss_contexts = 2 if args.quick else 4
    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    setup_threads()
    model, tok = load(args.model, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    t_start = time.perf_counter()
    with redis_links(args.stores) as urls:
        for tokens in args.contexts:
            texts = long_transcripts(args.data, HELD_OUT, args.transcripts, tok, tokens)  # joined past one transcript's length
            contexts = [Context(model, tok, t, tokens, args.chunk_tokens) for t in texts]
            runs: dict[str, list[list[dict[str, Any]]]] = {}  # per store, each run's rows
            for run_i in range(args.runs):  # the runs outside the stores: a drift of the box reaches every store alike
                for store_kind in args.stores:
                    link = LINKS.get(store_kind, EMULATED.get(store_kind))
                    rows = _measure_store(args, model, tok, contexts, store_kind, urls.get(store_kind, urls.get("redis")), link)
                    for r in rows:
                        r["run"] = run_i
                        out.emit(r)
                    runs.setdefault(store_kind, []).append(rows)
                    run_summary(rows, store_kind, tokens, out, run_i)
                    # once each store's engines and kept buffers stayed alive (20 GB at 7.5K by the disk store, the page
                    # cache evicted): they are closed now, and anything else left in a cycle is collected here
                    gc.collect()
                print(f"# {tokens} tokens, run {run_i + 1} of {args.runs} done at {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
            for store_kind in args.stores:
                for r in runs_summary(runs[store_kind]):
                    out.emit(r)
                if args.miss_contexts and store_kind in ("memory", "disk", "redis"):
                    miss_texts = long_transcripts(args.data, HELD_OUT + 2, args.miss_contexts, tok, tokens)
                    out.emit(miss_path(args, model, tok, store_kind, urls.get(store_kind), tokens, miss_texts))
                    gc.collect()
    if args.plot:
        plot(out.rows, args.plot)


def _measure_store(args: Any, model: Any, tok: Any, contexts: list[Context], kind: str, url: str | None, link: float | None) -> list[dict[str, Any]]:
    from cachegen_core.engine import KVEngine  # noqa: PLC0415

    results: dict[str, list[dict[str, Any]]] = {}
    requests: dict[str, list[dict[str, Any]]] = {}  # every timed request, per policy
    bounds: dict[str, list[float]] = {}
    with open_store(kind, url) as store:
        engines = {"cachegen-auto": settled(KVEngine.from_pretrained(model, tokenizer=tok, store=store, chunk_tokens=args.chunk_tokens))}
        codec = engines["cachegen-auto"].codec
        pinned = {f"cachegen-{lv}": lv for lv in codec.levels} | {"cachegen-raw": exact16(hf.model_dtype(model))}
        for name, lv in pinned.items():
            if name in args.policies:
                engines[name] = KVEngine(model, tok, codec, store, chunk_tokens=args.chunk_tokens, level=lv, store_options=[lv],
                                         allow_text=False)  # fmt: skip
        rate = rans_rate(engines["cachegen-auto"], contexts[0].kv.slice(0, args.chunk_tokens))
        for ci, ctx in enumerate(contexts):
            prefix = f"ctx{ci}-"
            ctx.store_naive(store, prefix, args.policies)
            for e in engines.values():
                e.generate(ctx.ids, max_new_tokens=1)  # cold: computes and stores
                e.flush()
            question_s = statistics.median(ctx.question_ttft() for _ in range(max(1, args.reps)))
            if "fp16-pinned" in args.policies and not ctx.host:
                ctx.host = pinned_copy(ctx.kv)  # once per context (pinning 4 GB takes seconds), shared by the stores
            wire = (lambda n: n / (link * 1e9 / 8)) if link else (lambda n: 0.0)
            policies: dict[str, Callable[[], dict[str, Any]]] = {
                "text": lambda ctx=ctx: {"ttft_s": ctx.text_ttft(), "bytes": 0, "decode_s": 0.0},
                **{fmt: (lambda fmt=fmt, ctx=ctx, prefix=prefix: ctx.naive_ttft(store, fmt, prefix)) for fmt in NAIVE},
                "fp16-pinned": lambda ctx=ctx: pinned_ttft(model, ctx.host, ctx.ids[ctx.covered :]),
                **{name: (lambda e=e, ctx=ctx: engine_ttft(e, ctx.ids)) for name, e in engines.items()},
            }
            policies = {name: run for name, run in policies.items() if name in args.policies}
            for name, run in policies.items():
                warm = 2 if name == "cachegen-auto" else 1  # the adaptive engine learns the link and its decode costs
                for _ in range(warm):
                    run()
            reps: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
            for _ in range(max(1, args.reps)):  # interleaved: a drift of the box's speed reaches every policy alike
                for name, run in policies.items():
                    quiet(engines)  # no policy timed beside another's background work (nor its own last request's)
                    reps[name].append(run())
            for name, runs in reps.items():
                requests.setdefault(name, []).extend(runs)
                mid = sorted(runs, key=lambda r: r["ttft_s"])[len(runs) // 2]
                results.setdefault(name, []).append(mid)
                symbols = ctx.kv.num_elements if name.startswith("cachegen-") and mid.get("options") and all(
                    isinstance(o, int) for o in mid["options"]) else 0  # fmt: skip
                bound = (wire(mid["bytes"]) + symbols / rate + question_s) if name != "text" else mid["ttft_s"]
                bounds.setdefault(name, []).append(bound)
        for e in engines.values():
            e.close()  # their kept buffers (up to 2 x 355 MB each at 7.5K) before the next store's
    rows = []
    for name, rs in results.items():
        row = {
            "store": kind, "link_gbps": link, "context_tokens": contexts[0].covered, "prompt_tokens": len(contexts[0].ids),
            "policy": name, "ttft_s": round(statistics.mean(r["ttft_s"] for r in rs), 4),
            "bytes": int(statistics.mean(r["bytes"] for r in rs)), "decode_s": round(statistics.mean(r["decode_s"] for r in rs), 4),
            "fetch_s": round(statistics.mean(r.get("fetch_s", 0.0) for r in rs), 4),
            "bound_s": round(statistics.mean(bounds[name]), 4), "transcripts": len(rs), "reps": args.reps,
            "device": str(model.device), "rans_msym_s": round(rate / 1e6, 1),
            "model": args.model, "dtype": str(hf.model_dtype(model)).removeprefix("torch."), "random_init": is_shaped(args.model),
        }  # fmt: skip
        if any("options" in r for r in rs):
            row["options"] = [r.get("options") for r in rs]
            row["requests"] = [{k: r[k] for k in ("ttft_s", "bytes", "fetch_s", "decode_s", "options")} for r in requests[name]]
        rows.append(row)
    return rows


class _NoStore:
    """A store that keeps nothing: the engine then only computes (the miss path's baseline)."""

    namespace, local = "", True

    def get_many(self, keys: list[str]) -> list[None]:
        return [None] * len(keys)

    def get(self, key: str) -> None:
        return None

    def put(self, key: str, value: bytes) -> None:
        pass

    def put_many(self, items: Any) -> None:
        pass


def miss_path(args: Any, model: Any, tok: Any, kind: str, url: str | None, tokens: int, texts: list[str]) -> dict[str, Any]:
    """Cold requests on distinct contexts, storing vs not storing, on a warm engine: the overhead of storing."""
    prompts = [Context(model, tok, t, tokens, args.chunk_tokens).ids for t in texts]
    with open_store(kind, url) as store:
        storing = settled(KVEngine.from_pretrained(model, tokenizer=tok, store=store, chunk_tokens=args.chunk_tokens))
        plain = KVEngine(model, tok, storing.codec, _NoStore(), chunk_tokens=args.chunk_tokens, background=False)  # type: ignore[arg-type]
        plain.writer.submit = lambda chunk, kv: False  # type: ignore[method-assign]  # storing off: every chunk dropped
        plain.generate(prompts[0][:64], max_new_tokens=1)  # warm engines: first-call costs paid
        storing.generate(prompts[0][:64], max_new_tokens=1)
        times: dict[str, list[float]] = {"plain": [], "storing": []}
        for ids in prompts:
            for name, eng in (("plain", plain), ("storing", storing)):
                _, info = eng.generate(ids, max_new_tokens=8)
                times[name].append(info.total_s)
        storing.close()
        plain.close()
    cold, base = sum(times["storing"]), sum(times["plain"])
    return {"store": kind, "link_gbps": LINKS.get(kind, EMULATED.get(kind)), "context_tokens": tokens, "policy": "miss-path", "contexts": len(prompts),
            "storing_s": round(cold, 3), "plain_s": round(base, 3), "overhead": round(cold / base - 1, 4),
            "per_request_storing_s": [round(t, 3) for t in times["storing"]], "per_request_plain_s": [round(t, 3) for t in times["plain"]]}  # fmt: skip


if __name__ == "__main__":
    main()
