"""Time to first token measured end to end: the engine streams a stored context from a real
redis-server through a loopback TCP proxy shaped to each bandwidth trace.

    python -m benchmarks.ttft_live [--quick] [--traces FILE] [--bandwidth-scale S] [--slice-s T] [--out F]

This checks on a real socket what the event timeline of ``benchmarks.ttft`` predicts. A
context of ``--context-tokens`` tokens is stored at every level over a direct connection;
then every policy answers the context + a question (one new token) through a
:class:`~benchmarks.throttled_proxy.ThrottledProxy` whose trace is restarted before each
run, so every policy sees the same bandwidth timeline:

- ``cachegen-fixed-L`` / ``cachegen-adaptive`` / ``cachegen-adaptive-last``: ``KVEngine.generate``
  pinned to level L (the only option streamed, text never), or with ``slo_s`` choosing per chunk
  among the five levels and text with the harmonic / last-sample estimator (a fresh estimator per
  run; the engine's decode and prefill measurements are warmed by the runs before). Chunks are
  stored at levels 0-4 only: the engine's raw 16-bit forms are ``fp16``'s bytes, timed on their own;
- ``fp16`` / ``uniform8``: each chunk's KV as raw fp16, or per-token 8-bit codes with fp16
  scales, in Redis, fetched through the same proxy (fetch i+1 overlaps the conversion of i);
- ``text``: recompute the whole prompt (no link).

SLOs are 0.5x, 1x and 2x the measured text time. One JSON line per (trace, policy, SLO)
with the keys of ``benchmarks.ttft`` plus ``predicted_ttft_s``: the timeline's prediction
for the same run from the sizes stored and the engine's measured decode and prefill costs.
Then one summary line per policy. Pure-Python pacing tops out at about 1-3 Gbit/s on
loopback, so traces are scaled down (``--bandwidth-scale``) to stay below that.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from benchmarks.common import HELD_OUT, TRACES, Rows, parser, read_jsonl, setup_threads, transcripts
from benchmarks.throttled_proxy import ThrottledProxy
from benchmarks.ttft import Link, Workload, quality_of, simulate, summarise
from cachegen_core.kv import KVCache
from cachegen_core.streaming import TEXT, ChunkCost, make_estimator

QUESTION = "\nUSER: What is the first topic we discussed? ASSISTANT:"


# ------------------------------------------------------------------ baseline wire formats
def pack_fp16(kv: KVCache) -> bytes:
    """Keys then values, fp16, C order."""
    return b"".join(x.to(torch.float16).contiguous().numpy().tobytes() for x in (kv.keys, kv.values))


def unpack_fp16(blob: bytes, shape: tuple[int, int, int, int]) -> KVCache:
    """Inverse of :func:`pack_fp16` (no object deserialisation: a flat fp16 array)."""
    x = torch.from_numpy(np.frombuffer(blob, dtype=np.float16).copy()).float().reshape(2, *shape)
    return KVCache(x[0], x[1])


def pack_uniform8(kv: KVCache) -> bytes:
    """Per-token asymmetric 8-bit (``benchmarks.baselines.uniform_per_token``): uint8 codes, then fp16 zero and scale per (layer, token)."""
    out = []
    for x in (kv.keys, kv.values):
        layers, heads, tokens, dim = x.shape
        t = x.float().permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)
        lo = t.amin(dim=2, keepdim=True).half().float()
        scale = ((t.amax(dim=2, keepdim=True) - lo) / 255).clamp_min(1e-8).half().float()
        q = torch.round((t - lo) / scale).clamp_(0, 255).to(torch.uint8)
        out += [q.numpy().tobytes(), lo.half().numpy().tobytes(), scale.half().numpy().tobytes()]
    return b"".join(out)


def unpack_uniform8(blob: bytes, shape: tuple[int, int, int, int]) -> KVCache:
    """Inverse of :func:`pack_uniform8` up to half a step."""
    layers, heads, tokens, dim = shape
    n, m = layers * tokens * heads * dim, layers * tokens
    parts, at = [], 0
    for _ in range(2):
        q = torch.from_numpy(np.frombuffer(blob, np.uint8, n, at).copy()).float().reshape(layers, tokens, heads * dim)
        lo = torch.from_numpy(np.frombuffer(blob, np.float16, m, at + n).copy()).float().reshape(layers, tokens, 1)
        scale = torch.from_numpy(np.frombuffer(blob, np.float16, m, at + n + 2 * m).copy()).float().reshape(layers, tokens, 1)
        at += n + 4 * m
        parts.append((lo + q * scale).reshape(layers, tokens, heads, dim).permute(0, 2, 1, 3).contiguous())
    return KVCache(*parts)


def fetch_pipelined(get: Callable[[int], bytes], n: int, convert: Callable[[bytes], KVCache]) -> KVCache:
    """Fetch ``n`` blobs in a worker thread, converting blob i while blob i+1 arrives."""
    parts = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(get, 0)
        for i in range(n):
            blob = pending.result()
            if i + 1 < n:
                pending = pool.submit(get, i + 1)
            parts.append(convert(blob))
    return KVCache.concat(parts)


# ------------------------------------------------------------------ the runs
def _row(trace: int, policy: str, factor: float, text_s: float, r: dict[str, Any], pred: dict[str, Any], args: Any,
         out: Rows) -> dict[str, Any]:  # fmt: skip
    """One JSON line (emitted) for a measured run ``r`` and the timeline's prediction ``pred`` of it."""
    used = [o for o in r["options"] if isinstance(o, int)]
    row = {"trace": trace, "policy": policy, "slo_s": round(factor * text_s, 3), "slo_factor": factor,
           "ttft_s": round(r["ttft_s"], 4), "predicted_ttft_s": pred["ttft_s"], "slo_met": r["ttft_s"] <= factor * text_s,
           "mean_level": round(float(np.mean(used)), 3) if used else None, "text_chunks": sum(o == TEXT for o in r["options"]),
           "options": r["options"], "bytes": r["bytes"], "context_tokens": args.context_tokens,
           "bandwidth_scale": args.bandwidth_scale}  # fmt: skip
    q = [args.quality_of.get(o) for o in r["options"]] if policy not in ("fp16", "uniform8") else [args.quality_of.get(policy)]
    row["quality_proxy"] = round(float(np.mean(q)), 5) if q and None not in q else None
    out.emit(row)
    return row


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="3 chunks, the first trace, SLO 1x only")
    ap.add_argument("--traces", default=str(TRACES))
    ap.add_argument("--context-tokens", type=int, default=7680)
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    ap.add_argument("--slice-s", type=float, default=0.5, help="seconds per bandwidth sample")
    ap.add_argument("--bandwidth-scale", type=float, default=0.02, help="multiply every trace sample")
    ap.add_argument("--quality", default="docs/data/quality_size_v3_held_out_profile_v5.jsonl", help="ppl_rel_delta per level, for quality_proxy")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    with Rows("ttft_live", args.out, argv) as out:
        run(args, out)


