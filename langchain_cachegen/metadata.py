"""What the LangChain classes report about an answer: the model's name, why it ended, and its token usage.

The engine's ``GenerationInfo`` counts tokens but does not say why generation stopped,
so :func:`finish_reason` derives it from what the LangChain layer knows: the new tokens
against the token limit, and whether a stop sequence was found.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from langchain_core.messages.ai import UsageMetadata

FinishReason = Literal["stop", "length"]


def model_name(engine: Any) -> str:
    """The name an engine's model is reported under: the name or path it was loaded by (``KVEngine.from_pretrained``),
    else the model's own ``name_or_path`` (where transformers loaded it from), else its class's name."""
    model = getattr(engine, "model", None)
    return str(getattr(engine, "model_name", None) or getattr(model, "name_or_path", None) or type(model).__name__)


def finish_reason(new_tokens: int, max_new_tokens: int | None, stopped: bool) -> FinishReason:
    """``"stop"``: ended on EOS or a stop sequence; ``"length"``: ran into ``max_new_tokens``.

    An answer whose EOS is exactly its ``max_new_tokens``-th token reads as ``"length"``:
    the token count alone cannot tell them apart.
    """
    if stopped or max_new_tokens is None or new_tokens < max_new_tokens:
        return "stop"
    return "length"


def usage_metadata(info: Mapping[str, Any]) -> UsageMetadata:
    """Usage of one answer from its generation info: tokens reused from the store are ``cache_read``, tokens the
    request queued for storing (chunks, partial chunks, documents; none of them read) ``cache_creation``."""
    prompt, new = int(info.get("prompt_tokens", 0)), int(info.get("new_tokens", 0))
    return {
        "input_tokens": prompt,
        "output_tokens": new,
        "total_tokens": prompt + new,
        "input_token_details": {"cache_read": int(info.get("cached_tokens", 0)), "cache_creation": int(info.get("tokens_queued", 0))},
    }


__all__ = ["FinishReason", "finish_reason", "model_name", "usage_metadata"]
