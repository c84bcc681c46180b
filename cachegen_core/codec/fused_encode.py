"""Quantisation of a chunk for the coder, natively where it can be (``csrc/kv_encode.cpp``).

``quantise_chunk`` does what ``pipeline.components``, ``pipeline.quantise`` and
``substreams.flatten_symbols`` do (and, asked, the count of every symbol per (kind, layer)). On the CPU,
without a fitted transform, that is one threaded C++ pass over the chunk (which may be a token
slice of a larger buffer), a task per (kind, layer) that reads its layer once and, from the
cache, finds the bfloat16 means, min, max and RMS of the coded tokens (keys un-rotated), the
steps (``quantize.steps``), the symbols and their counts, and checks that every value is finite;
then the symbols are put in substream order. With a fitted transform torch computes the
components, and the native pass finds their steps and symbols.

The native arithmetic is torch's, op for op, and its sums are added in the order of torch's CPU
reductions (``csrc/torch_sum.h``), so means, steps, symbols and blobs are bit-identical to the
torch path's. The torch path remains the reference, and runs where the native library is
missing, the KV is not on the CPU of an x86-64 machine, or a chunk has one layer or no coded token.
"""

from __future__ import annotations

import os
import platform

import numpy as np
import torch

from ..coders import native_lib
from ..coders.native_lib import ptr
from ..errors import CoderError
from ..kv import KVCache, KVShapeError, all_finite
from .pipeline import Coded, components, exact_tokens, quantise
from .quantize import ALPHABET
from .rotary import RotarySpec
from .substreams import flatten_symbols
from .transform import Transform

X86 = frozenset({"x86_64", "amd64"})


def supports(kv: KVCache) -> bool:
    """Whether ``kv`` can be quantised natively here: on the CPU of an x86-64 machine (whose torch
    reductions ``csrc/torch_sum.h`` follows) where the native library loads."""
    if kv.keys.device.type != "cpu" or kv.values.device.type != "cpu" or platform.machine().lower() not in X86:
        return False
    try:
        return hasattr(native_lib.cpu_library(), "cg_encode_chunk")
    except CoderError:
        return False


def quantise_chunk(
    kv: KVCache,
    transform: Transform,
    level_step: float,
    *,
    fitted: bool,
    step_cap: float = 0.0,
    start: int = 0,
    sink_tokens: int = 1,
    rotary: RotarySpec | None = None,
    weights: torch.Tensor | None = None,
    count: bool = False,
    native: bool | None = None,
    threads: int | None = None,
) -> tuple[Coded, np.ndarray, np.ndarray | None]:
    """``kv`` quantised at ``level_step`` (``pipeline.quantise``'s arguments, ``weights`` included): the ``Coded`` chunk, its
    symbols flat in substream order (``flatten_symbols``) and, when ``count`` and done natively, the
    count of every symbol per (kind, layer) (int64 ``(2 * layers, 256)``; else None).

    ``KVShapeError`` when ``kv`` holds a NaN or an infinity. ``native``: None picks the native
    path where ``supports`` says so; False forces torch's, True the native one (for CPU tensors).
    """
    n_exact = exact_tokens(start, kv.num_tokens, sink_tokens)
    # torch splits a reduction to one number (a one-layer model's RMS) across threads, in no fixed order
    native = (supports(kv) if native is None else native) and n_exact < kv.num_tokens and kv.num_layers > 1
    if not native or fitted:
        if not (all_finite(kv.keys) and all_finite(kv.values)):
            raise KVShapeError("KV cache contains NaN or infinite values")
        comp = components(kv, transform, start=start, sink_tokens=sink_tokens, rotary=rotary)
        if not native:
            coded = quantise(comp, level_step, fitted=fitted, step_cap=step_cap, weights=weights)
            return coded, flatten_symbols(coded.symbols), None
        _, step, flat, counts = _encode_chunk([_float32_rows(c) for c in comp.values], 0, None, level_step, step_cap, True,
                                              None, count, threads)  # fmt: skip
        return _coded(flat, comp.mean, step, comp.exact), flat, counts
    x = [_float32_rows(t) for t in (kv.keys, kv.values)]
    rot = _cos_sin(rotary, start, kv.num_tokens, n_exact)
    mean, step, flat, counts = _encode_chunk(x, n_exact, rot, level_step, step_cap, False, weights, count, threads)
    return _coded(flat, mean, step, torch.stack([t[:, :, :n_exact] for t in x])), flat, counts


def _encode_chunk(x: list[torch.Tensor], first: int, rot: tuple[torch.Tensor, torch.Tensor, float] | None, level_step: float,
                  cap: float, fitted: bool, weights: torch.Tensor | None, count: bool, threads: int | None,
                  ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray | None]:  # fmt: skip
    """``cg_encode_chunk`` on keys and values ``x`` (float32, rows contiguous) coded from token ``first``:
    float32 means and steps ``(2, layers, heads, dim)``, the flat symbols and (``count``) their counts."""
    layers, heads, tokens, dim = x[0].shape
    w = None if weights is None else np.ascontiguousarray(weights.detach().cpu().numpy(), dtype=np.float32).reshape(2, layers, heads, dim)
    strides = np.array([t.stride()[:3] for t in x], dtype=np.int64).reshape(-1)
    extents = np.array([t.untyped_storage().nbytes() // 4 - t.storage_offset() for t in x], dtype=np.int64)
    cos, sin, scale2 = rot if rot is not None else (None, None, 1.0)
    mean, step = (np.empty((2, layers, heads, dim), dtype=np.float32) for _ in range(2))
    n = (tokens - first) * 2 * layers * heads * dim
    out, scratch = np.empty(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
    counts = np.empty((2 * layers, ALPHABET), dtype=np.int64) if count else None
    finite = np.zeros(1, dtype=np.int32)
    err = native_lib.cpu_library().cg_encode_chunk(
        x[0].data_ptr(), x[1].data_ptr(), ptr(strides), ptr(extents), layers, heads, tokens, dim, first,
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), scale2, level_step, cap,
        int(fitted), None if w is None else ptr(w), ptr(mean), ptr(step), ptr(out), n, ptr(scratch), None if counts is None else ptr(counts), ptr(finite),
        threads or os.cpu_count() or 1,
    )  # fmt: skip
    if err == -6 or (not err and not finite[0]):  # CG_ERR_SYMBOL: a quotient that is not a number
        raise KVShapeError("KV cache contains NaN or infinite values")
    if err:
        raise CoderError(f"native quantisation failed: {native_lib.describe(err)}")
    return torch.from_numpy(mean), torch.from_numpy(step), out, counts


def _float32_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 with contiguous rows (the last axis), copied only when it is not."""
    x = x.float()
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _cos_sin(rotary: RotarySpec | None, start: int, tokens: int, first: int) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The rotary tables of the coded tokens and the divisor of ``RotarySpec.unrotate``, computed as it does."""
    if rotary is None:
        return None
    cos, sin = rotary.cos_sin(start, tokens)  # of every token, as unrotate computes them, then the coded ones
    return cos[first:].contiguous(), sin[first:].contiguous(), float(np.float32(rotary.attention_scaling**2))


def _coded(flat: np.ndarray, mean: torch.Tensor, step: torch.Tensor, exact: torch.Tensor) -> Coded:
    """A ``Coded`` whose symbols are a component-order view of the flat ones."""
    _, layers, heads, _, dim = exact.shape
    symbols = torch.from_numpy(flat).reshape(-1, 2, layers, heads, dim).permute(1, 2, 3, 0, 4)
    return Coded(symbols, mean, step, exact)
