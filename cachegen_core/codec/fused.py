"""Native decoding of a chunk in one threaded C++ pass (``csrc/kv_fused.cpp``): entropy decoding and
dequantisation, and without a profile's transform the whole reconstruction.

Each substream (a block of tokens) is decoded by one thread, with no symbol array and no
torch pass over symbols. Two entry points:

- ``decode_kv`` (a codec without a profile): every element's ``(s - 128) * step + mean``, the
  keys' rotary embedding and the rounding to the output dtype (``csrc/kv_core.h``), written
  straight into the caller's KV tensors (a slice of a prompt's buffer): the KV in one pass;
- ``decode_components``: float32 components ``(s - 128) * step`` into a ``(2, layers, heads,
  coded_tokens, dim)`` tensor, for the synthesis of a profile's transform in torch
  (``pipeline.synthesise_parts``).

The arithmetic is the torch reference's, one rounding per operation in the same order, so
both are bit-identical to ``KVCodec``'s torch path (``tests/test_fused.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..coders import StreamLayout, native_lib
from ..coders.native_lib import CODER_NAME, cached_tables, describe, ptr
from ..errors import CacheGenFormatError, CoderError
from ..kv import KVCache, empty_tensor
from .quantize import OFFSET, RADIUS
from .substreams import ChunkGeometry

log = logging.getLogger(__name__)

#: Output dtypes ``decode_kv`` writes (``CG_OUT_*`` of ``csrc/kv_core.h``).
OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def supports(coder: str) -> bool:
    """Whether a blob of ``coder`` can be decoded natively here (the native CPU library loads)."""
    if coder != CODER_NAME:
        return False
    try:
        return hasattr(native_lib.cpu_library(), "cg_decode_components")
    except CoderError:
        return False


def _payloads(blob: bytes | memoryview, lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The substream payloads (they end the blob) as one uint8 array, never empty, and their int64 offsets."""
    data = np.frombuffer(blob, dtype=np.uint8)
    data = data[len(data) - sum(lengths) :] if sum(lengths) else np.zeros(1, dtype=np.uint8)
    in_off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=in_off[1:])
    return data, in_off


def _check(err: int, status: np.ndarray) -> None:
    """Raise for a failed native decode: ``CacheGenFormatError`` for a symbol out of range, else ``CoderError``."""
    if not err:
        return
    bad = np.flatnonzero(status)
    where = f"substream {int(bad[0])}: " if bad.size else ""
    code = int(status[bad[0]]) if bad.size else err
    if code == -6:
        raise CacheGenFormatError(f"{where}symbol out of range")
    raise CoderError(f"native fused decode failed: {where}{describe(code)}")


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a blob's substreams (its last ``sum(lengths)`` bytes, checksums already verified) and
    dequantise them at ``step`` (float32 ``(2, layers, heads, dim)``): float32 components
    ``(2, layers, heads, coded_tokens, dim)``, written into ``out`` when given (contiguous, that shape)."""
    lib = native_lib.cpu_library()
    t = cached_tables(freqs)
    data, in_off = _payloads(blob, lengths)
    shape = (2, geo.layers, geo.heads, geo.coded_tokens, geo.dim)
    if out is None:
        out = empty_tensor(shape, torch.float32)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 CPU tensor of shape {shape}")
    steps = np.ascontiguousarray(step.float().reshape(-1).numpy())
    status = np.zeros(max(1, len(lengths)), dtype=np.int32)
    offsets = np.ascontiguousarray(layout_offsets, dtype=np.int64)
    tids = np.ascontiguousarray(table_ids, dtype=np.int32)
    err = lib.cg_decode_components(
        ptr(data), ptr(in_off), len(lengths), ptr(offsets), ptr(tids), tids.shape[1], ptr(t.info), ptr(t.lut), t.lut_bits,
        t.n_tables, t.alphabet, geo.dim, geo.coded_tokens, OFFSET - RADIUS, ptr(steps), out.data_ptr(), ptr(status),
        threads or os.cpu_count() or 1,
    )  # fmt: skip
    _check(err, status[: len(lengths)])
    return out


def writes_kv(out: KVCache, blob_dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> bool:
    """Whether a KV decoder on ``device`` can write a blob of ``blob_dtype`` into ``out``: tensors there of that
    same dtype (one rounding, as the reference), with the same strides and contiguous head vectors."""
    k, v = out.keys, out.values
    return (
        k.device == v.device and k.device.type == device.type and (device.index is None or k.device == device)
        and k.dtype == blob_dtype and v.dtype == k.dtype and k.dtype in OUT_DTYPES
        and k.stride() == v.stride() and k.stride(3) == 1
    )  # fmt: skip


def fuses_on(decoder: Any, head_dim: int, rotary: bool) -> bool:
    """Whether a device decoder (``coders.get_decoder``; None: none) writes KV itself for heads of ``head_dim``
    (the Triton decoder: ``TritonDecoder.fuses``), and has not failed its check on its device (``verify_once``)."""
    fuses = getattr(decoder, "fuses", None)
    return fuses is not None and fuses(head_dim, rotary) and str(getattr(decoder, "device", "")) not in _UNFUSED


def decode_kv_on(decoder: Any, blob: bytes | memoryview, lengths: list[int], layout: StreamLayout, freqs: np.ndarray,
                 geo: ChunkGeometry, step: torch.Tensor, mean: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
                 out: KVCache) -> None:  # fmt: skip
    """``decode_kv`` by a device decoder (``TritonDecoder.decode_kv``), ``out`` and ``cos_sin`` on its device."""
    data, in_off = _payloads(blob, lengths)
    decoder.decode_kv(
        data, in_off, layout, freqs, heads=geo.heads, head_dim=geo.dim, min_symbol=OFFSET - RADIUS, step=step, mean=mean,
        cos_sin=cos_sin, keys=out.keys, values=out.values, first_token=out.keys.shape[2] - geo.coded_tokens,
    )  # fmt: skip


def decode_components_on(decoder: Any, blob: bytes | memoryview, lengths: list[int], layout: StreamLayout,
                         freqs: np.ndarray, geo: ChunkGeometry, step: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``decode_components`` by a device decoder (``TritonDecoder.decode_components``), on its device."""
    data, in_off = _payloads(blob, lengths)
    return decoder.decode_components(data, in_off, layout, freqs, layers=geo.layers, heads=geo.heads, head_dim=geo.dim,
                                     coded_tokens=geo.coded_tokens, min_symbol=OFFSET - RADIUS, step=step)  # fmt: skip


