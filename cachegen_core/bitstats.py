"""Where an encoded chunk's bits went: per kind, anchors/deltas and layer group, coded and ideal."""

from __future__ import annotations

from typing import Any

import numpy as np

from .coders import StreamLayout, ideal_bits_per_stream
from .quantize import layer_groups
from .substreams import ChunkGeometry


def encode_stats(
    blob_bytes: int, payloads: list[bytes], symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray, geo: ChunkGeometry
) -> dict[str, Any]:
    """Bits per KV element of a blob of ``blob_bytes`` whose substreams are ``payloads``.

    ``payload`` and ``ideal`` bits (the coded substreams, and their cross-entropy under the
    same tables), ``side_info`` (header, sections, stream table), and the coded bits split
    by kind, anchors/deltas and layer third (early, middle, late).
    """
    elements = geo.elements
    coded = np.array([8 * len(p) for p in payloads], dtype=np.float64)
    n = layout.n_streams
    spk = geo.streams_per_kl
    kind = np.arange(n) // (geo.layers * spk)
    layer = (np.arange(n) // spk) % geo.layers
    part = np.arange(n) % 2
    group = layer_groups(geo.layers).numpy()[layer]
    ideal = ideal_bits_per_stream(symbols, layout, freqs)
    out: dict[str, Any] = {
        "elements": elements,
        "blob_bytes": blob_bytes,
        "bits_per_element": 8 * blob_bytes / elements,
        "payload_bits_per_element": coded.sum() / elements,
        "ideal_bits_per_element": ideal.sum() / elements,
        "side_info_bits_per_element": (8 * blob_bytes - coded.sum()) / elements,
    }
    for name, mask in {
        "keys": kind == 0,
        "values": kind == 1,
        "anchors": part == 0,
        "deltas": part == 1,
        "layers_early": group == 0,
        "layers_middle": group == 1,
        "layers_late": group == 2,
    }.items():
        out[f"{name}_bits_per_element"] = coded[mask].sum() / elements
    return out
