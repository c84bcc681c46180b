"""The per-chunk manifest: which options of a chunk are in the store, and how many bytes each is.

A chunk is stored as one blob per option (``<chunk key>-L<level>``) and one manifest
(``<chunk key>-M``), written *after* every blob it names (:class:`~.engine.ChunkWriter`).
Readers look the manifest up first (one ``get_many`` for a whole prompt) and fetch only
what it names, so a reader never sees a partially written chunk: until the manifest is
there the chunk is a miss, and once it is, every level the controller may fall back to
is there too (unless the store evicted it since: a miss, recomputed). The sizes give
the streaming controller the exact bytes of every option before any fetch.

Format: UTF-8 JSON ``{"format": "cachegen-manifest-v1", "options": {"<level>": bytes, ...}}``,
parsed strictly (size, types, ranges); anything else is a ``CacheGenFormatError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .errors import CacheGenFormatError

FORMAT = "cachegen-manifest-v1"
MAX_MANIFEST_BYTES = 4096
MAX_LEVEL = 63
MAX_BLOB_BYTES = 1 << 40


def manifest_key(chunk_key: str) -> str:
    """Store key (before the store's namespace) of a chunk's manifest."""
    return f"{chunk_key}-M"


@dataclass(frozen=True)
class Manifest:
    """The stored options of one chunk: ``sizes[level]`` = bytes of that level's blob."""

    sizes: Mapping[int, int]

    def __post_init__(self) -> None:
        for level, size in self.sizes.items():
            if not _is_int(level) or not 0 <= level <= MAX_LEVEL:
                raise ValueError(f"bad level {level!r} in a manifest")
            if not _is_int(size) or not 0 < size <= MAX_BLOB_BYTES:
                raise ValueError(f"bad size {size!r} for level {level} in a manifest")
        object.__setattr__(self, "sizes", MappingProxyType(dict(sorted(self.sizes.items()))))

    @property
    def levels(self) -> list[int]:
        return list(self.sizes)

    def __contains__(self, level: object) -> bool:
        return level in self.sizes

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT, "options": {str(lv): n for lv, n in self.sizes.items()}}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse a stored manifest; ``CacheGenFormatError`` on anything but a well-formed one."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise CacheGenFormatError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            body = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise CacheGenFormatError(f"manifest is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("options"), dict):
            raise CacheGenFormatError(f"not a {FORMAT} record")
        sizes = {}
        for key, size in body["options"].items():
            if not (key.isascii() and key.isdigit() and len(key) <= 2):
                raise CacheGenFormatError(f"manifest names an unknown option {key[:20]!r}")
            sizes[int(key)] = size
        try:
            return cls(sizes)
        except ValueError as e:
            raise CacheGenFormatError(str(e)) from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
