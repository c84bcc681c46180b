"""GenerationInfo: what one request did, reported by the engine and in LangChain's generation info."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..streaming import Option


@dataclass
class GenerationInfo:
    """Counters and timings of one request.

    ``levels``: the option each reused chunk was streamed as, in prompt order: a
    compression level (int) or ``"text"`` (prefilled on the controller's word).
    ``stream``: the streaming controller's record of every chunk (see ``ChunkRecord``).
    ``finish_reason``: ``"stop"`` (end of sequence, or the stop string ``stop_sequence``) or
    ``"length"`` (the token limit).
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
    errors: list[str] = field(default_factory=list)
    stream: list[dict[str, Any]] = field(default_factory=list)
    text_chunks: int = 0
    finish_reason: str | None = None
    stop_sequence: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
