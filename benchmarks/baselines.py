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


def uniform(kv: KVCache, bits: int, key_group: int = 128) -> tuple[KVCache, int]:
    """KIVI/KVQuant practice without the full-precision window: keys per channel over groups of
    ``key_group`` tokens, values per token over each head's channels; fp16 scale and zero counted."""
    return _kivi(kv, bits, key_group=key_group, value_group=kv.head_dim, residual=0)


def uniform_per_token(kv: KVCache, bits: int) -> tuple[KVCache, int]:
    """The weak variant (issue 6's ``uniform``): one scale and zero per (layer, token) over all KV channels."""
    out, extra = [], 0
    for x in (kv.keys, kv.values):
        layers, heads, tokens, dim = x.shape
        t = x.float().permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)
        y, e = _asym(t, bits, dim=2)
        out.append(y.reshape(layers, tokens, heads, dim).permute(0, 2, 1, 3).to(kv.dtype))
        extra += e
    return KVCache(*out), kv.num_elements * bits // 8 + extra


def kivi(kv: KVCache, bits: int = 2, group: int = 32, residual: int = 128) -> tuple[KVCache, int]:
    """KIVI (Liu et al., 2024) at its paper's defaults: keys per channel over groups of ``group`` tokens,
    values per token over groups of ``group`` channels, and the context's last ``residual`` tokens kept
    in fp16 (16 bits each, counted)."""
    return _kivi(kv, bits, key_group=group, value_group=group, residual=residual)


def kivi2(kv: KVCache) -> tuple[KVCache, int]:
    """KIVI 2-bit with its 128-token full-precision window."""
    return kivi(kv, 2)


def _kivi(kv: KVCache, bits: int, *, key_group: int, value_group: int, residual: int) -> tuple[KVCache, int]:
    layers, heads, tokens, dim = kv.shape
    n_q = max(0, tokens - residual)
    if residual and n_q > key_group:
        n_q -= n_q % key_group  # KIVI keeps the tokens of an incomplete key group in fp16 too
    kq, vq = kv.keys[:, :, :n_q].float(), kv.values[:, :, :n_q].float()
    size = 0
    if n_q:
        pad_t = (-n_q) % key_group
        k = torch.nn.functional.pad(kq, (0, 0, 0, pad_t), mode="replicate") if pad_t else kq
        k = k.reshape(layers, heads, -1, key_group, dim)  # groups of tokens, per channel
        k_hat, ek = _asym(k, bits, dim=3)
        k_hat = k_hat.reshape(layers, heads, -1, dim)[:, :, :n_q]
        pad_c = (-dim) % value_group
        v = torch.nn.functional.pad(vq, (0, pad_c)).reshape(layers, heads, n_q, -1, value_group)
        v_hat, ev = _asym(v, bits, dim=4)
        v_hat = v_hat.reshape(layers, heads, n_q, -1)[..., :dim]
        size += -(-2 * layers * heads * n_q * dim * bits // 8) + ek + ev
    else:
        k_hat = v_hat = kq
    rest = kv.slice(n_q)
    size += rest.num_elements * _FP16_BYTES
    keys = torch.cat([k_hat.to(kv.dtype), rest.keys.half().to(kv.dtype)], dim=2)
    values = torch.cat([v_hat.to(kv.dtype), rest.values.half().to(kv.dtype)], dim=2)
    return KVCache(keys, values), size


def zstd(kv: KVCache, level: int = 19) -> tuple[KVCache, int]:
    """Lossless: the fp16 bytes through zstandard at a high level."""
    import zstandard  # noqa: PLC0415

    half = kv.to(torch.float16)
    raw = torch.cat([half.keys.reshape(-1), half.values.reshape(-1)]).view(torch.int16).numpy().tobytes()
    size = len(zstandard.ZstdCompressor(level=level, threads=-1).compress(raw))
    return half.to(kv.dtype), size


def quanto_available() -> bool:
    """Whether optimum-quanto imports here (not a project dependency: ``pip install --no-deps optimum-quanto``)."""
    try:
        import optimum.quanto  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def quanto(kv: KVCache, bits: int = 4, group: int = 64) -> tuple[KVCache, int]:
    """transformers' ``QuantizedCache(backend="quanto")`` at its defaults (axis 0, groups of 64, MaxOptimizer),
    applied as its prefill does: every context token quantised (its residual window only holds tokens
    generated later). Bytes: ``bits`` per element plus an fp16 scale and zero point per group."""
    from transformers.cache_utils import QuantoQuantizedLayer  # noqa: PLC0415

    keys, values = [], []
    for layer in range(kv.num_layers):
        q = QuantoQuantizedLayer(nbits=bits, axis_key=0, axis_value=0, q_group_size=group, residual_length=128)
        q.update(kv.keys[layer : layer + 1].float().contiguous(), kv.values[layer : layer + 1].float().contiguous())
        keys.append(q._dequantize(q._quantized_keys)[0])
        values.append(q._dequantize(q._quantized_values)[0])
    n = kv.num_elements
    return KVCache(torch.stack(keys).to(kv.dtype), torch.stack(values).to(kv.dtype)), n * bits // 8 + 4 * -(-n // group)
