"""Range coding through torchac: the slow, trusted oracle for the symbols.

torchac is an optional extra (``pip install langchain-cachegen[torchac]``): ``available``
tells whether it is installed without importing it (its first import compiles a C++
extension), and the registry lists this coder only then.

torchac wants a CDF per symbol, so each substream's per-channel tables are expanded to
one CDF per symbol; a substream cannot be coded by torchac in pieces (one call = one
byte string), so the codec keeps substreams short enough (``CodecConfig.stream_symbols``)
and this coder refuses ones longer than ``max_stream_symbols`` clearly.
"""

from __future__ import annotations

import importlib.util
import weakref
from typing import Sequence

import numpy as np
import torch

from ..errors import BackendUnavailable, CoderError
from .base import StreamLayout, validate_freqs

_torchac = None


def available() -> bool:
    """Whether torchac is installed (looked up, not imported)."""
    return importlib.util.find_spec("torchac") is not None


def _backend():
    """Import torchac lazily: its first import compiles a C++ extension (tens of seconds, and a compiler)."""
    global _torchac
    if _torchac is None:
        try:
            import torchac  # noqa: PLC0415
        except Exception as e:  # installed, but its extension does not build or load here (no compiler, another torch)
            raise BackendUnavailable(
                f"torchac is installed but does not load ({type(e).__name__}: {e}); install the wheel with the native "
                "coder (make wheel) or a C++ compiler"
            ) from e
        _torchac = torchac
    return _torchac


def _cdf_table(freqs: np.ndarray) -> torch.Tensor:
    """Per-table int16 CDFs in torchac's layout: ``alphabet + 1`` entries, starting at 0."""
    cdf = np.zeros((freqs.shape[0], freqs.shape[1] + 1), dtype=np.int64)
    np.cumsum(freqs, axis=1, out=cdf[:, 1:])
    # The last entry (2**16) is implicit in torchac; int16 wrap-around stores it as 0.
    return torch.from_numpy(cdf.astype(np.uint16).view(np.int16))


class ReferenceCoder:
    """torchac range coder behind the ``Coder`` interface."""

    name = "torchac"

    def __init__(self, max_stream_symbols: int = 1 << 20) -> None:
        self.max_stream_symbols = max_stream_symbols
        self._last: tuple[weakref.ref, torch.Tensor] | None = None  # the CDFs of the last table set

    def _cdfs(self, freqs: np.ndarray) -> torch.Tensor:
        """Validated torchac CDFs of ``freqs``, converted once per table set (a profile's are reused by
        every chunk, as the native coder's are; arrays must not change in place after coding with them)."""
        last = self._last
        if last is not None and last[0]() is freqs:
            return last[1]
        validate_freqs(freqs)
        cdf = _cdf_table(freqs)
        self._last = (weakref.ref(freqs), cdf)
        return cdf

    def _per_symbol_cdf(self, cdf: torch.Tensor, table_ids: np.ndarray, n: int) -> torch.Tensor:
        if n > self.max_stream_symbols:
            raise CoderError(
                f"substream of {n} symbols exceeds the reference coder's limit of {self.max_stream_symbols}; "
                "use shorter substreams (CodecConfig.stream_symbols)"
            )
        idx = torch.from_numpy(np.resize(table_ids, n).astype(np.int64))
        return cdf.index_select(0, idx)

    def encode(self, symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray) -> list[bytes]:
        cdf = self._cdfs(freqs)
        layout.validate(freqs.shape[0])
        if symbols.dtype != np.uint8 or symbols.ndim != 1 or symbols.shape[0] != layout.n_symbols:
            raise CoderError("symbols must be a flat uint8 array matching the layout")
        if symbols.size and int(symbols.max()) >= freqs.shape[1]:
            raise CoderError(f"symbol {int(symbols.max())} outside the alphabet of {freqs.shape[1]}")
        tac = _backend()
        out: list[bytes] = []
        for s in range(layout.n_streams):
            a, b = int(layout.offsets[s]), int(layout.offsets[s + 1])
            if a == b:
                out.append(b"")
                continue
            sym = torch.from_numpy(symbols[a:b].astype(np.int16))
            out.append(tac.encode_int16_normalized_cdf(self._per_symbol_cdf(cdf, layout.table_ids[s], b - a), sym))
        return out

    def decode(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray) -> np.ndarray:
        cdf = self._cdfs(freqs)
        layout.validate(freqs.shape[0])
        if len(payloads) != layout.n_streams:
            raise CoderError(f"expected {layout.n_streams} substreams, got {len(payloads)}")
        tac = _backend()
        out = np.empty(layout.n_symbols, dtype=np.uint8)
        for s in range(layout.n_streams):
            a, b = int(layout.offsets[s]), int(layout.offsets[s + 1])
            if a == b:
                if payloads[s]:
                    raise CoderError(f"substream {s} should be empty but has {len(payloads[s])} bytes")
                continue
            if not payloads[s]:
                raise CoderError(f"substream {s} is empty but should hold {b - a} symbols")
            sym = tac.decode_int16_normalized_cdf(self._per_symbol_cdf(cdf, layout.table_ids[s], b - a), bytes(payloads[s]))
            out[a:b] = sym.numpy().astype(np.uint8)
        return out
