"""The per-chunk manifest: which options of a chunk are in the store, and how many bytes each is.

A chunk is stored as one blob per option (``<chunk key>-L<option>``) and one manifest
(``<chunk key>-M``), written *after* every blob it names (:class:`~.engine.ChunkWriter`).
Readers look the manifest up first (one ``get_many`` for a whole prompt) and fetch only
what it names, so a reader never sees a partially written chunk: until the manifest is
there the chunk is a miss, and once it is, every level the controller may fall back to
is there too (unless the store evicted it since: a miss, recomputed). The sizes give
the streaming controller the exact bytes of every option before any fetch.

Format: UTF-8 JSON ``{"format": "cachegen-manifest-v1", "options": {"<option>": bytes, ...}}``
where an option is a level (``"0"``, ``"1"``, ...) or a raw form (``"raw"``, ``"lossless"``),
parsed strictly (size, types, ranges); anything else is a ``CacheGenFormatError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import CacheGenFormatError

FORMAT = "cachegen-manifest-v1"
MAX_MANIFEST_BYTES = 4096
MAX_LEVEL = 63
#: The stored forms that are not levels (``raw.py``).
RAW_OPTIONS = ("raw", "lossless")
Option = int | str
MAX_BLOB_BYTES = 1 << 40


def manifest_key(chunk_key: str) -> str:
    """Store key (before the store's namespace) of a chunk's manifest."""
    return f"{chunk_key}-M"


@dataclass(frozen=True)
class Manifest:
    """The stored options of one chunk: ``sizes[option]`` = bytes of that option's blob."""

    sizes: Mapping[Option, int]

    def __post_init__(self) -> None:
        for option, size in self.sizes.items():
            if option not in RAW_OPTIONS and (not _is_int(option) or not 0 <= option <= MAX_LEVEL):
                raise ValueError(f"bad option {option!r} in a manifest")
            if not _is_int(size) or not 0 < size <= MAX_BLOB_BYTES:
                raise ValueError(f"bad size {size!r} for option {option} in a manifest")
        ordered = sorted(self.sizes.items(), key=lambda kv: (isinstance(kv[0], int), kv[0] if isinstance(kv[0], int) else -RAW_OPTIONS.index(kv[0])))
        object.__setattr__(self, "sizes", MappingProxyType(dict(ordered)))

    @property
    def options(self) -> list[Option]:
        """The stored options, finest first (lossless, raw, then levels)."""
        return list(self.sizes)

    def __contains__(self, option: object) -> bool:
        return option in self.sizes

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT, "options": {str(o): n for o, n in self.sizes.items()}}
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
            if key in RAW_OPTIONS:
                sizes[key] = size
            elif key.isascii() and key.isdigit() and len(key) <= 2:
                sizes[int(key)] = size
            else:
                raise CacheGenFormatError(f"manifest names an unknown option {key[:20]!r}")
        try:
            return cls(sizes)
        except ValueError as e:
            raise CacheGenFormatError(str(e)) from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
