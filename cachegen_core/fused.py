"""Native decoding of a chunk's components: entropy decoding and dequantisation in one C++ pass (``csrc/kv_fused.cpp``).

Each substream (a block of tokens) is decoded by one thread and its symbols are written
straight out as float32 components ``(s - 128) * step`` into a ``(2, layers, heads,
coded_tokens, dim)`` tensor: no symbol array and no torch pass over symbols. The arithmetic
is the reference dequantiser's (one rounding), so the result is bit-identical to
``KVCodec``'s torch path; the per-head synthesis, the mean, the rotary embedding and the
output dtype are then the same torch code on both paths (``pipeline.synthesise_parts``).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .coders import native_lib
from .coders.native_lib import CODER_NAME, cached_tables, describe, ptr
from .errors import CacheGenFormatError, CoderError
from .kv import empty_tensor
from .quantize import OFFSET, RADIUS
from .substreams import ChunkGeometry


def supports(coder: str) -> bool:
    """Whether a blob of ``coder`` can be decoded natively here (the native CPU library loads)."""
    if coder != CODER_NAME:
        return False
    try:
        return hasattr(native_lib.cpu_library(), "cg_decode_components")
    except CoderError:
        return False


def decode_components(
    blob: bytes | memoryview,
    lengths: list[int],
    layout_offsets: np.ndarray,
    table_ids: np.ndarray,
    freqs: np.ndarray,
    geo: ChunkGeometry,
    step: torch.Tensor,
    *,
    threads: int | None = None,
) -> torch.Tensor:
    """Decode a blob's substreams (its last ``sum(lengths)`` bytes, checksums already verified) and
    dequantise them at ``step`` (float32 ``(2, layers, heads, dim)``): float32 components
    ``(2, layers, heads, coded_tokens, dim)``."""
    lib = native_lib.cpu_library()
    t = cached_tables(freqs)
    data = np.frombuffer(blob, dtype=np.uint8)
    data = data[len(data) - sum(lengths) :] if sum(lengths) else np.zeros(1, dtype=np.uint8)  # the payloads end the blob
    in_off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=in_off[1:])
    out = empty_tensor((2, geo.layers, geo.heads, geo.coded_tokens, geo.dim), torch.float32)
    steps = np.ascontiguousarray(step.float().reshape(-1).numpy())
    status = np.zeros(max(1, len(lengths)), dtype=np.int32)
    offsets = np.ascontiguousarray(layout_offsets, dtype=np.int64)
    tids = np.ascontiguousarray(table_ids, dtype=np.int32)
    err = lib.cg_decode_components(
        ptr(data), ptr(in_off), len(lengths), ptr(offsets), ptr(tids), tids.shape[1], ptr(t.info), ptr(t.lut), t.lut_bits,
        t.n_tables, t.alphabet, geo.dim, geo.coded_tokens, OFFSET - RADIUS, ptr(steps), out.data_ptr(), ptr(status),
        threads or os.cpu_count() or 1,
    )  # fmt: skip
    if err:
        bad = np.flatnonzero(status[: len(lengths)])
        where = f"substream {int(bad[0])}: " if bad.size else ""
        code = int(status[bad[0]]) if bad.size else err
        if code == -6:
            raise CacheGenFormatError(f"{where}symbol out of range")
        raise CoderError(f"native fused decode failed: {where}{describe(code)}")
    return out
