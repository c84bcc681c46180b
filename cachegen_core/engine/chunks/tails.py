"""A prompt's partial chunk: found by its own key or through a pointer, and a borrowed one decoded.

The reader's side of ``keys/pointers.py``. :func:`find_tail` looks up, in one store request, the manifest and
the pointer under each of the prompt's candidate partial keys; the longest candidate stored itself wins over
shorter ones, a longer one reached through a pointer over it (the pointed chunk's manifest: one more request,
only when there is a pointer to follow; another per other chunk named when the first is gone). A pointer is followed only when it proves, with the prompt's own
tokens, that the chunk it names extends them (``pointers.follow``); a bad one is reported and skipped, one
whose chunk is gone (or holds no option fine enough) is a plain miss. :func:`decode_borrowed` decodes the
longer chunk whole and keeps its first tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from ...errors import CacheGenFormatError, StoreError
from ...keys.chunks import Chunk
from ...keys.manifest import Manifest, Option, manifest_key
from ...keys.pointers import Borrowed, follow, pointer_key
from ...kv import KVCache
from ..serving.info import GenerationInfo
from .runs import copy_chunk

log = logging.getLogger("cachegen_core.engine")


class TailReader(Protocol):
    """What these functions need of a ``ChunkReader``."""

    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def trouble(self, info: GenerationInfo, msg: str) -> None: ...

    def usable_manifest(self, data: bytes | None, floor: Option, options: Sequence[Option] | None, info: GenerationInfo,
                        what: str) -> Manifest | None: ...  # fmt: skip

    def decode(self, blob: bytes, key: str, option: Option, out: KVCache | None = None, observe: bool = True) -> KVCache: ...


def find_tail(reader: TailReader, candidates: Sequence[Chunk], floor: Option, info: GenerationInfo,
              options: Sequence[Option] | None = None) -> tuple[Chunk, Manifest] | None:  # fmt: skip
    """The longest of ``candidates`` (partial chunks, shortest first) stored in some option at least as fine as
    ``floor`` (and among ``options``), itself or as the first tokens of a longer one (a :class:`Borrowed`
    chunk), and the stored chunk's manifest; None when none is."""
    if not candidates:
        return None
    n = len(candidates)
    try:
        raw = reader.get_many([manifest_key(c.key) for c in candidates] + [pointer_key(c.key) for c in candidates])
    except StoreError as e:
        reader.trouble(info, f"store failure looking up a partial chunk: {e}")
        return None
    own, hit = -1, None  # the longest candidate stored itself
    for i in reversed(range(n)):
        what = f"the partial chunk of {candidates[i].num_tokens} tokens, ignored"
        if (manifest := reader.usable_manifest(raw[i], floor, options, info, what)) is not None:
            own, hit = i, (candidates[i], manifest)
            break
    gone: set[str] = set()  # chunks pointers named that are not stored (in a usable option)
    # longer ones reached through a pointer, longest first, each parsed only when reached (the first usually holds)
    for c, data in zip(reversed(candidates[own + 1 :]), reversed(raw[n + own + 1 :])):
        if not data:
            continue
        try:
            b = follow(c, data)
        except CacheGenFormatError as e:
            info.errors.append(msg := f"bad pointer for the partial chunk of {c.num_tokens} tokens, ignored: {e}")
            log.warning(msg)
            continue
        if b.source in gone:
            continue
        try:
            (data,) = reader.get_many([manifest_key(b.source)])
        except StoreError as e:
            reader.trouble(info, f"store failure following a pointer to a partial chunk: {e}")
            break
        what = f"the partial chunk of {b.source_end - b.start} tokens a pointer names, ignored"
        if (manifest := reader.usable_manifest(data, floor, options, info, what)) is not None:
            return b, manifest
        gone.add(b.source)
    return hit


def decode_borrowed(reader: TailReader, blob: bytes, chunk: Borrowed, option: Option, buffer: KVCache) -> KVCache:
    """The KV of the borrowed ``chunk`` in its place in ``buffer``: the stored chunk decoded whole, into ``buffer``
    where it has room (past the chunk's end: tokens the prompt's own overwrite later), else into a temporary, its first
    tokens kept. ``CacheGenFormatError`` when the blob does not hold the stored chunk's tokens."""
    src = chunk.stored
    if buffer.num_tokens >= src.end:
        reader.decode(blob, src.key, option, out=buffer.slice(src.start, src.end))
    else:
        kv = reader.decode(blob, src.key, option)
        if kv.num_tokens != src.num_tokens:
            raise CacheGenFormatError(f"chunk {src.key[:12]} decoded to {kv.num_tokens} tokens, expected {src.num_tokens}")
        copy_chunk(kv.slice(0, chunk.num_tokens), chunk, buffer)
    return buffer.slice(chunk.start, chunk.end)
