"""Chat messages to token ids, rendered so that each turn's prompt extends the previous one's.

The tokenizer's chat template is used when it has one, else a plain ``role: text``
template. Tools go to the template when it renders them (``apply_chat_template(...,
tools=...)``), else they are described at the end of the first system message; other
instructions for the system message (a JSON schema to answer in) go there too. A
``prefill`` starts the assistant's answer (to force a tool call or a JSON object).

Rendering is deterministic and append-only for a growing history, which is what lets
every complete chunk of that history be found in the store next turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from cachegen_core.keys.segments import SegmentedPrompt

from .documents import tokenize_marked
from .messages import message_dicts
from .tool_calls import tools_prompt


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` list itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, or a "tool_use" one
        return "tool_use" in template or "tools" in str(template.get("default", ""))
    return isinstance(template, str) and "tools" in template


def _with_system_text(dicts: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` appended to the first system message, or a system message of its own placed first."""
    if not text:
        return dicts
    if dicts and dicts[0]["role"] == "system":
        first = dict(dicts[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *dicts[1:]]
    return [{"role": "system", "content": text}, *dicts]


def render_text(
    tokenizer: Any,
    messages: Sequence[BaseMessage],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    system_text: str = "",
    prefill: str = "",
) -> str:
    """The conversation as text, ending with the assistant's turn opened (and ``prefill``)."""
    native = bool(tools) and renders_tools(tokenizer)
    extra = [system_text] if system_text else []
    if tools and not native:
        extra.insert(0, tools_prompt(tools))
    dicts = _with_system_text(message_dicts(messages, native_tools=native), "\n\n".join(extra))
    if getattr(tokenizer, "chat_template", None):
        kwargs = {"tools": list(tools)} if native else {}
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False, **kwargs)
    else:
        text = "".join(f"{d['role']}: {d['content']}\n" for d in dicts) + "assistant:"
    return text + prefill


def render_prompt(
    tokenizer: Any,
    messages: Sequence[BaseMessage],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    system_text: str = "",
    prefill: str = "",
) -> list[int] | SegmentedPrompt:
    """Token ids of :func:`render_text`, stable across turns (a ``SegmentedPrompt`` when messages hold
    documents marked by ``format_documents``)."""
    text = render_text(tokenizer, messages, tools=tools, system_text=system_text, prefill=prefill)
    templated = bool(getattr(tokenizer, "chat_template", None))  # the template writes its own BOS, if any
    return tokenize_marked(tokenizer, text, add_special_tokens=not templated)


__all__ = ["render_prompt", "render_text", "renders_tools"]
