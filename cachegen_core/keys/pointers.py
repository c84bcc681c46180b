"""Pointers: a stored partial chunk found by a prompt that agrees with it only up to an earlier step.

A partial chunk's key hashes every token up to its end (``chunks.py``), and a partial chunk's KV holds the KV
of each of its prefixes. So a prompt that agrees with a stored partial chunk ending at ``e`` only up to
``s < e`` (a second question after the same plain-text context, whose first question started inside the
last ``step`` tokens stored) cannot find it by its own keys, though its first ``s - start`` tokens are
exactly what it needs. When a partial chunk is stored, the writer also stores, under the partial key of each
of its shorter prefixes from the same start (ending at ``e - step``, ``e - 2 step``, ...: the
:data:`MAX_POINTERS` nearest, at most :data:`MAX_SUFFIX_TOKENS` back), after the chunk's manifest, a
*pointer* ``<prefix's key>-P``, strict JSON:

    {"format": "cachegen-pointer-v1", "chunk": "<the partial chunk's key>", "tokens": s - start,
     "suffix": "<base64 of the token ids [s, e), little-endian uint32>"}

A reader finding one under its own prefix's key takes it only when hashing its own tokens followed by
``suffix`` gives ``chunk`` (:func:`follow`): the pointed chunk's key then says it holds the KV of the
reader's own tokens followed by those, so the first ``tokens`` of its tokens are the reader's prefix. A
pointer that is malformed, moved to another key, forged or about other tokens names nothing else: it is
refused (``CacheGenFormatError``), and a pointed chunk no longer stored is a plain miss. The pointed
chunk's blobs are checked as any chunk's (binding, checksums, the tokens they decode to).

Store cost: a pointer is ``4 * 4/3`` bytes per suffix token plus about 150; the pointers of a partial chunk of
``n`` steps hold ``step * n (n - 1) / 2`` suffix tokens in all (at the defaults, a 1472-token partial chunk's
22 pointers about 90 KB). They are overwritten, not added, when a later prompt's partial chunk shares
the prefix: one pointer per stored prefix, pointing at the newest chunk that extends it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass

import numpy as np

from ..errors import CacheGenFormatError
from .chunks import Chunk, PartialChunk

FORMAT = "cachegen-pointer-v1"
#: Pointers stored per partial chunk, to its nearest shorter prefixes (at the defaults, 1536-token chunks in steps
#: of 64, every prefix of the chunk).
MAX_POINTERS = 24
#: How far back (tokens) from the partial chunk's end a pointer may be: bounds a pointer's size.
MAX_SUFFIX_TOKENS = 4096
MAX_POINTER_BYTES = 256 + (4 * MAX_SUFFIX_TOKENS * 4 + 2) // 3
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def pointer_key(chunk_key: str) -> str:
    """Store key (before the store's namespace) of the pointer under the partial key ``chunk_key``."""
    return f"{chunk_key}-P"


@dataclass(frozen=True)
class Pointer:
    """A pointer's content: the stored partial chunk ``chunk`` holds the prefix's ``tokens`` tokens, then ``suffix``."""

    chunk: str
    tokens: int
    suffix: np.ndarray

    def to_bytes(self) -> bytes:
        suffix = base64.b64encode(np.ascontiguousarray(self.suffix, dtype="<u4").tobytes()).decode()
        body = {"format": FORMAT, "chunk": self.chunk, "tokens": self.tokens, "suffix": suffix}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Pointer:
        """Parse a stored pointer; ``CacheGenFormatError`` on anything but a well-formed one."""
        if len(data) > MAX_POINTER_BYTES:
            raise CacheGenFormatError(f"pointer of {len(data)} bytes exceeds {MAX_POINTER_BYTES}")
        try:
            body = json.loads(bytes(data).decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise CacheGenFormatError(f"pointer is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(body, dict) or set(body) != {"format", "chunk", "tokens", "suffix"} or body["format"] != FORMAT:
            raise CacheGenFormatError(f"not a {FORMAT} record")
        chunk, tokens, suffix = body["chunk"], body["tokens"], body["suffix"]
        if not isinstance(chunk, str) or not _HEX64.match(chunk):
            raise CacheGenFormatError("pointer names no chunk key")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 < tokens < 2**31:
            raise CacheGenFormatError(f"pointer holds a bad token count {str(tokens)[:20]!r}")
        try:
            raw = base64.b64decode(suffix, validate=True) if isinstance(suffix, str) else b"?"
        except (binascii.Error, ValueError):
            raw = b"?"
        if not raw or len(raw) % 4 or len(raw) // 4 > MAX_SUFFIX_TOKENS:
            raise CacheGenFormatError("pointer holds a bad suffix")
        return cls(chunk, tokens, np.frombuffer(raw, dtype="<u4"))


def pointers(chunk: Chunk) -> list[tuple[str, bytes]]:
    """The store entries (key, value) pointing at the partial chunk ``chunk`` from its shorter prefixes, nearest
    first (none for any other chunk)."""
    if not isinstance(chunk, PartialChunk) or chunk.tokens is None:
        return []
    out = []
    for end, key in reversed(chunk.shorter[-MAX_POINTERS:]):
        if chunk.end - end > MAX_SUFFIX_TOKENS:
            break
        out.append((pointer_key(key), Pointer(chunk.key, end - chunk.start, chunk.tokens[end - chunk.start :]).to_bytes()))
    return out


@dataclass(frozen=True)
class Borrowed(Chunk):
    """A prompt's partial chunk ``[start, end)`` (``key``: its own partial key) whose KV is the first tokens of a
    longer stored one, ``source`` (its key), ending at ``source_end``: found through a pointer."""

    source: str = ""
    source_end: int = 0

    @property
    def stored(self) -> Chunk:
        return Chunk(index=self.index, start=self.start, end=self.source_end, key=self.source, offset=self.offset)


def follow(candidate: Chunk, data: bytes) -> Borrowed:
    """The chunk the pointer ``data``, stored under ``candidate``'s key, gives ``candidate``; ``CacheGenFormatError``
    when it is malformed or its chunk is not ``candidate``'s tokens followed by its suffix."""
    p = Pointer.from_bytes(data)
    if not isinstance(candidate, PartialChunk) or candidate.state is None:
        raise ValueError("a pointer is followed from a partial chunk of the prompt (chunks.partial_chunks)")
    if p.tokens != candidate.num_tokens:
        raise CacheGenFormatError(f"pointer of {p.tokens} tokens under the key of a prefix of {candidate.num_tokens}")
    if candidate.extended(p.suffix) != p.chunk:
        raise CacheGenFormatError("pointer names a chunk of other tokens")
    return Borrowed(index=candidate.index, start=candidate.start, end=candidate.end, key=candidate.key,
                    offset=candidate.offset, source=p.chunk, source_end=candidate.end + len(p.suffix))  # fmt: skip
