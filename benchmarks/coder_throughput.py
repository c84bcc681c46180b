"""Entropy-coder throughput: native rANS (CPU threads, CUDA) against torchac, on real and 7B-shaped chunks.

    python -m benchmarks.coder_throughput [--quick] [--model M] [--no-real] [--no-7b]

One JSON line per (data, coder, operation, threads): ``coder``, ``op``, ``threads``,
``symbols``, ``seconds``, ``msym_per_s``, ``bits_per_symbol`` (coded), and
``entropy_bits_per_symbol`` (ideal under the same tables). torchac runs in the same
process on a subset of the substreams (it decodes ~3-5 Msym/s).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import DEFAULT_MODEL, LONGCHAT, context_kv, emit, load, read_jsonl, setup_threads
from cachegen_core.coders.base import StreamLayout, cross_entropy_bits
from cachegen_core.codec import KVCodec
from cachegen_core.kv import KVCache


def _best(fn: Any, reps: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _subset(layout: StreamLayout, max_symbols: int) -> StreamLayout:
    """The leading substreams holding at most ``max_symbols`` symbols (at least one)."""
    k = max(1, int(np.searchsorted(layout.offsets, max_symbols, side="right")) - 1)
    return StreamLayout(layout.offsets[: k + 1].copy(), layout.table_ids[:k].copy())


def measure(data: str, symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray, *, reps: int, torchac_symbols: int, cuda: bool) -> None:
    from cachegen_core.coders.native import NativeCoder, available  # noqa: PLC0415
    from cachegen_core.coders.reference import ReferenceCoder  # noqa: PLC0415

    entropy = cross_entropy_bits(symbols, layout, freqs) / layout.n_symbols
    base = {"data": data}
    if available():
        for threads in sorted({1, 2, os.cpu_count() or 1}):
            coder = NativeCoder(threads=threads)
            t_enc, payloads = _best(lambda: coder.encode(symbols, layout, freqs), reps)
            t_dec, out = _best(lambda: coder.decode(payloads, layout, freqs), reps)
            assert np.array_equal(out, symbols)
            bps = 8 * sum(map(len, payloads)) / layout.n_symbols
            for op, t in (("encode", t_enc), ("decode", t_dec)):
                emit({**base, "coder": coder.name, "op": op, "threads": threads, "symbols": layout.n_symbols, "seconds": round(t, 4),
                      "msym_per_s": round(layout.n_symbols / t / 1e6, 1), "bits_per_symbol": round(bps, 4),
                      "entropy_bits_per_symbol": round(entropy, 4)})  # fmt: skip
        if cuda and torch.cuda.is_available():
            coder = NativeCoder()
            payloads = coder.encode(symbols, layout, freqs)
            gpu = coder.decode_cuda(payloads, layout, freqs)  # warm-up: JIT build, tables to the GPU
            assert np.array_equal(gpu.cpu().numpy(), symbols), "CUDA decode differs from CPU decode"
            # kernel time only: the payload is already on the GPU in a real pipeline after the transfer
            times = []
            for _ in range(max(reps, 5)):
                torch.cuda.synchronize()
                t = time.perf_counter()
                coder.decode_cuda(payloads, layout, freqs)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            t = min(times)
            kernel = min(coder.last_cuda_kernel_s for _ in range(3) if coder.decode_cuda(payloads, layout, freqs) is not None)
            for what, secs in (("call (payload copy to GPU + kernel)", t), ("kernel", kernel)):
                emit({**base, "coder": coder.name + "-cuda", "op": "decode", "threads": None, "symbols": layout.n_symbols,
                      "seconds": round(secs, 5), "msym_per_s": round(layout.n_symbols / secs / 1e6, 1),
                      "bits_per_symbol": round(8 * sum(map(len, payloads)) / layout.n_symbols, 4),
                      "entropy_bits_per_symbol": round(entropy, 4), "timed": what, "substreams": layout.n_streams})  # fmt: skip
    try:
        import torchac  # noqa: F401, PLC0415
    except ImportError:
        print("# torchac not installed here: no baseline", flush=True)
        return
    sub = _subset(layout, torchac_symbols)
    ref = ReferenceCoder()
    s = symbols[: sub.n_symbols]
    t_enc, payloads = _best(lambda: ref.encode(s, sub, freqs), 1)
    t_dec, out = _best(lambda: ref.decode(payloads, sub, freqs), 1)
    assert np.array_equal(out, s)
    ent = cross_entropy_bits(s, sub, freqs) / sub.n_symbols
    for op, t in (("encode", t_enc), ("decode", t_dec)):
        emit({**base, "coder": ref.name, "op": op, "threads": 1, "symbols": sub.n_symbols, "seconds": round(t, 4),
              "msym_per_s": round(sub.n_symbols / t / 1e6, 2), "bits_per_symbol": round(8 * sum(map(len, payloads)) / sub.n_symbols, 4),
              "entropy_bits_per_symbol": round(ent, 4)})  # fmt: skip


def synthetic_7b(tokens: int = 1536, seed: int = 0) -> KVCache:
    """A 7B-shaped KV chunk (32 layers, 8 KV heads, head_dim 128): random walks with per-channel scales."""
    g = torch.Generator().manual_seed(seed)
    shape = (32, 8, tokens, 128)
    scale = torch.exp(torch.randn(32, 8, 1, 128, generator=g))
    kv = []
    for _ in range(2):
        x = torch.randn(shape, generator=g).mul_(0.3).cumsum_(2).mul_(1 / 8) + torch.randn(shape, generator=g)
        kv.append(x.mul_(scale))
    return KVCache(*kv)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--no-real", action="store_true")
    ap.add_argument("--no-7b", action="store_true")
    ap.add_argument("--no-cuda", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, 7B chunk of 480 tokens (< 2 minutes)")
    ap.add_argument("--save-real", default=None, help="also save the real chunk's symbols/layout/tables to this .npz")
    ap.add_argument("--real-npz", default=None, help="measure a chunk saved by --save-real instead of loading the model")
    args = ap.parse_args(argv)
    setup_threads()
    reps = 1 if args.quick else 3
    torchac_symbols = 500_000 if args.quick else 3_000_000
    if args.real_npz:
        z = np.load(args.real_npz, allow_pickle=False)
        layout = StreamLayout(z["offsets"], z["table_ids"])
        measure(str(z["name"]), z["symbols"], layout, z["freqs"], reps=reps, torchac_symbols=torchac_symbols, cuda=not args.no_cuda)
    elif not args.no_real:
        from cachegen_core.config import CodecConfig  # noqa: PLC0415
        from cachegen_core.fingerprint import model_fingerprint  # noqa: PLC0415
        from cachegen_core.profile import find_profile  # noqa: PLC0415

        model, tok = load(args.model)
        fp = model_fingerprint(model, tok)
        config = CodecConfig()
        codec = KVCodec(config, find_profile(fp, config), fingerprint=fp)
        ids = tok(read_jsonl(LONGCHAT, "prompt")[10])["input_ids"][:1536]
        p = codec.prepare(context_kv(model, ids), args.level)
        name = f"{args.model}-1536tok-L{args.level}-{'profile' if codec.profile else 'inline'}"
        if args.save_real:
            np.savez(args.save_real, name=name, symbols=p.symbols, offsets=p.layout.offsets, table_ids=p.layout.table_ids, freqs=p.freqs)
        measure(name, p.symbols, p.layout, p.freqs, reps=reps, torchac_symbols=torchac_symbols, cuda=not args.no_cuda)
        del model
    if not args.no_7b:
        kv = synthetic_7b(480 if args.quick else 1536)
        p = KVCodec().prepare(kv, args.level)
        del kv
        measure(f"7b-synthetic-{p.shape[2]}tok-L{args.level}-inline", p.symbols, p.layout, p.freqs, reps=reps,
                torchac_symbols=torchac_symbols, cuda=not args.no_cuda)  # fmt: skip


if __name__ == "__main__":
    main()
