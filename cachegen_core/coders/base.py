"""The entropy-coder interfaces and the rules every coder shares.

``Coder``: one byte format's encoder and CPU decoder (reference/torchac, native).
``SymbolDecoder``: a decoder of one byte format on one device (``registry.get_decoder``).

A coder turns many independent *substreams* of 8-bit symbols into one byte string
each, and back. Probability models are plain data, kept apart from the coder (as in
constriction): a table set is an integer frequency array ``freqs`` of shape
``(n_tables, alphabet)`` whose rows each sum to ``2**PRECISION`` with every entry >= 1
(so every symbol of the alphabet stays encodable, and no zero-width interval can
confuse a decoder). Which table codes which symbol is given per substream by a short
*period*: symbol ``j`` of substream ``s`` uses table ``table_ids[s, j % period]``. For
KV chunks the period is the number of channels, so tables are shared per channel and
no coder ever materialises a CDF per symbol.

Substreams are independent so that CPU threads and CUDA threads can each decode their
own with no coordination; the container stores their byte lengths and checksums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import BackendUnavailable, CoderError  # noqa: F401  (BackendUnavailable re-exported)

if TYPE_CHECKING:
    import torch

PRECISION = 16
TOTAL_FREQ = 1 << PRECISION
MAX_ALPHABET = 256


@dataclass(frozen=True)
class StreamLayout:
    """How a flat symbol array is cut into substreams, and the table of every symbol.

    ``offsets``: int64, shape ``(n_streams + 1,)``, non-decreasing, ``offsets[0] == 0``;
    substream ``s`` holds ``symbols[offsets[s]:offsets[s + 1]]``.
    ``table_ids``: int32, shape ``(n_streams, period)``; symbol ``j`` of substream ``s``
    is coded with table ``table_ids[s, j % period]``.
    """

    offsets: np.ndarray
    table_ids: np.ndarray

    @property
    def n_streams(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def n_symbols(self) -> int:
        return int(self.offsets[-1])

    @property
    def period(self) -> int:
        return int(self.table_ids.shape[1])

    def counts(self) -> np.ndarray:
        """Symbols per substream, int64 ``(n_streams,)``."""
        return np.diff(self.offsets)

    def validate(self, n_tables: int) -> None:
        """Raise ``CoderError`` unless the layout is consistent and references valid tables."""
        off, tid = self.offsets, self.table_ids
        if off.ndim != 1 or off.shape[0] < 1 or off.dtype != np.int64:
            raise CoderError("stream offsets must be a 1-D int64 array with at least one entry")
        if off[0] != 0 or (off.shape[0] > 1 and np.any(np.diff(off) < 0)):
            raise CoderError("stream offsets must start at 0 and never decrease")
        if tid.ndim != 2 or tid.dtype != np.int32 or tid.shape[0] != off.shape[0] - 1 or tid.shape[1] < 1:
            raise CoderError(f"table_ids must be int32 of shape (n_streams={off.shape[0] - 1}, period>=1), got {tid.dtype} {tid.shape}")
        rows = tid[:1] if tid.shape[0] > 1 and tid.strides[0] == 0 else tid  # one row seen by every substream: check it once
        if rows.size and (rows.min() < 0 or rows.max() >= n_tables):
            raise CoderError(f"table_ids reference tables outside [0, {n_tables})")


def validate_freqs(freqs: np.ndarray) -> None:
    """Raise ``CoderError`` unless ``freqs`` is a valid table set (see module docstring)."""
    if not isinstance(freqs, np.ndarray) or freqs.ndim != 2:
        raise CoderError("frequency tables must be a 2-D numpy array (n_tables, alphabet)")
    if freqs.dtype != np.uint32:
        raise CoderError(f"frequency tables must be uint32, got {freqs.dtype}")
    n, a = freqs.shape
    if n < 1 or not (2 <= a <= MAX_ALPHABET):
        raise CoderError(f"need >= 1 table and an alphabet of 2..{MAX_ALPHABET} symbols, got {freqs.shape}")
    if freqs.min() < 1:
        raise CoderError("every symbol needs a frequency >= 1")
    sums = freqs.sum(axis=1, dtype=np.int64)
    if np.any(sums != TOTAL_FREQ):
        raise CoderError(f"every table must sum to {TOTAL_FREQ}")


def ideal_bits_per_stream(symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray) -> np.ndarray:
    """Ideal code length in bits of each substream under the tables the layout assigns its symbols.

    float64 ``(n_streams,)``; the sum is the cross-entropy of all ``symbols``, what an ideal
    coder would spend (the bar the coders are measured against).
    """
    stream_of = np.repeat(np.arange(layout.n_streams, dtype=np.int64), layout.counts())
    column = np.arange(layout.n_symbols, dtype=np.int64) - layout.offsets[stream_of]
    np.remainder(column, layout.period, out=column)
    f = freqs[layout.table_ids[stream_of, column], symbols]
    del column
    return np.bincount(stream_of, weights=PRECISION - np.log2(f, dtype=np.float64), minlength=layout.n_streams)


@runtime_checkable
class Coder(Protocol):
    """An entropy coder over substreams. Implementations: ``reference`` (torchac), ``native``."""

    #: Recorded in the container so every blob decodes with the coder that wrote it.
    name: str

    def encode(self, symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray) -> list[bytes]:
        """Code ``symbols`` (uint8, flat, ``< alphabet``) into one byte string per substream."""
        ...

    def decode(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray) -> np.ndarray:
        """Decode one byte string per substream back into the flat uint8 symbol array.

        Garbage, truncated or oversized payloads raise ``CoderError``, or decode to some
        symbols in range (an arithmetic decoder cannot always tell); the container's
        checksums are what reject corrupted bytes. Never crashes, never reads out of bounds.
        """
        ...


@runtime_checkable
class SymbolDecoder(Protocol):
    """Decodes the substreams of one coder's byte format into symbols on one device.

    Obtained from ``coders.get_decoder(coder_name, device)``: the CPU decoder of every
    coder wraps its ``decode``; other devices (``cuda``) have their own implementations.
    """

    #: The coder (byte format) whose payloads it reads, as recorded in blobs.
    name: str
    #: Where the decoded symbols are.
    device: "torch.device"

    def decode_symbols(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray) -> "torch.Tensor":
        """The flat uint8 symbols as a tensor on ``device``; same contract as ``Coder.decode``."""
        ...
