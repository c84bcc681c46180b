"""Blob surgery for forging: take a valid blob apart, change it, put it back with valid CRC-32s."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachegen_core.codec.format import _PREAMBLE, Limits, pack, unpack


@dataclass
class Parts:
    """A blob taken apart without any check (for forging): preamble, header, sections, streams."""

    version: int
    reserved: int
    header: dict[str, Any]
    sections: dict[str, np.ndarray]
    streams: list[bytes]


def split(blob: bytes) -> Parts:
    """Take a *valid* blob apart (``unpack`` it; the parts can then be re-packed after changes)."""
    c = unpack(blob, Limits())
    _, version, reserved, _, _ = _PREAMBLE.unpack_from(blob, 0)
    return Parts(version, reserved, dict(c.header), dict(c.sections), list(c.streams))


def with_header(blob: bytes, header_bytes: bytes, *, fix_crc: bool = True) -> bytes:
    """``blob`` with its header JSON replaced by ``header_bytes`` and the preamble's length and CRC fixed."""
    magic, version, reserved, hlen, hcrc = _PREAMBLE.unpack_from(blob, 0)
    crc = zlib.crc32(header_bytes) & 0xFFFFFFFF if fix_crc else hcrc
    return _PREAMBLE.pack(magic, version, reserved, len(header_bytes), crc) + header_bytes + blob[_PREAMBLE.size + hlen :]


def header_of(blob: bytes) -> dict[str, Any]:
    hlen = _PREAMBLE.unpack_from(blob, 0)[3]
    return json.loads(blob[_PREAMBLE.size : _PREAMBLE.size + hlen])


def dump_header(h: Any) -> bytes:
    return json.dumps(h, sort_keys=True, separators=(",", ":")).encode()


def repack_header(blob: bytes, mutate: Callable[[dict[str, Any]], None]) -> bytes:
    """``blob`` with its header dict changed in place by ``mutate``, header length and CRC fixed."""
    h = header_of(blob)
    mutate(h)
    return with_header(blob, dump_header(h))


def repack(p: Parts, *, keep_header_fields: bool = False) -> bytes:
    """Re-pack parts with every checksum recomputed (``format.pack``); extra header fields kept."""
    header = {k: v for k, v in p.header.items() if k not in ("sections", "n_streams", "streams_crc32")}
    blob = pack(header, p.sections, p.streams)
    if keep_header_fields:  # a forged sections/n_streams/streams_crc32 entry: keep it, fix only the header CRC
        h = header_of(blob)
        for k in ("sections", "n_streams", "streams_crc32"):
            if k in p.header:
                h[k] = p.header[k]
        blob = with_header(blob, dump_header(h))
    return blob
