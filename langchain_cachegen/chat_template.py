"""Chat messages to token ids, rendered so that each turn's prompt extends the previous one's.

The tokenizer's chat template is used when it has one, else a plain ``role: text``
template. Rendering is deterministic and append-only for a growing history, which
is what lets every complete chunk of that history be found in the store next turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage

from cachegen_core.segments import SegmentedPrompt

from .documents import tokenize_marked

_ROLES = {HumanMessage: "user", AIMessage: "assistant", SystemMessage: "system", ToolMessage: "tool"}


def message_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as ``{"role", "content"}`` dicts for a chat template."""
    out = []
    for m in messages:
        role = m.role if isinstance(m, ChatMessage) else next((r for t, r in _ROLES.items() if isinstance(m, t)), "user")
        out.append({"role": role, "content": m.text if hasattr(m, "text") and isinstance(m.text, str) else str(m.content)})
    return out


def render_prompt(tokenizer: Any, messages: Sequence[BaseMessage]) -> list[int] | SegmentedPrompt:
    """Token ids of the conversation, ending with the assistant's turn, stable across turns (a
    ``SegmentedPrompt`` when messages hold documents marked by ``format_documents``)."""
    dicts = message_dicts(messages)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False)
        return tokenize_marked(tokenizer, text, add_special_tokens=False)
    text = "".join(f"{d['role']}: {d['content']}\n" for d in dicts) + "assistant:"
    return tokenize_marked(tokenizer, text, add_special_tokens=True)


__all__ = ["message_dicts", "render_prompt"]