def run(args: argparse.Namespace, out: Rows) -> None:
    traces = [[g * args.bandwidth_scale for g in r["bw_gbps"]] for r in read_jsonl(args.traces)]
    factors = (0.5, 1.0, 2.0)
    if args.quick:
        args.context_tokens, traces, factors = 3 * args.chunk_tokens, traces[:1], (1.0,)
    args.quality_of = quality_of(Path(args.quality), args.context_tokens)
    setup_threads()

    import redis  # noqa: PLC0415

    from cachegen_core.keys.chunks import blob_key  # noqa: PLC0415
    from cachegen_core.engine import KVEngine  # noqa: PLC0415
    from cachegen_core.stores import RedisStore  # noqa: PLC0415
    from cachegen_core.testing import running_redis_server  # noqa: PLC0415

    with running_redis_server() as server:
        url = server.url
        direct = RedisStore(url, namespace="ttft-live", same_host=False)  # the engine plans as for a remote server
        writer = KVEngine.from_pretrained(
            args.model, store=direct, chunk_tokens=args.chunk_tokens, background=False, store_options=list(range(5))
        )  # every level of the codec, no raw form
        if writer.codec.levels != list(range(5)):
            raise SystemExit(f"this benchmark stores levels 0-4; the codec has {writer.codec.levels}")
        tok = writer.tokenizer
        ids = tok(transcripts(args.data, HELD_OUT, 1)[0])["input_ids"][: args.context_tokens]
        prompt = ids + tok(QUESTION, add_special_tokens=False)["input_ids"]
        t = time.perf_counter()
        keys = writer.store_kv(ids)
        print(f"# stored {len(keys)} chunks at every level in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        kv = writer.calculate_kv(ids[: len(keys) * args.chunk_tokens])
        raw = redis.Redis.from_url(url)
        shapes, fp16_b, u8_b = [], [], []
        for i in range(len(keys)):
            part = kv.slice(i * args.chunk_tokens, (i + 1) * args.chunk_tokens)
            shapes.append(tuple(part.shape))
            for name, pack, sizes in (("fp16", pack_fp16, fp16_b), ("uniform8", pack_uniform8, u8_b)):
                blob = pack(part)
                raw.set(f"bench:{name}:{i}", blob)
                sizes.append(len(blob))
        levels = list(writer.codec.levels)
        blob_sizes = [{lv: len(direct.get(blob_key(k, lv)) or b"") for lv in levels} for k in keys]

        port = raw.connection_pool.connection_kwargs["port"]
        reader = KVEngine(
            writer.model, tok, writer.codec, direct, chunk_tokens=args.chunk_tokens, background=False, store_options=levels
        )  # streams levels (or text): the paper's choice, no raw form
        link: dict[str, Any] = {}
        dequant_s: list[float] = []

        def baseline(name: str) -> dict[str, Any]:
            unpack = unpack_fp16 if name == "fp16" else unpack_uniform8

            def convert(blob: bytes) -> KVCache:
                t = time.perf_counter()
                out = unpack(blob, shapes[0])
                if name == "uniform8":
                    dequant_s.append(time.perf_counter() - t)
                return out

            t0 = time.perf_counter()
            kv_b = fetch_pipelined(lambda i: link["client"].get(f"bench:{name}:{i}"), len(keys), convert)
            reader.generate_with_kv(kv_b, prompt, max_new_tokens=1)
            return {"ttft_s": time.perf_counter() - t0, "options": [], "bytes": sum(fp16_b if name == "fp16" else u8_b)}

        def text() -> dict[str, Any]:
            t0 = time.perf_counter()
            reader.generate_with_kv(None, prompt, max_new_tokens=1)
            return {"ttft_s": time.perf_counter() - t0, "options": [TEXT] * len(keys), "bytes": 0}

        def engine(level: int, slo: float | None, estimator: str = "harmonic") -> dict[str, Any]:
            """Without ``slo``: pinned to ``level`` (only it streamed, never text); with one: the controller over
            every level and text."""
            reader.level, reader.slo_s, reader.estimator = level, slo, make_estimator(estimator)
            reader.store_options, reader.allow_text = (levels, True) if slo is not None else ([level], False)
            _, info = reader.generate(prompt, max_new_tokens=1)
            if info.errors or len(info.levels) != len(keys):
                raise RuntimeError(f"the engine did not stream every chunk: {info.errors}")
            return {"ttft_s": info.ttft_s, "options": list(info.levels), "bytes": info.bytes_fetched}

        def workload() -> Workload:
            cm = reader.cost_model
            costs = [ChunkCost(s, {lv: cm.decode_s_per_token.get(lv, 0.0) * args.chunk_tokens for lv in levels},
                               args.chunk_tokens) for s in blob_sizes]  # fmt: skip
            tail = len(prompt) - len(keys) * args.chunk_tokens
            return Workload(costs, tail, cm.prefill_s_per_token, fp16_b, u8_b, float(np.mean(dequant_s)) if dequant_s else 0.0)

        # warm-up on the direct connection: the engine learns its prefill and per-level decode speed
        text()
        text_s = text()["ttft_s"]
        for lv in levels:
            engine(lv, None)
        print(f"# text (recompute {len(prompt)} tokens): {text_s:.2f} s", file=sys.stderr)
        rows: list[dict[str, Any]] = []
        for ti, trace in enumerate(traces):
            with ThrottledProxy(port, trace, args.slice_s) as proxy:
                proxy_url = f"redis://{proxy.host}:{proxy.port}/0"
                reader.store = RedisStore(proxy_url, namespace="ttft-live", socket_timeout=600.0, same_host=False)
                link["client"] = redis.Redis.from_url(proxy_url, socket_timeout=600.0)
                runs: list[tuple[str, float | None, Callable[[], dict[str, Any]]]] = [
                    ("fp16", None, lambda: baseline("fp16")),
                    ("uniform8", None, lambda: baseline("uniform8")),
                    *[(f"cachegen-fixed-{lv}", None, lambda lv=lv: engine(lv, None)) for lv in levels],
                ]
                for f in factors:
                    runs += [("cachegen-adaptive", f, lambda f=f: engine(0, f * text_s)),
                             ("cachegen-adaptive-last", f, lambda f=f: engine(0, f * text_s, "last"))]  # fmt: skip
                for pol, factor, run in runs:
                    proxy.restart_trace()
                    r = run()
                    w = workload()
                    for fa in factors if factor is None else (factor,):
                        rows.append(_row(ti, pol, fa, text_s, r, simulate(w, Link(trace, args.slice_s), pol, fa * text_s, levels), args, out))
                for fa in factors:
                    r = {"ttft_s": text_s, "options": [TEXT] * len(keys), "bytes": 0}
                    rows.append(_row(ti, "text", fa, text_s, r, simulate(workload(), Link(trace, args.slice_s), "text", None, levels), args, out))
                reader.store.close()
                link["client"].close()
        for s in summarise(rows):
            errs = [abs(r["predicted_ttft_s"] / r["ttft_s"] - 1) for r in rows if r["policy"] == s["policy"]]
            s["prediction_error_median"] = round(float(np.median(errs)), 4)
            out.emit(s)
        direct.close()


if __name__ == "__main__":
    main()
