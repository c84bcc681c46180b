"""The native interleaved-rANS coder on the CPU: threaded C++ (``csrc/rans_cpu.cpp``) behind ``Coder``.

Building and loading the library, its error codes and its table form: ``native_lib.py``.
The byte format is documented in ``csrc/rans_core.h``; its GPU decoder is ``triton_decoder.py``.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from ..errors import CoderError
from .base import StreamLayout
from .native_lib import CODER_NAME, CoderTables, cached_tables, cpu_library, describe, join_payloads, ptr


def _check_symbols(symbols: np.ndarray, layout: StreamLayout) -> np.ndarray:
    if not isinstance(symbols, np.ndarray) or symbols.dtype != np.uint8 or symbols.ndim != 1:
        raise CoderError("symbols must be a flat uint8 numpy array")
    if symbols.shape[0] != layout.n_symbols:
        raise CoderError(f"symbols hold {symbols.shape[0]} entries, the layout {layout.n_symbols}")
    return np.ascontiguousarray(symbols)


class NativeCoder:
    """Interleaved rANS (16 lanes, 16-bit tables) over substreams, threaded over substreams."""

    name = CODER_NAME

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads or os.cpu_count() or 1)
        self._lib = cpu_library()

    def tables(self, freqs: np.ndarray) -> CoderTables:
        """The coder form of ``freqs`` (validated and cached; see ``native_lib.cached_tables``)."""
        return cached_tables(freqs)

    def encode(self, symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray) -> list[bytes]:
        """Code ``symbols`` into one byte string per substream (format: ``csrc/rans_core.h``)."""
        t = self.tables(freqs)
        layout.validate(t.n_tables)
        symbols = _check_symbols(symbols, layout)
        counts = layout.counts()
        caps = np.where(counts > 0, 2 * counts + 4 * self._lib.cg_lanes(), 0)
        out_off = np.zeros(layout.n_streams + 1, dtype=np.int64)
        np.cumsum(caps, out=out_off[1:])
        out = np.empty(max(1, int(out_off[-1])), dtype=np.uint8)
        sizes = np.zeros(max(1, layout.n_streams), dtype=np.int64)
        tids = np.ascontiguousarray(layout.table_ids)
        offsets = np.ascontiguousarray(layout.offsets)
        err = self._lib.cg_encode(
            ptr(symbols), ptr(offsets), layout.n_streams, ptr(tids), layout.period,
            ptr(t.info), t.n_tables, t.alphabet, ptr(out), ptr(out_off), ptr(sizes), self.threads,
        )  # fmt: skip
        if err:
            raise CoderError(f"native encode failed: {describe(err)}")
        return [out[a : a + n].tobytes() for a, n in zip(out_off[:-1].tolist(), sizes.tolist())]

    def decode(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray) -> np.ndarray:
        """Decode one byte string per substream into the flat uint8 symbols; ``CoderError`` on bad input."""
        out = np.empty(layout.n_symbols, dtype=np.uint8)
        self.decode_into(payloads, layout, freqs, out)
        return out

    def decode_into(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray, out: np.ndarray) -> None:
        """``decode`` into a caller's contiguous uint8 array of ``layout.n_symbols`` entries."""
        t = self.tables(freqs)
        layout.validate(t.n_tables)
        if not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.shape == (layout.n_symbols,)):
            raise CoderError(f"output must be a uint8 array of shape ({layout.n_symbols},)")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise CoderError("output array must be contiguous and writeable")
        buf, in_off = join_payloads(payloads, layout.n_streams)
        status = np.zeros(max(1, layout.n_streams), dtype=np.int32)
        tids = np.ascontiguousarray(layout.table_ids)
        offsets = np.ascontiguousarray(layout.offsets)
        target = out if out.size else np.empty(1, dtype=np.uint8)
        err = self._lib.cg_decode(
            ptr(buf), ptr(in_off), layout.n_streams, ptr(offsets), ptr(tids), layout.period,
            ptr(t.info), ptr(t.lut), t.lut_bits, t.n_tables, t.alphabet, ptr(target), ptr(status), self.threads,
        )  # fmt: skip
        if err:
            bad = np.flatnonzero(status[: layout.n_streams])
            where = f"substream {int(bad[0])}: " if bad.size else ""
            raise CoderError(f"native decode failed: {where}{describe(status[bad[0]] if bad.size else err)}")
