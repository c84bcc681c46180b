"""One transform matrix per KV head against one across a group of heads: a chunk's bytes and decode time.

    python -m benchmarks.transform_groups [--quick] [--device cpu|cuda] [--shape L,H,D,T] [--out F]

A chunk of a 7B-shaped model (32 layers, 8 KV heads of 128, 1536 tokens by default; ``--quick``: 4
layers) whose heads project one shared low-rank source plus noise, as a layer's KV heads project one
hidden state (synthetic: the bytes say how a transform across heads codes correlated heads, not how a
real model's do; ``benchmarks.quality_size`` measures those). For ``group_channels`` = the head dim (one
matrix per head) and twice it (two heads per matrix): a profile fitted on the chunk, the chunk coded at
level 1, and the whole ``KVCodec.decode`` call into bfloat16 KV on ``--device`` (payload copy, symbols,
the transform's products, the writes; median of the repetitions after a warm-up), and on the CPU when
``--device`` is a GPU. JSON lines: ``{"device", "group_channels", "heads_per_matrix", "bytes",
"bits_per_element", "decode_s_median", "decode_s_min", "rel_err_keys", "fit_s"}``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import Rows, parser, setup_threads
from cachegen_core.codec.config import CodecConfig
from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.codec.kvstats import KVStats
from cachegen_core.codec.profile import Profile
from cachegen_core.codec.transform import fit_transform
from cachegen_core.kv import KVCache


def correlated_heads(layers: int, heads: int, dim: int, tokens: int, rank: int = 256) -> torch.Tensor:
    """``(layers, heads, tokens, dim)``: every head a projection of one rank-``rank`` source per layer, plus noise."""
    src = torch.randn(layers, tokens, rank) @ (torch.randn(layers, rank, heads * dim) / rank**0.5)
    return (src + 0.1 * torch.randn(layers, tokens, heads * dim)).reshape(layers, tokens, heads, dim).transpose(1, 2).contiguous()


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(kv: KVCache, group_channels: int, devices: list[str], reps: int) -> list[dict]:
    """A profile with matrices of ``group_channels`` fitted on ``kv``, then level 1's bytes and decode time per device."""
    layers, heads, tokens, dim = kv.shape
    cfg = CodecConfig(group_channels=group_channels)
    group = cfg.head_group(heads, dim)
    t = time.perf_counter()
    stats = KVStats.empty(layers, heads, dim, group=group)
    stats.add_covariance(kv, rotary=None, chunk_tokens=tokens, sink_tokens=cfg.sink_tokens)
    profile = Profile.fit(cfg, [kv], transform=fit_transform(stats.covariance, None, group=group), chunk_tokens=tokens)
    fit_s = time.perf_counter() - t
    rows = []
    for device in devices:
        codec = KVCodec(cfg, profile, device=device)
        blob = codec.encode(kv, 1, start=0)
        out = KVCache(*(torch.empty(kv.shape, dtype=torch.bfloat16, device=device) for _ in range(2)))
        got = codec.decode(blob, out=out)  # warm-up: kernels compiled, matrices on the device
        err = ((got.keys.float().cpu() - kv.keys).norm() / kv.keys.norm()).item()
        times = []
        for _ in range(reps):
            _sync(device)
            t = time.perf_counter()
            codec.decode(blob, out=out)
            _sync(device)
            times.append(time.perf_counter() - t)
        rows.append({"device": device, "gpu": torch.cuda.get_device_name() if device != "cpu" else None,
                     "cpu_threads": torch.get_num_threads(), "shape": list(kv.shape), "group_channels": group_channels,
                     "heads_per_matrix": group, "level": 1, "bytes": len(blob), "bits_per_element": round(8 * len(blob) / kv.num_elements, 3),
                     "decode_s_median": round(statistics.median(times), 5), "decode_s_min": round(min(times), 5),
                     "rel_err_keys": round(err, 5), "fit_s": round(fit_s, 1)})  # fmt: skip
    return rows


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, model=False, data=False, device=True, quick_help="4 layers, 3 repetitions")
    ap.add_argument("--shape", default="32,8,128,1536", help="layers,kv_heads,head_dim,tokens (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=10)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    layers, heads, dim, tokens = (int(x) for x in args.shape.split(","))
    if args.quick:
        layers, args.reps = min(layers, 4), 3
    setup_threads()
    torch.manual_seed(0)
    kv = KVCache(correlated_heads(layers, heads, dim, tokens), correlated_heads(layers, heads, dim, tokens))
    devices = [args.device] if torch.device(args.device).type == "cpu" else [args.device, "cpu"]
    with Rows("transform_groups", args.out, argv) as out:
        for group_channels in (dim, 2 * dim):
            for row in measure(kv, group_channels, devices, args.reps):
                out.emit(row)


if __name__ == "__main__":
    main()
