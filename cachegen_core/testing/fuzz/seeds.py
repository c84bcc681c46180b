"""Seeds of the fuzzer: real blobs of tiny KV caches, coded by every available coder at every level.

Three codec variants (inline tables, many substreams, a fitted profile), each with the
small limits below, so that the worst a forged header may legally ask for stays cheap.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.coders import available_coders, get_coder
from cachegen_core.codec.config import CodecConfig
from cachegen_core.codec.format import Limits
from cachegen_core.kv import KVCache
from cachegen_core.codec.kvstats import KVStats
from cachegen_core.codec.profile import Profile
from cachegen_core.codec.transform import fit_transform


FINGERPRINT = "fuzz-model"
#: Tokens a fuzzed codec accepts per blob: small, so that the worst a forged header may
#: legally ask for stays cheap and the allocation bound below stays meaningful.
MAX_TOKENS = 4096
LIMITS = Limits(max_blob_bytes=1 << 24, max_header_bytes=1 << 16, max_streams=1 << 14, max_section_elements=1 << 22)


def warm_up() -> None:
    """Load every coder once, with stdout sent to stderr: torchac's first import builds an
    extension and prints to stdout, which would corrupt the JSON lines of the benchmarks."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        from cachegen_core.coders.reference import _backend  # noqa: PLC0415

        _backend()
        available_coders()
    except Exception:  # noqa: BLE001  a coder that cannot load is simply not fuzzed
        pass
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@dataclass(frozen=True)
class Seed:
    """A real blob, the codec that decodes it, and the KV it decodes to."""

    name: str
    codec: KVCodec
    blob: bytes
    kv: KVCache
    coder: str


def _tiny_kvs(seed: int) -> list[KVCache]:
    """Small KV caches with KV-like structure (smooth keys, noisy values), odd token counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layers, heads, tokens, dim, dtype in (
        (2, 2, 23, 4, torch.float32),
        (3, 1, 41, 8, torch.float16),
        (1, 2, 1, 4, torch.bfloat16),
    ):
        k = torch.randn(layers, heads, tokens, dim, generator=g).cumsum(2) * 0.3
        v = torch.randn(layers, heads, tokens, dim, generator=g)
        out.append(KVCache(k.to(dtype), v.to(dtype)))
    return out


def make_codecs(seed: int = 0) -> list[tuple[str, KVCodec, list[KVCache]]]:
    """Codecs to fuzz (name, codec, the KV caches it codes): inline tables, many substreams, a fitted profile."""
    kvs = _tiny_kvs(seed)
    many = CodecConfig(stream_symbols=48)  # several token blocks per layer: many substreams
    cfg = CodecConfig()
    g = torch.Generator().manual_seed(seed + 1)
    train = [KVCache(torch.randn(2, 2, 64, 4, generator=g).cumsum(2) * 0.3, torch.randn(2, 2, 64, 4, generator=g))]
    stats = KVStats.empty(2, 2, 4, group=cfg.head_group(2, 4))
    stats.add_covariance(train[0], rotary=None, chunk_tokens=32, sink_tokens=cfg.sink_tokens)
    transform = fit_transform(stats.covariance, group=stats.group)
    profile = Profile.fit(cfg, train, transform=transform, chunk_tokens=32, model_fingerprint=FINGERPRINT)
    kw: dict[str, Any] = {"fingerprint": FINGERPRINT, "max_tokens": MAX_TOKENS, "limits": LIMITS}
    return [
        ("inline", KVCodec(cfg, **kw), kvs),
        ("inline-many", KVCodec(many, **kw), kvs[:2]),
        ("profile", KVCodec(cfg, profile, **kw), [kvs[0]]),  # a profile fits one model shape
    ]


def make_seeds(seed: int = 0, coders: Sequence[str] | None = None) -> list[Seed]:
    """Every (codec variant, coder, KV, level) combination as a real blob."""
    names = list(coders) if coders is not None else list(available_coders())
    seeds = []
    for variant, codec, kvs in make_codecs(seed):
        for coder_name in names:
            enc = KVCodec(codec.config, codec.profile, coder=get_coder(coder_name), fingerprint=FINGERPRINT)
            for i, kv in enumerate(kvs):
                for level in codec.levels:
                    blob = enc.encode(kv, level, start=0)
                    seeds.append(Seed(f"{variant}/{coder_name}/kv{i}/L{level}", codec, blob, codec.decode(blob), coder_name))
    return seeds
