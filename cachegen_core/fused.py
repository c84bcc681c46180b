"""Fused native decoding of a chunk: entropy decoding and dequantisation in one C++ pass (``csrc/kv_fused.cpp``).

The native coder's substreams of each (kind, layer) are decoded by one thread, anchors
first, and every value is written straight into the destination KV tensor (a slice of
the prompt's preallocated cache) in its dtype: no symbol array, no float32 copy, no
concatenation, no pass over the output. The arithmetic is the reference dequantiser's
operation for operation, so the result is bit-identical to ``KVCodec``'s torch path in
float32 (and rounded once to a 16-bit output dtype). What a pass over the output would
have caught is checked on the parameters instead (:func:`check_bound`).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .coders import native_lib
from .coders.native_lib import CODER_NAME, cached_tables, describe, ptr
from .errors import CacheGenFormatError, CoderError
from .kv import KVCache
from .substreams import ChunkGeometry

_OUT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def supports(coder: str, out: KVCache) -> bool:
    """Whether a blob of ``coder`` can be fused-decoded into ``out`` here (native library, CPU, a float dtype)."""
    if coder != CODER_NAME or out.keys.device.type != "cpu" or out.dtype not in _OUT_DTYPES:
        return False
    if out.keys.stride() != out.values.stride() or out.keys.stride(-1) != 1:
        return False
    try:
        return hasattr(native_lib.cpu_library(), "cg_decode_kv")
    except CoderError:
        return False


def check_bound(params: dict[str, torch.Tensor], anchor_levels: int, dtype: torch.dtype) -> None:
    """``CacheGenFormatError`` unless every value the parameters can decode to is finite in ``dtype``.

    A value is at most ``|anchor_min| + (anchor_levels - 1) * anchor_step + 128 * delta_step``
    in magnitude; bounding that (in float64) replaces checking the output."""
    bound = params["anchor_min"].double().abs() + (anchor_levels - 1) * params["anchor_step"].double()
    bound = bound + 128 * params["delta_step"].double()
    if float(bound.max()) >= torch.finfo(dtype).max:
        raise CacheGenFormatError(f"the blob's quantisation parameters decode to values beyond {dtype}'s range")


def stream_descriptors(geo: ChunkGeometry) -> np.ndarray:
    """Per substream, in substream order: (kind, layer, part 0 anchors / 1 deltas, index of its first row)."""
    rows = []
    for kind in range(2):
        for layer in range(geo.layers):
            a = d = 0
            for na, nd in zip(geo.anchors_per_block, geo.deltas_per_block):
                rows += [(kind, layer, 0, a), (kind, layer, 1, d)]
                a, d = a + na, d + nd
    return np.ascontiguousarray(np.array(rows, dtype=np.int32).reshape(-1, 4))


def decode_into(
    blob: bytes | memoryview,
    lengths: list[int],
    layout_offsets: np.ndarray,
    table_ids: np.ndarray,
    freqs: np.ndarray,
    geo: ChunkGeometry,
    params: dict[str, torch.Tensor],
    *,
    head_dim: int,
    group_size: int,
    anchor_offset: int,
    min_anchor_symbol: int,
    out: KVCache,
    threads: int | None = None,
) -> None:
    """Decode a blob's substreams (its last ``sum(lengths)`` bytes, checksums already verified) into ``out``."""
    lib = native_lib.cpu_library()
    t = cached_tables(freqs)
    data = np.frombuffer(blob, dtype=np.uint8)
    data = data[len(data) - sum(lengths) :] if sum(lengths) else np.zeros(1, dtype=np.uint8)  # the payloads end the blob
    in_off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=in_off[1:])
    desc = stream_descriptors(geo)
    packed = np.ascontiguousarray(torch.stack([params[n] for n in ("anchor_min", "anchor_step", "delta_step")]).float().numpy())
    status = np.zeros(max(1, len(lengths)), dtype=np.int32)
    offsets = np.ascontiguousarray(layout_offsets, dtype=np.int64)
    tids = np.ascontiguousarray(table_ids, dtype=np.int32)
    k, v = out.keys, out.values
    err = lib.cg_decode_kv(
        ptr(data), ptr(in_off), len(lengths), ptr(offsets), ptr(tids), tids.shape[1], ptr(t.info), ptr(t.lut), t.lut_bits,
        t.n_tables, t.alphabet, ptr(desc), geo.layers, geo.tokens, geo.channels, head_dim, group_size, anchor_offset,
        min_anchor_symbol, ptr(packed), k.data_ptr(), v.data_ptr(), _OUT_DTYPES[out.dtype],
        k.stride(0), k.stride(1), k.stride(2), ptr(status), threads or os.cpu_count() or 1,
    )  # fmt: skip
    if err:
        bad = np.flatnonzero(status[: len(lengths)])
        where = f"substream {int(bad[0])}: " if bad.size else ""
        code = int(status[bad[0]]) if bad.size else err
        if code == -6:
            raise CacheGenFormatError(f"{where}symbol out of range")
        raise CoderError(f"native fused decode failed: {where}{describe(code)}")
