"""What a blob from a store may make the decoder allocate: one place to configure it.

The codec already bounds every blob (``format.Limits``, ``KVCodec.max_tokens``, and at
most ``codec.MAX_ELEMENTS_PER_BYTE`` KV elements per blob byte, since a range coder can
spend almost no bits on a near-certain symbol). :class:`DecodeLimits` gathers these
bounds so that a deployment can *tighten* them (``CACHEGEN_MAX_ELEMENTS_PER_BYTE`` etc.,
see ``docs/security.md``); :meth:`DecodeLimits.codec` builds the engine's codec with
them. A bound above the codec's own is refused: the codec's limits are hard caps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .kvcodec import MAX_ELEMENTS_PER_BYTE, BlobHeader, KVCodec
from ..errors import CacheGenFormatError
from .format import Limits

_DEFAULT_LIMITS = Limits()
_DEFAULT_MAX_TOKENS = 1 << 17


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds on a blob read back (``None``: the codec's default).

    ``max_elements_per_byte``: decoded KV elements (keys and values) per byte of blob,
    at most ``codec.MAX_ELEMENTS_PER_BYTE``; ``max_blob_bytes``: size of one blob;
    ``max_elements``: KV elements of one blob, whatever its size; ``max_tokens``:
    tokens of one chunk.
    """

    max_elements_per_byte: int | None = None
    max_blob_bytes: int | None = None
    max_elements: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_elements_per_byte", "max_blob_bytes", "max_elements", "max_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        caps = {"max_elements_per_byte": MAX_ELEMENTS_PER_BYTE, "max_blob_bytes": _DEFAULT_LIMITS.max_blob_bytes,
                "max_elements": _DEFAULT_LIMITS.max_section_elements}  # fmt: skip
        for name, cap in caps.items():
            v = getattr(self, name)
            if v is not None and v > cap:
                raise ValueError(f"{name}={v} is above the codec's hard limit {cap}: limits can only be tightened")

    @property
    def format_limits(self) -> Limits:
        """The container limits (``format.Limits``) these bounds imply."""
        return Limits(
            max_blob_bytes=self.max_blob_bytes or _DEFAULT_LIMITS.max_blob_bytes,
            max_header_bytes=_DEFAULT_LIMITS.max_header_bytes,
            max_streams=_DEFAULT_LIMITS.max_streams,
            max_section_elements=self.max_elements or _DEFAULT_LIMITS.max_section_elements,
        )

    def codec(self, *args: Any, **kwargs: Any) -> KVCodec:
        """A ``KVCodec(*args, **kwargs)`` enforcing these limits (a plain one when they are the defaults)."""
        kwargs.setdefault("limits", self.format_limits)
        if self.max_tokens is not None:
            kwargs.setdefault("max_tokens", self.max_tokens)
        if self.max_elements_per_byte is None or self.max_elements_per_byte == MAX_ELEMENTS_PER_BYTE:
            return KVCodec(*args, **kwargs)
        return BoundedKVCodec(*args, max_elements_per_byte=self.max_elements_per_byte, **kwargs)


class BoundedKVCodec(KVCodec):
    """A ``KVCodec`` whose blobs may expand to at most ``max_elements_per_byte`` KV elements per byte.

    The check runs on the header, before any section or substream is read.
    """

    def __init__(self, *args: Any, max_elements_per_byte: int = MAX_ELEMENTS_PER_BYTE, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not 1 <= max_elements_per_byte <= MAX_ELEMENTS_PER_BYTE:
            raise ValueError(f"max_elements_per_byte must be in [1, {MAX_ELEMENTS_PER_BYTE}]")
        self.max_elements_per_byte = max_elements_per_byte

    def check_header(self, header: Mapping[str, Any], blob_bytes: int, level: int | None = None) -> BlobHeader:
        h = super().check_header(header, blob_bytes, level)
        elements = 2 * math.prod(h.shape)
        if elements > self.max_elements_per_byte * blob_bytes:
            raise CacheGenFormatError(f"shape {list(h.shape)} claims {elements} elements, more than "
                                      f"max_elements_per_byte={self.max_elements_per_byte} x {blob_bytes} bytes")  # fmt: skip
        return h
