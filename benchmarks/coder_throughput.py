"""Entropy-coder throughput: native rANS (CPU threads, the Triton GPU decoder) against torchac, on real and 7B-shaped chunks.

    python -m benchmarks.coder_throughput [--quick] [--no-real] [--no-7b] [--device cpu|cuda] [--out F]
        [--save-chunks DIR] [--npz FILE ...]

One JSON line per (data, coder, operation, threads): ``coder``, ``op``, ``threads``,
``symbols``, ``seconds`` (best of the repetitions), ``msym_per_s``, ``bits_per_symbol``
(coded, every substream's bytes), ``entropy_bits_per_symbol`` (ideal under the same
tables), and for native lines ``x_torchac`` (speed over torchac in this same run).

Data: (1) ``7b-laplace``: a 7B-shaped chunk (32 layers, 8 KV heads x 128 = 1024 channels,
1536 tokens, keys and values; 100.7 M symbols) cut into substreams exactly as the codec
does, symbols drawn from discretised Laplace laws with a per-channel scale, coded with the
codec's real table layout: its fixed tables (``codec.classes``), each component's class picked
on the chunk as a blob without a profile does; (2) ``<model>-profile`` / ``<model>-inline``: the symbols and tables of a
real 1536-token chunk of the reference model through ``KVCodec.prepare`` with the
model's profile and without one, classes picked on the chunk (skipped when the model is not provisioned).
Every coder is timed the same way: tables converted (and validated) before the timing, one
warm-up call, then the best of the repetitions, on the same symbols: torchac codes only ~2-4
Msym/s, so with ``--torchac-symbols N`` it runs on the leading substreams holding N symbols
and native is timed on exactly those too for ``x_torchac`` (``same_symbols`` names them).
``--save-chunks DIR`` keeps each chunk's symbols and tables as an .npz file and ``--npz``
measures such files instead (for a machine without the model, e.g. a GPU box).
GPU lines (``--device cuda``; by default when torch sees a GPU): the Triton decoder's symbols
(kernel time, and the call with the payloads' copy to the GPU) and, on the 7B-shaped chunk, its
fused reconstruction into bfloat16 KV with rotary keys (``decode_kv``; ``x_decode``: its kernel
time over the symbols' kernel time; the call from plain memory and from pinned memory, where the
engine's blobs are on a GPU host, ``x_kernel``: the call's time over its kernel's).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from benchmarks.common import Rows, best_time, parser
from cachegen_core.coders.base import StreamLayout, ideal_bits_per_stream
from cachegen_core.codec.config import CodecConfig


def subset(layout: StreamLayout, max_symbols: int) -> StreamLayout:
    """The leading substreams holding at most ``max_symbols`` symbols (at least one)."""
    k = max(1, int(np.searchsorted(layout.offsets, max_symbols, side="right")) - 1)
    return StreamLayout(layout.offsets[: k + 1].copy(), layout.table_ids[:k].copy())


def synthetic_7b(tokens: int = 1536, seed: int = 0) -> tuple[np.ndarray, StreamLayout, np.ndarray]:
    """Symbols, layout and tables of a 7B-shaped chunk laid out like ``KVCodec.prepare`` does (substreams
    of whole tokens, every kind, layer and component; each component's class picked on the chunk)."""
    from cachegen_core.codec.classes import bank  # noqa: PLC0415
    from cachegen_core.codec.substreams import ChunkGeometry, chunk_classes, stream_layout  # noqa: PLC0415

    layers, heads, dim, config = 32, 8, 128, CodecConfig()
    rng = np.random.default_rng(seed)
    geo = ChunkGeometry.of(layers, heads, dim, tokens, config.tokens_per_stream(2 * layers * heads * dim))
    scale = 1.2 * np.exp(0.8 * rng.standard_normal(geo.period))  # components of very different spread
    x = np.rint(rng.laplace(128.0, scale, (tokens, geo.period))).clip(1, 255).astype(np.uint8).ravel()
    layout = stream_layout(geo, chunk_classes(x, geo, config.table_classes).reshape(-1))
    return x, layout, bank(config.table_classes)


def real_chunks(model_name: str, level: int, tokens: int, data: str | Path | None = None) -> list[tuple[str, np.ndarray, StreamLayout, np.ndarray]]:
    """The reference model's chunk coded with its profile and without one ([] if unavailable)."""
    try:
        from benchmarks.common import LONGCHAT, context_kv, load, transcript_ids, transcripts  # noqa: PLC0415
        from cachegen_core.codec.kvcodec import KVCodec  # noqa: PLC0415
        from cachegen_core.keys.fingerprint import model_fingerprint  # noqa: PLC0415
        from cachegen_core.codec.profiles import find_profile  # noqa: PLC0415

        model, tok = load(model_name)
        fp = model_fingerprint(model, tok)
        ids = next(transcript_ids(tok, transcripts(data or LONGCHAT), tokens))
        kv = context_kv(model, ids)
    except Exception as e:  # noqa: BLE001  no model, no data: the synthetic chunk still runs
        print(f"# real chunk skipped: {type(e).__name__}: {e}", file=sys.stderr)
        return []
    config = CodecConfig()
    out = []
    for profile in (find_profile(fp, config), None):
        p = KVCodec(config, profile, fingerprint=fp).prepare(kv, level, start=0)
        out.append((f"{model_name}-{tokens}tok-L{level}-{'profile' if profile else 'inline'}", p.symbols, p.layout, p.freqs))
    return out


def save_chunk(directory: str, name: str, symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray) -> None:
    """Keep a chunk's coder inputs (compressed; tables as uint16, which always holds them)."""
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, f"{name}.npz"), name=name, symbols=symbols, offsets=layout.offsets,
                        table_ids=layout.table_ids, freqs=freqs.astype(np.uint16))  # fmt: skip