#: Devices whose fused kernel agreed with the torch path on its first chunk, and those where it did not.
_VERIFIED: set[str] = set()
_UNFUSED: set[str] = set()


def verify_once(device: torch.device, out: KVCache, reference: Callable[[], KVCache]) -> None:
    """On a device's first fused decode, compare ``out`` with the torch path's KV (``reference()``); if they differ
    (a kernel never run on this hardware before), log it, use the reference and stop fusing on that device."""
    key = str(device)
    if key in _VERIFIED or key in _UNFUSED:
        return
    ref = reference()
    if torch.equal(ref.keys, out.keys) and torch.equal(ref.values, out.values):
        _VERIFIED.add(key)
        return
    _UNFUSED.add(key)
    log.warning("the fused KV decoder on %s disagrees with the torch path: decoding there without it from now on", key)
    out.keys.copy_(ref.keys)
    out.values.copy_(ref.values)


def decode_kv(
    blob: bytes | memoryview,
    lengths: list[int],
    layout: StreamLayout,
    freqs: np.ndarray,
    geo: ChunkGeometry,
    step: torch.Tensor,
    mean: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    out: KVCache,
    *,
    threads: int | None = None,
) -> None:
    """Decode a blob's substreams (its last ``sum(lengths)`` bytes, checksums already verified) into the
    coded tokens of ``out`` (its last ``geo.coded_tokens`` tokens; ``writes_kv(out, ...)`` must hold).

    ``step``, ``mean``: float32 ``(2, layers, heads, dim)``; ``cos_sin``: float32 ``(coded_tokens,
    dim)`` cos and sin of the coded tokens' positions (``RotarySpec.cos_sin``), or None for keys
    stored as they are. Values that ``pipeline.magnitude_bound`` cannot keep within ``out``'s
    dtype must not be decoded here (nothing is scanned).
    """
    lib = native_lib.cpu_library()
    t = cached_tables(freqs)
    data, in_off = _payloads(blob, lengths)
    steps, means = (np.ascontiguousarray(x.float().reshape(-1).numpy()) for x in (step, mean))
    cos, sin = (np.ascontiguousarray(x.float().numpy()) for x in cos_sin) if cos_sin is not None else (None, None)
    if cos is not None and cos.shape != (geo.coded_tokens, geo.dim):
        raise ValueError(f"cos/sin must be ({geo.coded_tokens}, {geo.dim}), got {cos.shape}")
    status = np.zeros(max(1, len(lengths)), dtype=np.int32)
    offsets = np.ascontiguousarray(layout.offsets, dtype=np.int64)
    tids = np.ascontiguousarray(layout.table_ids, dtype=np.int32)
    k = out.keys
    if tuple(k.shape) != (geo.layers, geo.heads, k.shape[2], geo.dim) or k.shape[2] < geo.coded_tokens:
        raise ValueError(f"out of shape {tuple(k.shape)} cannot hold this chunk")
    err = lib.cg_decode_kv(
        ptr(data), ptr(in_off), len(lengths), ptr(offsets), ptr(tids), tids.shape[1], ptr(t.info), ptr(t.lut), t.lut_bits,
        t.n_tables, t.alphabet, geo.layers, geo.heads, geo.dim, geo.coded_tokens, OFFSET - RADIUS, ptr(steps), ptr(means),
        ptr(cos) if cos is not None else None, ptr(sin) if sin is not None else None, k.data_ptr(), out.values.data_ptr(),
        OUT_DTYPES[k.dtype], k.stride(0), k.stride(1), k.stride(2), k.shape[2] - geo.coded_tokens, ptr(status),
        threads or os.cpu_count() or 1,
    )  # fmt: skip
    _check(err, status[: len(lengths)])
