"""Marking retrieved documents in a prompt, so that each one's KV is reused wherever it lands.

:func:`format_documents` joins documents as a RAG chain's ``format_docs`` step does, with each
one between two marker characters (:data:`DOC_START`, :data:`DOC_END`: private-use code points,
which no text contains). ``CacheGenLLM`` and ``ChatCacheGen`` split the rendered prompt at the
markers, tokenise the pieces, drop the markers and hand the engine a
:class:`~cachegen_core.keys.segments.SegmentedPrompt`: each marked piece's KV comes from its document
cache (computed once on its own, then reused in any position, order or combination), blended
with its neighbours (CacheBlend). Nothing else in the chain changes::

    chain = {"context": retriever | format_documents, "question": RunnablePassthrough()} | prompt | llm

A prompt without markers is passed on unchanged. :func:`strip_markers` removes them for a model
that is not CacheGen's. :func:`cache_documents` (``llm.cache_documents(docs)``) computes the document
caches when the documents are indexed, so that no question pays a document's prefill.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.documents import Document

from cachegen_core.keys.segments import SegmentedPrompt, tokenize_parts

#: Opens a document (U+E000, private use).
DOC_START = "\ue000"
#: Closes a document (U+E001, private use).
DOC_END = "\ue001"


def format_documents(docs: Iterable[Document | str], separator: str = "\n\n") -> str:
    """Documents' texts joined by ``separator``, each between :data:`DOC_START` and :data:`DOC_END`."""
    texts = (d.page_content if isinstance(d, Document) else str(d) for d in docs)
    return separator.join(f"{DOC_START}{strip_markers(t)}{DOC_END}" for t in texts)


def strip_markers(text: str) -> str:
    """``text`` without document markers."""
    return text.replace(DOC_START, "").replace(DOC_END, "")


def has_markers(text: str) -> bool:
    return DOC_START in text or DOC_END in text


def split_marked(text: str) -> list[tuple[str, bool]]:
    """``(piece, is_document)`` in order, markers dropped; an unclosed document is plain text, stray
    markers are dropped."""
    parts: list[tuple[str, bool]] = []
    rest = text
    while rest:
        start = rest.find(DOC_START)
        end = rest.find(DOC_END, start + 1) if start >= 0 else -1
        if start < 0 or end < 0:
            parts.append((strip_markers(rest), False))
            break
        parts.append((strip_markers(rest[:start]), False))
        parts.append((strip_markers(rest[start + 1 : end]), True))
        rest = rest[end + 1 :]
    return [(t, d) for t, d in parts if t]


def tokenize_marked(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int] | SegmentedPrompt:
    """Token ids of ``text``: plain ids without markers, else a ``SegmentedPrompt`` of its marked documents."""
    if not has_markers(text):
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    return tokenize_parts(tokenizer, split_marked(text), add_special_tokens=add_special_tokens)


@dataclass(frozen=True)
class CachedDocuments:
    """What ``cache_documents`` did with the documents it was given (each listed as given): ``stored`` (computed
    and stored now, ``tokens`` in all), ``already_cached`` (found in the store: nothing computed) and ``skipped``
    (too short to be reused, ``BlendConfig.min_document_tokens``: prompts hold them as plain text; every one
    when the engine blends nothing, ``blend="exact"``)."""

    stored: list[Document | str] = field(default_factory=list)
    already_cached: list[Document | str] = field(default_factory=list)
    skipped: list[Document | str] = field(default_factory=list)
    tokens: int = 0


def cache_documents(engine: Any, documents: Iterable[Document | str], progress: bool | None = None) -> CachedDocuments:
    """Compute and store the document cache of each document a later :func:`format_documents` prompt will hold,
    exactly as that prompt looks it up (the same text, tokenised on its own); documents already stored are not
    computed again. ``progress``: a bar on stderr (None: on a terminal, unless ``CACHEGEN_PROGRESS=0``)."""
    docs = list(documents)
    texts = [strip_markers(d.page_content if isinstance(d, Document) else str(d)) for d in docs]
    done = engine.store_documents(texts, progress=progress)
    pick = lambda at: [docs[i] for i in at]  # noqa: E731
    return CachedDocuments(pick(done.stored), pick(done.present), pick(done.skipped), done.tokens)


def engine_prompt(engine: Any, prompt: str | Sequence[int]) -> str | Sequence[int]:
    """What the engine is given for a prompt: a marked text as a ``SegmentedPrompt``, anything else unchanged."""
    if isinstance(prompt, str) and has_markers(prompt):
        return engine.segment(split_marked(prompt))
    return prompt


__all__ = [
    "DOC_END",
    "DOC_START",
    "CachedDocuments",
    "cache_documents",
    "engine_prompt",
    "format_documents",
    "split_marked",
    "strip_markers",
    "tokenize_marked",
]