def load_chunk(path: str) -> tuple[str, np.ndarray, StreamLayout, np.ndarray]:
    """A chunk saved by ``save_chunk``."""
    z = np.load(path, allow_pickle=False)
    return str(z["name"]), z["symbols"], StreamLayout(z["offsets"], z["table_ids"]), z["freqs"].astype(np.uint32)


def measure(data: str, symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray, *, reps: int, torchac_symbols: int,
            cuda: bool, out: Rows, cpu_threads: list[int], geometry: tuple[int, int, int] | None = None) -> None:  # fmt: skip
    """Time every coder on one chunk and print its JSON lines."""
    from cachegen_core.coders.native import NativeCoder  # noqa: PLC0415
    from cachegen_core.coders.native_lib import available  # noqa: PLC0415

    gpu_layout = layout  # the codec's: one row of table ids seen by every substream (sent to a GPU once)
    layout = StreamLayout(layout.offsets, np.ascontiguousarray(layout.table_ids))  # the CPU coders' rows, made once
    entropy = ideal_bits_per_stream(symbols, layout, freqs).sum() / layout.n_symbols
    base: dict[str, Any] = {"data": data, "substreams": layout.n_streams, "tables": int(freqs.shape[0])}
    sub = subset(layout, torchac_symbols) if torchac_symbols else layout
    ref = torchac_lines(symbols[: sub.n_symbols], sub, freqs, reps) if torchac_symbols else []
    for r in ref:
        out.emit({**base, **r})
    if not available():
        print("# native coder not built: no native lines", file=sys.stderr)
        return
    speed = {r["op"]: r["msym_per_s"] for r in ref}

    def line(coder: str, op: str, threads: int | None, seconds: float, bps: float, n: int = layout.n_symbols, **extra: Any) -> None:
        out.emit({**base, "coder": coder, "op": op, "threads": threads, "symbols": n, "seconds": round(seconds, 5),
                  "msym_per_s": round(n / seconds / 1e6, 1), "bits_per_symbol": round(bps, 4),
                  "entropy_bits_per_symbol": round(entropy, 4), **extra})  # fmt: skip

    payloads: list[bytes] = NativeCoder().encode(symbols, layout, freqs) if not cpu_threads else []
    for threads in cpu_threads:
        coder = NativeCoder(threads=threads)
        coder.tables(freqs)  # table conversion is once per profile, not per chunk: keep it out of the timing
        payloads = coder.encode(symbols, layout, freqs)  # warm-up
        coder.decode(payloads, layout, freqs)
        t_enc, payloads = best_time(lambda c=coder: c.encode(symbols, layout, freqs), reps)
        t_dec, decoded = best_time(lambda c=coder, p=payloads: c.decode(p, layout, freqs), reps)
        assert np.array_equal(decoded, symbols), "native decode differs from the input"
        bps = 8 * sum(map(len, payloads)) / layout.n_symbols
        line(coder.name, "encode", threads, t_enc, bps)
        line(coder.name, "decode", threads, t_dec, bps)
        if ref:  # the torchac comparison, on its very symbols
            s = symbols[: sub.n_symbols]
            te, p = best_time(lambda c=coder, s=s: c.encode(s, sub, freqs), reps)
            td, _ = best_time(lambda c=coder, p=p: c.decode(p, sub, freqs), reps)
            sb = 8 * sum(map(len, p)) / sub.n_symbols
            for op, t in (("encode", te), ("decode", td)):
                line(coder.name, op, threads, t, sb, n=sub.n_symbols, same_symbols="torchac's",
                     x_torchac=round(sub.n_symbols / t / 1e6 / speed[op], 1))  # fmt: skip
    if cuda:
        cuda_lines(payloads, symbols, gpu_layout, freqs, reps, line, geometry)


