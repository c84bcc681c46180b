"""Where an encoded chunk's bits went: payload against its cross-entropy, side information, and by kind and layer third."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..coders import StreamLayout, ideal_bits_per_stream
from ..coders.base import PRECISION
from .substreams import ChunkGeometry


def layer_thirds(layers: int) -> np.ndarray:
    """Third of each layer: first third 0, middle 1, last 2."""
    return (np.arange(layers) * 3) // max(layers, 1)


def encode_stats(
    blob_bytes: int,
    payloads: list[bytes],
    symbols: np.ndarray,
    layout: StreamLayout,
    freqs: np.ndarray,
    geo: ChunkGeometry,
    sections: Mapping[str, np.ndarray],
) -> dict[str, Any]:
    """Bits per KV element of a blob of ``blob_bytes`` whose substreams are ``payloads``.

    ``payload`` and ``ideal`` bits (the coded substreams, and their cross-entropy under the
    same tables), ``side_info`` (header, sections, stream table) and within it ``exact``
    (the sink tokens); ``keys`` / ``values`` and ``layers_early`` / ``_middle`` / ``_late``
    split the payload in proportion to each part's cross-entropy (substreams hold every
    kind and layer of their tokens, so coded bytes cannot be attributed more finely).
    """
    elements = 2 * geo.layers * (geo.coded_tokens + _exact_tokens(sections)) * geo.channels
    coded = 8.0 * sum(len(p) for p in payloads)
    ideal_streams = ideal_bits_per_stream(symbols, layout, freqs)
    ideal = float(ideal_streams.sum())
    out: dict[str, Any] = {
        "elements": elements,
        "blob_bytes": blob_bytes,
        "streams": layout.n_streams,
        "bits_per_element": 8 * blob_bytes / elements,
        "payload_bits_per_element": coded / elements,
        "ideal_bits_per_element": ideal / elements,
        "payload_excess": coded / ideal - 1 if ideal else 0.0,
        "side_info_bits_per_element": (8 * blob_bytes - coded) / elements,
        "exact_bits_per_element": 8 * sections["exact"].nbytes / elements if "exact" in sections else 0.0,
    }
    if geo.coded_tokens == 0 or ideal == 0:
        return out
    # Cross-entropy of each (kind, layer, component) position of the period, summed over tokens.
    per_symbol = PRECISION - np.log2(freqs[layout.table_ids[0], symbols.reshape(geo.coded_tokens, geo.period)], dtype=np.float64)
    by_kl = per_symbol.sum(axis=0).reshape(2, geo.layers, geo.channels).sum(axis=2) * (coded / ideal)
    third = layer_thirds(geo.layers)
    for name, part in {
        "keys": by_kl[0].sum(),
        "values": by_kl[1].sum(),
        "layers_early": by_kl[:, third == 0].sum(),
        "layers_middle": by_kl[:, third == 1].sum(),
        "layers_late": by_kl[:, third == 2].sum(),
    }.items():
        out[f"{name}_bits_per_element"] = float(part) / elements
    return out


def _exact_tokens(sections: Mapping[str, np.ndarray]) -> int:
    return int(sections["exact"].shape[3]) if "exact" in sections else 0
