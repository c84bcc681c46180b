"""What a stored thing is called and what the store says it holds.

``chunks``: token chunks and their prefix-chained keys, partial chunks (a prompt's tail, every
``partial_step`` tokens) and blob keys; ``pointers``: the entries by which a prompt finds a stored partial
chunk it agrees with only up to an earlier step; ``segments``: prompts that know their document spans and
document piece keys (by content, never position); ``manifest``: the per-chunk manifest naming each
stored form and its size; ``fingerprint``: the model fingerprint every key and blob binds.

May import: ``errors`` only (and numpy, hashlib, json).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Chunk": "chunks",
    "PartialChunk": "chunks",
    "blob_key": "chunks",
    "chunk_keys": "chunks",
    "partial_chunks": "chunks",
    "Pointer": "pointers",
    "pointer_key": "pointers",
    "model_fingerprint": "fingerprint",
    "Manifest": "manifest",
    "manifest_key": "manifest",
    "SegmentedPrompt": "segments",
    "document_pieces": "segments",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .chunks import Chunk, PartialChunk, blob_key, chunk_keys, partial_chunks
    from .fingerprint import model_fingerprint
    from .manifest import Manifest, manifest_key
    from .pointers import Pointer, pointer_key
    from .segments import SegmentedPrompt, document_pieces


def __getattr__(name: str) -> Any:  # loaded on first use: the fingerprint needs torch, a manifest does not
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
