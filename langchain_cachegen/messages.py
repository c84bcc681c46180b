"""LangChain messages as the ``{"role", "content", ...}`` dicts a chat template renders.

Two shapes, by what the tokenizer's template can do:

* ``native_tools=True`` (the template renders tools itself): AI messages keep their
  calls in ``tool_calls`` (OpenAI shape, arguments as a dict) and tool results are
  ``role: tool`` messages with their ``tool_call_id`` and ``name``;
* ``native_tools=False``: calls are written into the AI message's text and tool results
  become user turns, both in the Hermes format of :mod:`.tool_calls` (consecutive
  results share one turn, so templates that insist on alternating roles still render).

Either way the rendering of a message depends on that message alone, so a growing
conversation renders to a growing prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from .tool_calls import format_tool_call, format_tool_response

_ROLES = {HumanMessage: "user", AIMessage: "assistant", SystemMessage: "system"}


def message_text(message: BaseMessage) -> str:
    """The text of a message: string content, or its text blocks (others, such as images, are left out)."""
    return message.content if isinstance(message.content, str) else str(message.text)


def _calls(message: AIMessage) -> list[tuple[str, Any, str | None]]:
    """(name, arguments, id) of an AI message's valid and invalid tool calls, in order."""
    out: list[tuple[str, Any, str | None]] = [(c["name"], c["args"], c.get("id")) for c in message.tool_calls]
    out += [(c.get("name") or "", c.get("args") or "{}", c.get("id")) for c in message.invalid_tool_calls]
    return out


def _assistant(message: AIMessage, native_tools: bool) -> dict[str, Any]:
    text, calls = message_text(message), _calls(message)
    if not calls:
        return {"role": "assistant", "content": text}
    if native_tools:
        tool_calls = [{"type": "function", "id": i, "function": {"name": n, "arguments": a}} for n, a, i in calls]
        return {"role": "assistant", "content": text, "tool_calls": tool_calls}
    rendered = "\n".join(format_tool_call(n, a) for n, a, _ in calls)
    return {"role": "assistant", "content": f"{text}\n{rendered}" if text else rendered}


def message_dicts(messages: Sequence[BaseMessage], *, native_tools: bool = False) -> list[dict[str, Any]]:
    """``messages`` as chat-template dicts (see the module docstring for the two shapes)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m, (ToolMessage, FunctionMessage)):
            if native_tools:
                d: dict[str, Any] = {"role": "tool", "content": message_text(m), "name": m.name}
                if isinstance(m, ToolMessage):
                    d["tool_call_id"] = m.tool_call_id
                out.append(d)
                continue
            response = format_tool_response(message_text(m))
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_turn": True})
        elif isinstance(m, AIMessage):
            out.append(_assistant(m, native_tools))
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": message_text(m)})
        else:
            role = next((r for t, r in _ROLES.items() if isinstance(m, t)), "user")
            out.append({"role": role, "content": message_text(m)})
    for d in out:
        d.pop("_tool_turn", None)
    return out


__all__ = ["message_dicts", "message_text"]
