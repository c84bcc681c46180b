"""Baseline KV compressors the quality/size benchmark compares CacheGen with.

Each takes a ``KVCache`` and returns ``(reconstructed KVCache, bytes stored)``, where
the byte count includes every scale, zero point and header the method must keep.
"""

from __future__ import annotations

import torch

from cachegen_core.kv import KVCache

_FP16_BYTES = 2


def fp16(kv: KVCache) -> tuple[KVCache, int]:
    """The reference: the KV cast to fp16 (16 bits per element)."""
    return kv.to(torch.float16).to(kv.dtype), kv.num_elements * _FP16_BYTES


def _asym(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, int]:
    """Asymmetric min/max quantisation of ``x`` along ``dim``; fp16 scale and zero per slice."""
    levels = (1 << bits) - 1
    lo = x.amin(dim=dim, keepdim=True).half().float()
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(1e-8).half().float()
    q = torch.round((x - lo) / scale).clamp_(0, levels)
    n_groups = x.numel() // x.shape[dim]
    return lo + q * scale, n_groups * 2 * _FP16_BYTES


def uniform(kv: KVCache, bits: int) -> tuple[KVCache, int]:
    """Per-token asymmetric quantisation: one scale and zero per (layer, token) over all KV channels."""
    out, extra = [], 0
    for x in (kv.keys, kv.values):
        layers, heads, tokens, dim = x.shape
        t = x.float().permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)
        y, e = _asym(t, bits, dim=2)
        out.append(y.reshape(layers, tokens, heads, dim).permute(0, 2, 1, 3).to(kv.dtype))
        extra += e
    return KVCache(*out), kv.num_elements * bits // 8 + extra


def kivi2(kv: KVCache, group: int = 32) -> tuple[KVCache, int]:
    """KIVI-style 2-bit: keys per channel (groups of ``group`` tokens), values per token (groups of ``group`` channels).

    Without KIVI's full-precision window of recent tokens: a stored context has no "recent" end.
    """
    layers, heads, tokens, dim = kv.shape
    pad_t = (-tokens) % group
    k = torch.nn.functional.pad(kv.keys.float(), (0, 0, 0, pad_t), mode="replicate" if pad_t else "constant")
    k = k.reshape(layers, heads, -1, group, dim)  # groups of tokens, per channel
    kq, ek = _asym(k, 2, dim=3)
    k_hat = kq.reshape(layers, heads, -1, dim)[:, :, :tokens]
    v = kv.values.float()
    pad_c = (-dim) % group
    v = torch.nn.functional.pad(v, (0, pad_c)).reshape(layers, heads, tokens, -1, group)
    vq, ev = _asym(v, 2, dim=4)
    v_hat = vq.reshape(layers, heads, tokens, -1)[..., :dim]
    return KVCache(k_hat.to(kv.dtype), v_hat.to(kv.dtype)), kv.num_elements * 2 // 8 + ek + ev


def zstd(kv: KVCache, level: int = 19) -> tuple[KVCache, int]:
    """Lossless: the fp16 bytes through zstandard at a high level."""
    import zstandard  # noqa: PLC0415

    half = kv.to(torch.float16)
    raw = torch.cat([half.keys.reshape(-1), half.values.reshape(-1)]).view(torch.int16).numpy().tobytes()
    size = len(zstandard.ZstdCompressor(level=level, threads=-1).compress(raw))
    return half.to(kv.dtype), size
