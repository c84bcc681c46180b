"""The naive ways to keep a context's KV, the baselines of ``warm_path``: plain fp16 bytes, 8-bit codes, and the
floor of the hardware (the KV in pinned host memory, copied to the GPU, the question prefilled on it).

- ``fp16``, ``uniform8``: the chunks stored as plain fp16 bytes or as 8-bit codes (per-channel keys, per-token
  values, fp16 scales: KIVI/KVQuant practice) under plain keys of the same store, converted into a cache the
  model extends in place (the strongest honest version of "keep the KV");
- ``fp16-pinned``: no store and no project code on the timed path, transformers alone: the context's KV kept in
  pinned host memory in the model's 16-bit dtype, copied to the device layer by layer, the question prefilled on
  a ``DynamicCache`` of it (issue 46's "what the hardware allows"). Without a GPU the memory is not pinned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cachegen_core.hfcompat import cache_arg
from cachegen_core.kv import KVCache


def pack_fp16(kv: KVCache) -> bytes:
    """Keys then values as fp16, C order (what a user storing "the KV" writes)."""
    return b"".join(x.to(torch.float16).contiguous().cpu().numpy().tobytes() for x in (kv.keys, kv.values))


def unpack_fp16(blob: bytes, out: KVCache) -> None:
    n = out.keys.numel()
    x = torch.from_numpy(np.frombuffer(blob, dtype=np.float16, count=2 * n)).to(out.keys.device)  # 16 bits moved, converted there
    out.keys.copy_(x[:n].view(out.keys.shape))
    out.values.copy_(x[n:].view(out.values.shape))


def pack_uniform8(kv: KVCache) -> bytes:
    """8-bit asymmetric: keys per channel (over the chunk's tokens), values per token (over head dims);
    uint8 codes, then fp16 minimum and step."""
    parts = []
    for x, dim in ((kv.keys, 2), (kv.values, 3)):
        x = x.float()
        lo = x.amin(dim=dim, keepdim=True).half().float()
        step = ((x.amax(dim=dim, keepdim=True) - lo) / 255).clamp_min(1e-8).half().float()
        q = torch.round((x - lo) / step).clamp_(0, 255).to(torch.uint8)
        parts += [t.cpu().numpy().tobytes() for t in (q, lo.half(), step.half())]
    return b"".join(parts)


def unpack_uniform8(blob: bytes, out: KVCache) -> None:
    layers, heads, tokens, dim = out.shape
    at = 0
    for x, pshape in ((out.keys, (layers, heads, 1, dim)), (out.values, (layers, heads, tokens, 1))):
        n, m = x.numel(), int(np.prod(pshape))
        q = torch.from_numpy(np.frombuffer(blob, np.uint8, n, at)).view(x.shape).to(x.device)  # 8 bits moved, not 32
        lo = torch.from_numpy(np.frombuffer(blob, np.float16, m, at + n)).view(pshape).to(x.device)
        step = torch.from_numpy(np.frombuffer(blob, np.float16, m, at + n + 2 * m)).view(pshape).to(x.device)
        x.copy_(q.float() * step.float() + lo.float())
        at += n + 4 * m


NAIVE: dict[str, tuple[Callable[[KVCache], bytes], Callable[[bytes, KVCache], None]]] = {
    "fp16": (pack_fp16, unpack_fp16),
    "uniform8": (pack_uniform8, unpack_uniform8),
}


def pinned_copy(kv: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The context's KV per layer in host memory (pinned where a GPU is), in its own dtype, outside any timing."""
    pin = torch.cuda.is_available()
    return [(k.to("cpu").pin_memory() if pin else k.to("cpu").clone(), v.to("cpu").pin_memory() if pin else v.to("cpu").clone())
            for k, v in zip(kv.keys.unsqueeze(1), kv.values.unsqueeze(1))]  # fmt: skip


@torch.no_grad()
def pinned_ttft(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]], question: list[int]) -> dict[str, float]:
    """Time to the first token of ``question`` after the KV of ``layers`` (``pinned_copy``), transformers alone: each
    layer copied to the model's device (asynchronously from pinned memory), a ``DynamicCache`` of them, one forward
    pass of the question, its first token read back. ``copy_s``: the copies alone (synchronised), within it."""
    from transformers import DynamicCache  # noqa: PLC0415

    dev = model.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    name, past = next(iter(cache_arg(model, None))), layers[0][0].shape[2]
    sync()
    t0 = time.perf_counter()
    on_device = [(k.to(dev, non_blocking=True), v.to(dev, non_blocking=True)) for k, v in layers]
    sync()
    copied = time.perf_counter()
    cache = DynamicCache(on_device, config=model.config)
    ids = torch.tensor([question], device=dev)
    pos = torch.arange(past, past + len(question), device=dev)[None]
    out = model(input_ids=ids, position_ids=pos, use_cache=True, **{name: cache})
    int(out.logits[0, -1].argmax())  # the first token, on the host: the device is done
    end = time.perf_counter()
    return {"ttft_s": end - t0, "copy_s": copied - t0, "bytes": sum(k.nbytes + v.nbytes for k, v in layers), "decode_s": 0.0}
