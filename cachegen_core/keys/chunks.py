"""Token chunking and prefix-chained chunk keys.

A context's token ids are cut into chunks of ``chunk_tokens``. Chunk *i* covers
``[i * chunk_tokens, (i + 1) * chunk_tokens)`` and its key is

    blake2b-256(person="cachegen-chunkv1";
                fingerprint, codec_id, profile_id, chunk_tokens,   # length-prefixed header
                token ids [0, end of chunk i] as little-endian uint32)

so a chunk is reused only behind exactly the same prefix, model, codec and profile.
Keys are computed in one pass: a single running hash state is fed chunk by chunk and
read out after each one (O(n) in the number of tokens).

Partial chunks. A prompt's incomplete last chunk is stored too, rounded down to a multiple of
``step`` tokens (64), so that the next prompt extending it (a chat's next turn) reuses every
token but the last few. A partial chunk covering ``[start, end)`` (``start`` a chunk boundary,
``end - start`` a multiple of ``step`` below ``chunk_tokens``) has its own key family:

    blake2b-256(person="cachegen-tailv1"; fingerprint, codec_id, profile_id, chunk_tokens, step,
                token ids [0, end) as little-endian uint32)

(:func:`partial_chunks`), so it never collides with a complete chunk's key and, like one, is
reused only behind exactly the same tokens. Each comes as a :class:`PartialChunk`, which also carries what the
pointers to it from its shorter prefixes are made and checked with (``pointers.py``).

Store keys. A chunk is stored once per option under ``blob_key(chunk.key, option)`` =
``"<64 hex chars>-L<level>"`` (or ``-Lraw``, ``-Llossless`` for the raw forms), with its
manifest under ``"<64 hex chars>-M"`` (``manifest.py``). Stores prepend their own ``namespace`` (e.g.
``"cachegen:"``), so the full key in a backend is ``namespace + key + "-L" + level``.
The characters used (hex, ``-``, ``L``, digits) are valid in every LangChain
``ByteStore``, ``LocalFileStore`` included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Default tokens per chunk (the paper's 1.5K).
DEFAULT_CHUNK_TOKENS = 1536

_PERSON = b"cachegen-chunkv1"
_TAIL_PERSON = b"cachegen-tailv1"
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True)
class Chunk:
    """One complete chunk: token span ``[start, end)`` of the context and its store key. ``offset``: its KV was
    computed at context positions ``start + offset`` on (a document's piece: after the preamble), which the
    codec needs to code its keys before the rotary embedding."""

    index: int
    start: int
    end: int
    key: str
    offset: int = 0

    @property
    def position(self) -> int:
        """The context position its KV's first token was computed at."""
        return self.start + self.offset

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def stored(self) -> Chunk:
        """The chunk whose blobs hold this one's KV: itself (but for ``pointers.Borrowed``)."""
        return self


@dataclass(frozen=True)
class PartialChunk(Chunk):
    """A partial chunk (:func:`partial_chunks`) with what is none of its identity: ``tokens``, its token ids
    ``[start, end)`` (little-endian uint32); ``shorter``, the (end, key) of each partial chunk from the same start
    that it extends, shortest first; ``state``, the running hash after its last token (``extended``)."""

    tokens: Any = field(default=None, compare=False, repr=False)
    shorter: tuple[tuple[int, str], ...] = field(default=(), compare=False, repr=False)
    state: Any = field(default=None, compare=False, repr=False)

    def extended(self, suffix: np.ndarray) -> str:
        """The key of the partial chunk of this one's tokens followed by ``suffix`` (token ids, little-endian uint32)."""
        if self.state is None:
            raise ValueError("a partial chunk without its hash state")
        h = self.state.copy()
        h.update(np.ascontiguousarray(suffix, dtype="<u4").tobytes())
        return h.hexdigest()


def num_complete_chunks(n_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """How many complete chunks ``n_tokens`` tokens hold."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return max(0, n_tokens) // chunk_tokens


def token_array(token_ids: Any) -> np.ndarray:
    """Token ids (list, tuple, numpy or torch, 1-D) as a little-endian uint32 array."""
    if hasattr(token_ids, "detach"):  # torch.Tensor, without importing torch here
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype("<u4")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID:
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def _field(h: Any, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def chunk_keys(
    token_ids: Sequence[int] | Any,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    fingerprint: str,
    codec_id: str,
    profile_id: str,
) -> list[Chunk]:
    """The complete chunks of ``token_ids`` with their prefix-chained keys (see module doc).

    ``profile_id`` is ``""`` when the codec runs without a shared profile.
    """
    tokens = token_array(token_ids)
    n_chunks = num_complete_chunks(len(tokens), chunk_tokens)
    if n_chunks == 0:
        return []
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    for part in (fingerprint, codec_id, profile_id, str(chunk_tokens)):
        _field(h, part.encode())
    chunks: list[Chunk] = []
    for i in range(n_chunks):
        start, end = i * chunk_tokens, (i + 1) * chunk_tokens
        h.update(tokens[start:end].tobytes())
        # Read out a copy of the running state; the state itself goes on to the next chunk.
        chunks.append(Chunk(index=i, start=start, end=end, key=h.copy().hexdigest()))
    return chunks


def partial_chunks(
    token_ids: Sequence[int] | Any,
    start: int,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    step: int,
    fingerprint: str,
    codec_id: str,
    profile_id: str,
) -> list[Chunk]:
    """The partial chunks starting at chunk boundary ``start``: one ending at each multiple of ``step``
    below ``chunk_tokens`` that ``token_ids`` reach, shortest first, with their keys (see module doc)."""
    tokens = token_array(token_ids)
    if step < 1 or start % chunk_tokens:
        raise ValueError(f"step must be >= 1 and start a multiple of chunk_tokens, got step={step}, start={start}")
    ends = range(start + step, min(start + chunk_tokens, len(tokens) + 1), step)
    if not ends:
        return []
    h = hashlib.blake2b(digest_size=32, person=_TAIL_PERSON)
    for part in (fingerprint, codec_id, profile_id, str(chunk_tokens), str(step)):
        _field(h, part.encode())
    h.update(tokens[:start].tobytes())
    span = tokens[start : ends[-1]].copy()  # (the caller's array may change: this one is the chunks')
    out: list[Chunk] = []
    shorter: list[tuple[int, str]] = []
    for end in ends:
        h.update(span[end - step - start : end - start].tobytes())
        state = h.copy()
        key = state.hexdigest()
        out.append(PartialChunk(index=start // chunk_tokens, start=start, end=end, key=key, tokens=span[: end - start],
                                shorter=tuple(shorter), state=state))  # fmt: skip
        shorter.append((end, key))
    return out


def partial_ends(
    limit: int, done: int, chunk_tokens: int, step: int, spans: Sequence[tuple[int, int]] = (), prefixes: Sequence[int] = ()
) -> tuple[list[int], bool]:
    """Where a request stores partial chunks (none unless ``0 < step < chunk_tokens``): at ``limit`` (the prompt's end,
    or where its KV stops being exact), at the first document's start (``spans``) and, unless the request continues a
    reused partial chunk (ending at ``done``) that is at none of these marks, at the last document's end and the
    ``prefixes``, so another question after them reuses them whole. Also whether the reused partial chunk ends at a
    shared mark (other questions start from it: it is not superseded)."""
    if not 0 < step < chunk_tokens:
        return [], False
    first, shared = [s for s, _ in spans[:1]], [*(e for _, e in spans[-1:]), *prefixes]
    shared_tail = done in {m - m % chunk_tokens % step for m in first + shared}
    marks = first + (shared if shared_tail or not done % chunk_tokens else [])
    return sorted({limit, *(m for m in marks if m < limit)}), shared_tail


def blob_key(chunk_key: str, option: int | str) -> str:
    """Store key (before the store's namespace) of one chunk stored as one option: a level or a raw form."""
    if isinstance(option, str):
        if option not in ("raw", "lossless"):
            raise ValueError(f"not a stored option: {option!r}")
    elif isinstance(option, bool) or option < 0:
        raise ValueError(f"level must be >= 0, got {option}")
    return f"{chunk_key}-L{option}"
