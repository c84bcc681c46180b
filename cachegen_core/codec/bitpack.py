"""Unsigned integers of varying bit widths packed end to end into bytes (a profile's stored matrices).

Value ``i`` takes ``widths[i]`` bits (1-8), least significant first, right after value ``i - 1``'s;
the last byte is padded with zero bits. numpy only, one pass per bit plane.
"""

from __future__ import annotations

import numpy as np


def packed_size(widths: np.ndarray) -> int:
    """Bytes ``pack`` writes for values of ``widths``."""
    return (int(np.asarray(widths, dtype=np.int64).sum()) + 7) // 8


def pack(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """``values`` (unsigned, each < 2 ** its width) in ``widths`` bits each, as uint8 ``(packed_size(widths),)``."""
    v = np.asarray(values).reshape(-1).astype(np.uint16)
    w = np.asarray(widths, dtype=np.int64).reshape(-1)
    if v.shape != w.shape or (w.size and (w.min() < 1 or w.max() > 8)) or (v >> w.astype(np.uint16)).any():
        raise ValueError("pack: one width in [1, 8] per value, each value below 2 ** its width")
    starts = np.cumsum(w) - w
    bits = np.zeros(8 * packed_size(w), dtype=np.uint8)
    for b in range(8):
        has = w > b
        bits[starts[has] + b] = (v[has] >> b) & 1
    return np.packbits(bits, bitorder="little")


def unpack(data: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The values ``pack`` wrote, uint8 in ``widths``' shape; ``ValueError`` when ``data`` is not
    ``packed_size(widths)`` bytes."""
    data = np.asarray(data)
    w = np.asarray(widths, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 1 or data.size != packed_size(w):
        raise ValueError(f"packed data must be {packed_size(w)} bytes (uint8)")
    flat = w.reshape(-1)
    starts = np.cumsum(flat) - flat
    bits = np.unpackbits(data, bitorder="little")
    out = np.zeros(flat.size, dtype=np.uint8)
    for b in range(8):
        has = flat > b
        out[has] |= bits[starts[has] + b] << np.uint8(b)
    return out.reshape(w.shape)