def cuda_lines(payloads: list[bytes], symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray, reps: int,
               line: Callable[..., None], geometry: tuple[int, int, int] | None) -> None:  # fmt: skip
    """Triton GPU decode: kernel time alone, the call with the payloads' copy to the GPU, and (with the chunk's
    ``geometry``, layers x heads x head_dim) the fused reconstruction into bfloat16 KV against the decode alone."""
    try:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            print("# no GPU: no GPU lines", file=sys.stderr)
            return
        from cachegen_core.coders import get_decoder  # noqa: PLC0415
        from cachegen_core.coders.native import NativeCoder  # noqa: PLC0415

        coder = get_decoder(NativeCoder.name, "cuda")
        gpu = coder.decode_symbols(payloads, layout, freqs)  # warm-up: JIT compile, tables to the GPU
    except Exception as e:  # noqa: BLE001
        print(f"# GPU decode unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return
    assert np.array_equal(gpu.cpu().numpy(), symbols), "GPU decode differs from the input"

    def timed(call: Callable[[], Any]) -> tuple[float, float]:
        calls, kernels = [], []
        for _ in range(max(reps, 5)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            call()
            torch.cuda.synchronize()
            calls.append(time.perf_counter() - t)
            kernels.append(coder.last_kernel_s)
        return min(kernels), min(calls)

    bps = 8 * sum(map(len, payloads)) / layout.n_symbols
    name = f"{coder.name}-triton-{torch.cuda.get_device_name()}"
    kernel, call = timed(lambda: coder.decode_symbols(payloads, layout, freqs))
    line(name, "decode", None, kernel, bps, timed="kernel")
    line(name, "decode", None, call, bps, timed="call: payload copy to the GPU + kernel")
    if geometry is None:
        return
    layers, heads, dim = geometry
    tokens = layout.n_symbols // layout.period
    data, offsets = np.frombuffer(b"".join(payloads), np.uint8), np.concatenate([[0], np.cumsum([len(p) for p in payloads])])
    kv = [torch.empty(layers, heads, tokens, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    step, mean = torch.full((2, layers, heads, dim), 0.01), torch.zeros(2, layers, heads, dim)
    pos = torch.arange(tokens, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(dim // 2) / (dim // 2))
    cos_sin = (torch.cat([pos, pos], 1).cos().cuda(), torch.cat([pos, pos], 1).sin().cuda())

    def fused(payload: np.ndarray) -> tuple[float, float]:
        return timed(lambda: coder.decode_kv(payload, offsets, layout, freqs, heads=heads, head_dim=dim, min_symbol=1, step=step,
                                             mean=mean, cos_sin=cos_sin, keys=kv[0], values=kv[1], first_token=0))  # fmt: skip

    fused_kernel, fused_call = fused(data)
    line(name, "decode_kv", None, fused_kernel, bps, timed="kernel", x_decode=round(fused_kernel / kernel, 2))
    line(name, "decode_kv", None, fused_call, bps, timed="call: payload copy to the GPU + kernel", x_kernel=round(fused_call / fused_kernel, 2))
    from cachegen_core.pinned import host_arena  # noqa: PLC0415

    arena = host_arena()
    block = arena.alloc(data.size) if arena is not None else None
    if block is not None:  # where the engine's blobs are on a GPU host: a memory store's block, a pinned read buffer
        block[:] = data
        k, c = fused(block)
        line(name, "decode_kv", None, c, bps, timed="call: payloads in pinned memory + kernel", x_kernel=round(c / k, 2))


def torchac_lines(symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray, reps: int) -> list[dict[str, Any]]:
    """torchac encode and decode of ``symbols``: CDFs built before the timing, a warm-up, best of ``reps``."""
    try:
        import torchac  # noqa: F401, PLC0415

        from cachegen_core.coders.reference import ReferenceCoder  # noqa: PLC0415
    except ImportError:
        print("# torchac not installed here: no baseline", file=sys.stderr)
        return []
    ref = ReferenceCoder()
    payloads = ref.encode(symbols, layout, freqs)  # warm-up (and the CDFs, converted once per table set)
    ref.decode(payloads, layout, freqs)
    t_enc, payloads = best_time(lambda: ref.encode(symbols, layout, freqs), reps)
    t_dec, decoded = best_time(lambda: ref.decode(payloads, layout, freqs), reps)
    assert np.array_equal(decoded, symbols)
    bps = 8 * sum(map(len, payloads)) / layout.n_symbols
    ent = ideal_bits_per_stream(symbols, layout, freqs).sum() / layout.n_symbols
    return [{"coder": ref.name, "op": op, "threads": 1, "symbols": layout.n_symbols, "seconds": round(t, 4),
             "msym_per_s": round(layout.n_symbols / t / 1e6, 2), "bits_per_symbol": round(bps, 4),
             "entropy_bits_per_symbol": round(ent, 4)} for op, t in (("encode", t_enc), ("decode", t_dec))]  # fmt: skip


def chunks(args: argparse.Namespace) -> Iterator[tuple[str, np.ndarray, StreamLayout, np.ndarray]]:
    """The chunks to measure: saved files, or the 7B-shaped synthetic chunk and the real ones."""
    if args.npz:
        yield from (load_chunk(f) for f in args.npz)
        return
    if not args.no_7b:
        tokens = 480 if args.quick else args.tokens
        yield (f"7b-laplace-{tokens}tok", *synthetic_7b(tokens))
    if not args.no_real:
        yield from real_chunks(args.model, args.level, args.tokens, args.data)


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="7B chunk of 480 tokens, fewer repetitions (< 2 minutes)")
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--no-real", action="store_true", help="skip the reference model's chunk")
    ap.add_argument("--no-7b", action="store_true", help="skip the 7B-shaped synthetic chunk")
    ap.add_argument("--no-torchac", action="store_true", help="skip the torchac baseline")
    ap.add_argument("--torchac-symbols", type=int, default=None,
                    help="torchac (and native, for the comparison) on the leading substreams holding this many symbols")  # fmt: skip
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="cuda: the Triton GPU decoder's lines too (default: when torch sees a GPU); cpu: CPU coders only",
    )
    ap.add_argument("--no-cuda", action="store_true", help="same as --device cpu")
    ap.add_argument("--cpu-threads", default=None, help="comma-separated CPU thread counts (default 1,2,all; '' for none)")
    ap.add_argument("--save-chunks", default=None, metavar="DIR", help="also save every chunk's coder inputs here")
    ap.add_argument("--npz", nargs="+", default=[], metavar="FILE", help="measure saved chunks instead of making them")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = arguments()
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no GPU here")
    reps = 2 if args.quick else 5
    torchac_symbols = 0 if args.no_torchac else args.torchac_symbols or (300_000 if args.quick else 2_000_000)
    if args.cpu_threads is None:
        cpu_threads = sorted({1, 2, os.cpu_count() or 1})
    else:
        cpu_threads = [int(t) for t in args.cpu_threads.split(",") if t.strip()]
    cuda = not args.no_cuda and args.device != "cpu"
    with Rows("coder_throughput", args.out, argv) as out:
        opts = {"reps": reps, "torchac_symbols": torchac_symbols, "cuda": cuda, "out": out, "cpu_threads": cpu_threads}
        for name, sym, layout, freqs in chunks(args):
            if args.save_chunks:
                save_chunk(args.save_chunks, name, sym, layout, freqs)
            geometry = (32, 8, 128) if name.startswith("7b-") else None  # synthetic_7b's
            measure(name, sym, layout, freqs, geometry=geometry, **opts)
            del sym, layout, freqs
            gc.collect()


if __name__ == "__main__":
    main()
