"""How a chunk's symbols are cut into substreams, and which frequency table codes each symbol.

For each kind (K, V), layer and block of ``config.tokens_per_stream(channels)`` tokens
there are two substreams, the block's anchors then its deltas, each in token-major
order, so symbol ``j`` of a substream belongs to channel ``j % channels``
(``docs/format.md``). Tables: with a profile, one per channel (``profile.TableLayout``);
inline, one per (kind, layer, anchors|deltas), measured on the chunk itself. Encoder and
decoder build their ``StreamLayout`` here, the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .coders import StreamLayout
from .config import CodecConfig
from .profile import TableLayout, counts_to_freqs
from .quantize import ALPHABET, Quantized


@dataclass(frozen=True)
class ChunkGeometry:
    """Token blocks of a chunk and the resulting substream sizes."""

    layers: int
    tokens: int
    channels: int
    anchors_per_block: tuple[int, ...]
    deltas_per_block: tuple[int, ...]

    @classmethod
    def of(cls, layers: int, tokens: int, channels: int, config: CodecConfig) -> "ChunkGeometry":
        a, d = [], []
        block = config.tokens_per_stream(channels)
        for start in range(0, tokens, block):
            n = min(tokens, start + block) - start
            na = -(-n // config.group_size)
            a.append(na)
            d.append(n - na)
        return cls(layers, tokens, channels, tuple(a), tuple(d))

    @property
    def elements(self) -> int:
        """KV elements of the chunk, keys and values."""
        return 2 * self.layers * self.tokens * self.channels

    @property
    def streams_per_kl(self) -> int:
        """Substreams per (kind, layer): anchors and deltas of every block."""
        return 2 * len(self.anchors_per_block)

    @property
    def n_streams(self) -> int:
        return 2 * self.layers * self.streams_per_kl

    def stream_sizes(self) -> np.ndarray:
        """Symbols per substream, int64 ``(n_streams,)``, in substream order."""
        per_kl = np.array([n for pair in zip(self.anchors_per_block, self.deltas_per_block) for n in pair], dtype=np.int64)
        return np.tile(per_kl * self.channels, 2 * self.layers)


def n_inline_tables(layers: int) -> int:
    """Tables a blob carries without a profile: one per (kind, layer, anchors|deltas)."""
    return 4 * layers


def stream_layout(geo: ChunkGeometry, level: int, tables: TableLayout | None) -> StreamLayout:
    """Substream offsets and the table of every (substream, channel): per channel from a
    profile's ``tables``, else (``None``) one inline table per (kind, layer, anchors|deltas)."""
    offsets = np.concatenate([[0], np.cumsum(geo.stream_sizes())]).astype(np.int64)
    nb = len(geo.anchors_per_block)
    kinds, layers, _, parts = np.meshgrid(np.arange(2), np.arange(geo.layers), np.arange(nb), np.arange(2), indexing="ij")
    kinds, layers, parts = kinds.ravel(), layers.ravel(), parts.ravel()
    if tables is None:
        ids = (kinds * geo.layers + layers) * 2 + parts
        return StreamLayout(offsets, np.repeat(ids[:, None], geo.channels, axis=1).astype(np.int32))
    base = np.where(parts == 0, tables.anchor_base(kinds, layers), tables.delta_base(level, kinds, layers))
    return StreamLayout(offsets, (base[:, None] + np.arange(geo.channels)[None, :]).astype(np.int32))


def flatten_symbols(qs: list[Quantized], geo: ChunkGeometry) -> np.ndarray:
    """Symbols of both kinds in substream order (kind, layer, block, anchors|deltas), token-major."""
    anchors = torch.stack([q.anchors for q in qs])  # (2, L, nA, C)
    deltas = torch.stack([q.deltas for q in qs])  # (2, L, nD, C)
    parts = []
    a0 = d0 = 0
    for na, nd in zip(geo.anchors_per_block, geo.deltas_per_block):
        parts.append(anchors[:, :, a0 : a0 + na].reshape(2, geo.layers, -1))
        parts.append(deltas[:, :, d0 : d0 + nd].reshape(2, geo.layers, -1))
        a0, d0 = a0 + na, d0 + nd
    return torch.cat(parts, dim=2).reshape(-1).numpy()


def unflatten_symbols(symbols: torch.Tensor, geo: ChunkGeometry) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of ``flatten_symbols`` (on the symbols' device): per kind, anchors ``(L, nA, C)`` and deltas ``(L, nD, C)``."""
    per_kl = symbols.reshape(2, geo.layers, -1)
    sizes = [n * geo.channels for pair in zip(geo.anchors_per_block, geo.deltas_per_block) for n in pair]
    pieces = torch.split(per_kl, sizes, dim=2)
    anchors = torch.cat([p.reshape(2, geo.layers, -1, geo.channels) for p in pieces[0::2]], dim=2)
    deltas = torch.cat([p.reshape(2, geo.layers, -1, geo.channels) for p in pieces[1::2]], dim=2)
    return [(anchors[k], deltas[k]) for k in range(2)]


def inline_tables(symbols: np.ndarray, layout: StreamLayout, geo: ChunkGeometry) -> np.ndarray:
    """The inline tables of a chunk (see ``stream_layout``), measured on its own symbols."""
    n = n_inline_tables(geo.layers)
    table_of_symbol = np.repeat(layout.table_ids[:, 0].astype(np.int64), layout.counts())
    counts = np.bincount(table_of_symbol * ALPHABET + symbols, minlength=n * ALPHABET)
    return counts_to_freqs(counts.reshape(n, ALPHABET), alpha=0.0)
