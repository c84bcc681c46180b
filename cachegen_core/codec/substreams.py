"""How a chunk's symbols are cut into substreams, and which frequency table codes each symbol.

The coded tokens of a chunk (all but the exact sink tokens) are cut into blocks of
consecutive tokens, as even as possible and each of at least ``tokens_per_stream`` tokens
(``CodecConfig``) unless the chunk is smaller; one substream per block. Inside a
substream symbols are token-major, then kind (keys, values), layer and component
(``head * dim + j``), so symbol ``j`` of any substream belongs to (kind, layer,
component) number ``j mod (2 x layers x channels)``: the coder's period. Every substream
is long enough for the rANS flush to stay a small fraction of it, whatever the rate of
each layer (``docs/format.md``).

Tables: every symbol is coded with one of the codec's fixed tables (``classes.py``), the class
of its (kind, layer, component): with a profile, the profile's class at the blob's level;
without one, the class the encoder picked on the chunk (``chunk_classes``), stored in the blob.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..coders import StreamLayout
from .classes import classes_from_counts
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


def stream_layout(geo: ChunkGeometry, row: np.ndarray) -> StreamLayout:
    """Substream offsets and the table of every (substream, position in the period): ``row``, the class
    of each position of the period (int ``(2 * layers * channels,)``), seen by every substream (a read-only
    view; coders that need the rows in memory copy them)."""
    offsets = np.concatenate([[0], np.cumsum(np.array(geo.block_tokens, dtype=np.int64) * geo.period)]).astype(np.int64)
    row = np.asarray(row, dtype=np.int32).reshape(geo.period)
    return StreamLayout(offsets, np.broadcast_to(row, (geo.n_streams, geo.period)))  # one row for every substream: a view


def flatten_symbols(symbols: torch.Tensor) -> np.ndarray:
    """``(2, layers, heads, tokens, dim)`` -> flat uint8 in substream order (token, kind, layer, head, dim)."""
    return symbols.permute(3, 0, 1, 2, 4).reshape(-1).cpu().numpy()


def unflatten_symbols(flat: torch.Tensor, geo: ChunkGeometry) -> torch.Tensor:
    """Inverse of ``flatten_symbols`` (on the symbols' device)."""
    return flat.reshape(geo.coded_tokens, 2, geo.layers, geo.heads, geo.dim).permute(1, 2, 3, 0, 4)


#: Tokens whose symbols pick a chunk's classes (evenly spaced through it): enough to rank 64 laws.
CLASS_SAMPLE_TOKENS = 256


def chunk_classes(flat: np.ndarray, geo: ChunkGeometry, n_classes: int) -> np.ndarray:
    """The class of each (kind, layer, component) picked on a chunk's own symbols (``flat``, in substream
    order), as a codec without a profile stores them: uint8 ``(2, layers, channels)``. Each is the class
    coding the component's symbols in the fewest bits, counted on at most ``CLASS_SAMPLE_TOKENS`` tokens."""
    if not geo.coded_tokens:
        return np.zeros((2, geo.layers, geo.channels), dtype=np.uint8)
    stride = -(-geo.coded_tokens // CLASS_SAMPLE_TOKENS)
    x = torch.from_numpy(flat).view(geo.coded_tokens, geo.period)[::stride].to(torch.int32)
    x += torch.arange(0, geo.period * ALPHABET, ALPHABET, dtype=torch.int32)
    counts = torch.bincount(x.view(-1), minlength=geo.period * ALPHABET).view(geo.period, ALPHABET)
    return classes_from_counts(counts.numpy(), n_classes).reshape(2, geo.layers, geo.channels)
