"""What a store holds, entry by entry: the work behind ``cachegen ls`` and ``cachegen inspect STORE KEY``.

:func:`chunk_rows` lists a store's chunks (``admin.scan``: options stored, bytes, age, and with
``headers`` the model fingerprint in a blob's header), its pointers (``keys/pointers.py``) and the keys of no
chunk. :func:`describe` says what one entry is: a blob (its header, read as ``cachegen inspect FILE`` reads a
file), a manifest (the options it names), a pointer (the chunk it names, its tokens), anything else (its
size); given a chunk id (or at least :data:`MIN_PREFIX` of its first characters) in place of a key, the
chunk's manifest, the header of each of its blobs and the pointer under that id, if any. Values of a
``SignedStore`` are read without its key: a blob's header comes first, a signature last. Nothing here
needs torch (a pointer's suffix is read with numpy).
"""

from __future__ import annotations

from typing import Any

from ..codec.format import MAGIC, read_header
from ..errors import CacheGenFormatError
from ..keys.manifest import Manifest
from ..keys.pointers import Pointer
from .admin import KEY_RE, POINTER_RE, ChunkEntries, chunk_model, option_order, scan
from .base import KVStore
from .signed import OVERHEAD, TRAILER, unwrap

#: Fewest leading characters of a chunk id that name it in ``describe``.
MIN_PREFIX = 8


def chunk_rows(store: KVStore, *, headers: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The store's chunks (by id), its pointers (by the id of the prefix they are under) and its keys of no chunk
    (by key), each as a JSON-ready dict."""
    s = scan(store)
    rows = []
    for c in sorted(s.chunks.values(), key=lambda c: c.chunk):
        row: dict[str, Any] = {"chunk": c.chunk, "manifest": c.manifest, "options": _options(c), "bytes": c.bytes, "age_s": c.age_s}
        if headers:
            row["model"] = chunk_model(store, c)
        rows.append(row)
    pointers = [{"pointer": k[:-2], "bytes": n, "age_s": age} for k, (n, age) in sorted(s.pointers.items())]
    others = [{"key": k, "bytes": n, "age_s": age} for k, n, age in sorted(s.others)]
    return rows, pointers, others


def _options(c: ChunkEntries) -> dict[str, int]:
    return {str(lv): c.levels[lv] for lv in sorted(c.levels, key=option_order)}


def entry(key: str, value: bytes) -> dict[str, Any]:
    """What the stored ``value`` under ``key`` is (see the module doc); ``CacheGenFormatError`` for a blob or a
    manifest that cannot be read."""
    signed = len(value) >= OVERHEAD and value.endswith(TRAILER)
    body = value[:-OVERHEAD] if signed else value
    out: dict[str, Any] = {"key": key}
    if body[: len(MAGIC)] == MAGIC:
        out.update(read_header(body))
        out["blob_bytes"] = len(value)
    elif KEY_RE.match(key) and key.endswith("-M"):
        out["manifest"] = {str(o): n for o, n in Manifest.from_bytes(body).sizes.items()}
        out["bytes"] = len(value)
    elif POINTER_RE.match(key):
        p = Pointer.from_bytes(body)
        out["pointer"] = {"chunk": p.chunk, "tokens": p.tokens, "suffix_tokens": len(p.suffix)}
        out["bytes"] = len(value)
    else:
        out["bytes"] = len(value)
    if signed:
        out["signed"] = True
    return out


def describe(store: KVStore, key: str) -> dict[str, Any]:
    """The entry under ``key`` (:func:`entry`), else the one chunk whose id starts with ``key``: its manifest and
    each blob's entry (an unreadable one with its ``error``); ``LookupError`` when neither is there."""
    backend = unwrap(store)
    value = backend.get(key)
    if value is not None:
        return entry(key, value)
    if len(key) < MIN_PREFIX or not all(ch in "0123456789abcdef" for ch in key):
        raise LookupError(f"no entry {key!r} in {backend!r} (a chunk is named by at least {MIN_PREFIX} hex digits of its id)")
    chunks = sorted({m[1] for k in backend.keys(key) if (m := KEY_RE.match(k) or POINTER_RE.match(k))})
    if not chunks:
        raise LookupError(f"no entry or chunk {key!r} in {backend!r}")
    if len(chunks) > 1:
        some = ", ".join(c[:16] for c in chunks[:5]) + (", ..." if len(chunks) > 5 else "")
        raise LookupError(f"{len(chunks)} chunks start with {key!r}: give more of the id ({some})")
    chunk = chunks[0]
    out: dict[str, Any] = {"chunk": chunk, "manifest": None, "blobs": {}}
    for k in sorted(backend.keys(chunk)):
        m = KEY_RE.match(k)
        value = backend.get(k)
        if (m is None and not POINTER_RE.match(k)) or value is None:
            continue
        try:
            e = entry(k, value)
        except CacheGenFormatError as exc:
            e = {"key": k, "bytes": len(value), "error": str(exc)}
        if m is None:
            out["pointer"] = e.get("pointer", e)
        elif m["manifest"]:
            out["manifest"] = e.get("manifest", e)
        else:
            out["blobs"][m["level"]] = e
    out["blobs"] = {lv: out["blobs"][lv] for lv in sorted(out["blobs"], key=lambda lv: option_order(int(lv) if lv.isdigit() else lv))}
    return out
