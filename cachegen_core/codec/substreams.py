"""How a chunk's symbols are cut into substreams, and which frequency table codes each symbol.

The coded tokens of a chunk (all but the exact sink tokens) are cut into blocks of
consecutive tokens, as even as possible and each of at least ``tokens_per_stream`` tokens
(``CodecConfig``) unless the chunk is smaller; one substream per block. Inside a
substream symbols are token-major, then kind (keys, values), layer and component
(``head * dim + j``), so symbol ``j`` of any substream belongs to (kind, layer,
component) number ``j mod (2 x layers x channels)``: the coder's period. Every substream
is long enough for the rANS flush to stay a small fraction of it, whatever the rate of
each layer (``docs/format.md``).

Tables: with a profile, one per (level, kind, layer, component) (``TableLayout``);
inline, one per (kind, layer), measured on the chunk itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..coders import StreamLayout
from .profile import TableLayout, counts_to_freqs
from .quantize import ALPHABET


@dataclass(frozen=True)
class ChunkGeometry:
    """Shape of a chunk's coded part and its cut into substreams."""

    layers: int
    heads: int
    dim: int
    coded_tokens: int
    block_tokens: tuple[int, ...]

    @classmethod
    def of(cls, layers: int, heads: int, dim: int, coded_tokens: int, tokens_per_stream: int) -> "ChunkGeometry":
        n = max(1, coded_tokens // max(tokens_per_stream, 1)) if coded_tokens else 0
        base, extra = divmod(coded_tokens, n) if n else (0, 0)
        return cls(layers, heads, dim, coded_tokens, tuple(base + (i < extra) for i in range(n)))

    @property
    def channels(self) -> int:
        return self.heads * self.dim

    @property
    def period(self) -> int:
        """Symbols per token: 2 x layers x channels."""
        return 2 * self.layers * self.channels

    @property
    def n_streams(self) -> int:
        return len(self.block_tokens)

    @property
    def n_symbols(self) -> int:
        return self.coded_tokens * self.period


def n_inline_tables(layers: int) -> int:
    """Tables a blob carries without a profile: one per (kind, layer)."""
    return 2 * layers


def stream_layout(geo: ChunkGeometry, level: int, tables: TableLayout | None) -> StreamLayout:
    """Substream offsets and the table of every (substream, position in the period): one row, seen by every
    substream (a read-only view; coders that need the rows in memory copy them)."""
    offsets = np.concatenate([[0], np.cumsum(np.array(geo.block_tokens, dtype=np.int64) * geo.period)]).astype(np.int64)
    if tables is None:
        row = np.repeat(np.arange(2 * geo.layers, dtype=np.int32), geo.channels)
    else:
        row = (tables.level_base(level) + np.arange(geo.period)).astype(np.int32)
    return StreamLayout(offsets, np.broadcast_to(row, (geo.n_streams, geo.period)))  # one row for every substream: a view


def flatten_symbols(symbols: torch.Tensor) -> np.ndarray:
    """``(2, layers, heads, tokens, dim)`` -> flat uint8 in substream order (token, kind, layer, head, dim)."""
    return symbols.permute(3, 0, 1, 2, 4).reshape(-1).cpu().numpy()


def unflatten_symbols(flat: torch.Tensor, geo: ChunkGeometry) -> torch.Tensor:
    """Inverse of ``flatten_symbols`` (on the symbols' device)."""
    return flat.reshape(geo.coded_tokens, 2, geo.layers, geo.heads, geo.dim).permute(1, 2, 3, 0, 4)


def inline_tables(flat: np.ndarray, geo: ChunkGeometry, counts: np.ndarray | None = None) -> np.ndarray:
    """The inline tables of a chunk (one per (kind, layer)), measured on its own symbols; ``counts``:
    the symbols' counts per table ``(2 * layers, 256)`` when already known (the native encoder's)."""
    if counts is None:
        n = n_inline_tables(geo.layers)
        rows = flat.reshape(geo.coded_tokens, n, geo.channels)  # one table per row of the period
        counts = np.stack([np.bincount(rows[:, t].ravel(), minlength=ALPHABET) for t in range(n)])
    return counts_to_freqs(counts, alpha=0.0)
