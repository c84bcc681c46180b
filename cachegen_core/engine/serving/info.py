"""GenerationInfo: what one request did, reported by the engine and in LangChain's generation info."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ...streaming import Option


@dataclass
class GenerationInfo:
    """Counters and timings of one request.

    ``levels``: the option each reused chunk was streamed as, in prompt order: a
    compression level (int) or ``"text"`` (prefilled on the controller's word).
    ``stream``: the streaming controller's record of every chunk (see ``ChunkRecord``).
    ``partial_tokens``: tokens reused from a partial chunk (the stored tail of an earlier prompt);
    ``documents``: marked documents after the reused prefix, ``documents_reused`` of them found in the
    store; ``blend_recomputed``: tokens the selective recompute computed (``blend_s`` seconds).
    ``finish_reason``: ``"stop"`` (end of sequence, or the stop string ``stop_sequence``),
    ``"length"`` (the token limit) or ``"cancelled"``. ``tokens_queued``: prompt tokens whose KV this
    request queued for storing (complete chunks, partial chunks, documents), each counted once and
    none that it read from the store (LangChain's ``cache_creation``). ``decode_device``: where the
    compressed chunks streamed were decoded (``"cpu"``, ``"cuda:0"``...: the model's device when the
    coder has a decoder there that runs, else the CPU, the reason logged once); None when none was.
    ``shared_tokens``: leading tokens read in place from the KV another running request holds (counted in
    ``cached_tokens``; none of them streamed).
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    levels: list[Option] = field(default_factory=list)
    bytes_fetched: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0
    chunks_queued: int = 0
    tokens_queued: int = 0
    errors: list[str] = field(default_factory=list)
    stream: list[dict[str, Any]] = field(default_factory=list)
    text_chunks: int = 0
    partial_tokens: int = 0
    documents: int = 0
    documents_reused: int = 0
    blend_recomputed: int = 0
    blend_s: float = 0.0
    finish_reason: str | None = None
    stop_sequence: str | None = None
    decode_device: str | None = None
    shared_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def covered_tokens(spans: Sequence[tuple[int, int]]) -> int:
    """How many positions the ``(start, end)`` spans cover together (overlaps counted once)."""
    n, last = 0, 0
    for s, e in sorted(spans):
        n += max(0, e - max(s, last))
        last = max(last, e)
    return n
