"""Every decoding request's attention over its own KV in one kernel launch a layer: a packed forward's decode on a GPU.

Each request's KV buffer is an allocation of its own, so the packed forward (``packed.py``) reads each with a call of
its own, after copying its new key and value into it: about four kernel launches per request and layer. On a GPU those
launches, not the arithmetic, should bound a decode step of many requests on short contexts (an estimate, not yet
measured on a GPU: 16 requests of a 32-layer model make ~2,000 launches a step, some microseconds of the CPU's time
each, against a few milliseconds of the GPU's work). Here one Triton launch a layer (``decode_kernel.py``) does it for
every request that decodes one token: each request's buffer is found by its address in a table built once a forward
(:class:`Batch`), the new key and value are written by the kernel, and the log-sum-exp comes out too for requests
whose tails are combined with a shared prefix's attention.

Where it runs: :data:`DEVICES` (CUDA; the tests add the CPU under Triton's interpreter), with Triton importable, no
logit soft-capping, and every buffer of the keys' dtype, its tokens contiguous, with room for the new token (checked
before a launch: the kernel writes through raw addresses). A launch that fails is said once and the device's packed
forward goes back to a call per request (:data:`FAILED`). ``CACHEGEN_DECODE_KERNEL=0`` (read once, when an engine is
built) turns it off: the call per request, which ``benchmarks/gpu/run.sh batch-calls`` measures beside ``batch``.
A program reads one request's keys for one KV head in sequence (no split of the keys): with few requests on long
contexts and few KV heads it may use only part of a GPU, which those two rows would show.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

log = logging.getLogger("cachegen_core.engine")

#: The kinds of device the kernel runs on.
DEVICES = {"cuda"}
#: Why the kernel failed on a kind of device (there requests are read one call each from then on).
FAILED: dict[str, str] = {}
#: Fewest decoding requests a launch is worth it for (one request: its own call is as many launches).
MIN_PARTS = 2


@lru_cache(maxsize=1)
def _kernel() -> Any:
    from .decode_kernel import own_decode_kernel  # noqa: PLC0415  (imports triton: only when a batch runs)

    return own_decode_kernel


@lru_cache(maxsize=1)
def enabled() -> bool:
    """``CACHEGEN_DECODE_KERNEL`` (default on; ``0``, ``false``, ``no``, ``off``: off), read once."""
    value = os.environ.get("CACHEGEN_DECODE_KERNEL", "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"CACHEGEN_DECODE_KERNEL={value!r} is not on or off (1 or 0)")


@lru_cache(maxsize=1)
def _triton() -> bool:
    from ...coders.triton_decoder import _triton_error  # noqa: PLC0415

    return _triton_error() is None


def usable(device: torch.device, softcap: float | None) -> bool:
    """Whether the kernel may run for a forward on ``device`` (Triton's import tried once, not every forward)."""
    return device.type in DEVICES and not softcap and device.type not in FAILED and enabled() and _triton()


class Batch:
    """Decoding parts (one new token each) whose attention one launch computes, and their tables on the device: the
    row of each one's query, the row its output goes to, its buffer's addresses and strides, its computed tokens, and
    (per sliding window) the first key each one reads."""

    def __init__(self, parts: Sequence[Any], out_rows: Sequence[int], device: torch.device) -> None:
        self.parts, self.device = list(parts), device
        self.dtype = self.parts[0].own.keys.dtype
        keys = [p.own.keys for p in self.parts]
        values = [p.own.values for p in self.parts]
        table = [[p.start for p in self.parts], list(out_rows), [k.data_ptr() for k in keys], [v.data_ptr() for v in values],
                 [k.stride(0) for k in keys], [k.stride(1) for k in keys], [p.filled for p in self.parts]]  # fmt: skip
        tables = torch.tensor(table, dtype=torch.int64, device=device)  # one copy to the device
        self.qrow, self.orow, self.kaddr, self.vaddr, self.stride_l, self.stride_h, self.filled = tables
        self._first: dict[int | None, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.parts)

    @staticmethod
    def fits(parts: Sequence[Any], dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the kernel may read and write these parts' buffers: on ``device``, of ``dtype``, keys and values laid
        out alike with tokens ``head_dim`` elements apart, and room for the new token."""
        for p in parts:
            k, v = p.own.keys, p.own.values
            if p.tokens != 1 or k.device != device or k.dtype != dtype or v.dtype != dtype or k.stride() != v.stride():
                return False
            if k.stride(3) != 1 or k.stride(2) != k.shape[3] or not 0 <= p.filled < k.shape[2]:
                return False
        return True

    def first(self, window: int | None) -> torch.Tensor:
        """Each part's first key under a sliding ``window`` (transformers' masks: keys after ``position - window``, as
        ``packed._window_start``); 0 without one."""
        if window not in self._first:
            self._first[window] = torch.zeros_like(self.filled) if window is None else (self.filled - window + 1).clamp_(min=0)
        return self._first[window]


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: Batch, layer: int, window: int | None,
           scale: float, out: torch.Tensor, lse: torch.Tensor | None = None) -> bool:  # fmt: skip
    """The attention of ``batch``'s parts at ``layer``: ``query`` (1, heads, T, head_dim) and the new ``key``/``value``
    (1, kv_heads, T, head_dim) at the parts' rows; each part's output row of ``out`` (1, rows, heads, head_dim) written,
    and of ``lse`` (rows, heads) float32 if given; each part's new key and value stored in its buffer. False (said
    once; nothing written) if the launch failed."""
    kv_heads, (heads, head_dim) = key.shape[1], (query.shape[1], query.shape[3])
    if key.dtype != batch.dtype or value.dtype != batch.dtype or any(t.stride(3) != 1 for t in (query, key, value, out)):
        return False  # the kernel stores the new keys and values into the buffers as they are
    g = heads // kv_heads
    gp, dp = triton_pow2(g), triton_pow2(head_dim)
    # Triton launches on the current device: the tensors' own
    on = torch.cuda.device(query.device) if query.device.type == "cuda" else contextlib.nullcontext()
    try:
        with on:
            _kernel()[(len(batch), kv_heads)](
                query, query.stride(1), query.stride(2), key, key.stride(1), key.stride(2), value, value.stride(1), value.stride(2),
                batch.qrow, batch.orow, batch.kaddr, batch.vaddr, batch.stride_l, batch.stride_h, batch.first(window), batch.filled,
                out, out.stride(1), out.stride(2), lse if lse is not None else out, layer, scale,
                G=g, GP=gp, D=head_dim, DP=dp, BLOCK=block(gp, dp), WRITE_LSE=lse is not None, num_warps=4)  # fmt: skip
    except Exception as e:  # noqa: BLE001  the compiler's and the driver's error types vary across Triton versions
        FAILED[query.device.type] = f"{type(e).__name__}: {e}"
        log.warning("the decode attention kernel failed on %s (%s): requests read one call each", query.device.type, e)
        return False
    return True


def triton_pow2(n: int) -> int:
    """The least power of two >= ``n`` (Triton's block sizes)."""
    return 1 << max(0, n - 1).bit_length()


def block(gp: int, dp: int) -> int:
    """Keys a program reads at once: its (query heads x keys x head_dim) product held in about 8K floats."""
    return max(16, min(64, 8192 // (gp * dp)))
