"""Prompts with documents, and the store keys of a document's KV, which do not depend on its position.

A :class:`SegmentedPrompt` is a prompt's token ids (it is a ``Sequence[int]``, usable wherever
ids are) that also knows which spans are documents (retrieved passages, tool outputs...): the
engine may take their KV from document caches computed on their own, wherever they land; and
where prefixes that later prompts share end (``prefix_ends``: a chat's messages before its new
turn), at which the engine keeps a partial chunk so that the next question reuses all of them.

Document keys. A document is computed once after a fixed ``preamble`` (a few tokens, such as
the tokenizer's BOS, standing in for whatever precedes it in a prompt) and stored in pieces of
``piece_tokens``. Piece *i* covers the document's tokens ``[i * piece_tokens, end_i)`` and its key is

    blake2b-256(person="cachegen-docv1";
                fingerprint, codec_id, profile_id, piece_tokens, preamble ids,   # length-prefixed header
                the document's token ids [0, end_i) as little-endian uint32)

so a piece is found for the same tokens at the start of a document, for the same model, codec,
profile and preamble, and never for a chunk of a prompt (another ``person``). The last piece may
be shorter. Blobs and manifests are stored under ``<key>-L<option>`` and ``<key>-M`` as chunks are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from .chunks import Chunk, token_array, _field

_PERSON = b"cachegen-docv1"


@dataclass(frozen=True)
class SegmentedPrompt(Sequence[int]):
    """Token ``ids``, the ``documents`` among them (sorted, disjoint ``(start, end)`` spans) and ``prefix_ends``:
    sorted positions in ``(0, len(ids)]`` where a prefix that later prompts share ends."""

    ids: tuple[int, ...]
    documents: tuple[tuple[int, int], ...] = ()
    prefix_ends: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(int(t) for t in self.ids))
        object.__setattr__(self, "documents", tuple((int(s), int(e)) for s, e in self.documents))
        object.__setattr__(self, "prefix_ends", tuple(int(e) for e in self.prefix_ends))
        if list(self.prefix_ends) != sorted(set(self.prefix_ends)) or any(not 0 < e <= len(self.ids) for e in self.prefix_ends):
            raise ValueError(f"prefix ends {self.prefix_ends} are not sorted positions in (0, {len(self.ids)}]")
        last = 0
        for s, e in self.documents:
            if not last <= s < e <= len(self.ids):
                raise ValueError(f"document span {(s, e)} is empty, overlaps another or lies outside {len(self.ids)} tokens")
            last = e

    @classmethod
    def from_parts(cls, parts: Iterable[tuple[Sequence[int], bool]]) -> SegmentedPrompt:
        """Join ``(ids, is_document)`` parts in order (empty parts are dropped)."""
        ids: list[int] = []
        spans = []
        for part, document in parts:
            if document and len(part):
                spans.append((len(ids), len(ids) + len(part)))
            ids.extend(int(t) for t in part)
        return cls(tuple(ids), tuple(spans))

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...
    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        return self.ids[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)


def document_spans(prompt: object) -> tuple[tuple[int, int], ...]:
    """The document spans of a prompt (none for text or plain ids)."""
    return prompt.documents if isinstance(prompt, SegmentedPrompt) else ()


def prefix_ends(prompt: object) -> tuple[int, ...]:
    """The ends of a prompt's shared prefixes (none for text or plain ids)."""
    return prompt.prefix_ends if isinstance(prompt, SegmentedPrompt) else ()


def tokenize_parts(tokenizer: Any, parts: Iterable[tuple[str, bool]], *, add_special_tokens: bool = True) -> SegmentedPrompt:
    """A prompt from ``(text, is_document)`` parts, each tokenised on its own (without special tokens), after
    the special tokens the tokenizer puts before a text (its BOS) when ``add_special_tokens``."""
    parts = list(parts)
    lead: list[int] = []
    if add_special_tokens:
        probe = next((t for t, _ in parts if t), "a")
        plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        lead = full[:at]
    tokenized = [(list(tokenizer(t, add_special_tokens=False)["input_ids"]) if t else [], d) for t, d in parts]
    return SegmentedPrompt.from_parts([(lead, False), *tokenized])


def document_pieces(
    doc_ids: Sequence[int] | np.ndarray,
    *,
    piece_tokens: int,
    fingerprint: str,
    codec_id: str,
    profile_id: str,
    preamble: Sequence[int] = (),
) -> list[Chunk]:
    """The pieces of a document with their keys (see module doc); spans are relative to the document."""
    tokens = token_array(doc_ids)
    if piece_tokens < 1:
        raise ValueError(f"piece_tokens must be >= 1, got {piece_tokens}")
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    for part in (fingerprint, codec_id, profile_id, str(piece_tokens)):
        _field(h, part.encode())
    _field(h, token_array(list(preamble)).tobytes())
    pieces = []
    for i, start in enumerate(range(0, len(tokens), piece_tokens)):
        end = min(start + piece_tokens, len(tokens))
        h.update(tokens[start:end].tobytes())
        pieces.append(Chunk(index=i, start=start, end=end, key=h.copy().hexdigest(), offset=len(preamble)))
    return pieces


__all__ = ["SegmentedPrompt", "document_pieces", "document_spans", "prefix_ends", "tokenize_parts"]
