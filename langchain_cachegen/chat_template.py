"""Chat messages to token ids, rendered so that each turn's prompt extends the previous one's.

The tokenizer's chat template is used when it has one, else a plain ``role: text``
template. Tools go to the template when it renders them (``apply_chat_template(...,
tools=...)``), else they are described at the end of the first system message; other
instructions for the system message (a JSON schema to answer in) go there too. A
``prefill`` starts the assistant's answer (to force a tool call or a JSON object).

Rendering is deterministic and append-only for a growing history, which is what lets
every complete chunk of that history be found in the store next turn. The prompt also says where
the messages before its new turn end (``SegmentedPrompt.prefix_ends``): the engine keeps a partial
chunk there, so that another question after the same messages reuses all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from cachegen_core.keys.segments import SegmentedPrompt, document_spans

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


def _dicts(tokenizer: Any, messages: Sequence[BaseMessage], tools: Sequence[Mapping[str, Any]] | None,
           system_text: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """The messages as template dicts (tools and ``system_text`` in the system message unless the template renders
    tools) and the template's keyword arguments."""
    native = bool(tools) and renders_tools(tokenizer)
    extra = [system_text] if system_text else []
    if tools and not native:
        extra.insert(0, tools_prompt(tools))
    dicts = _with_system_text(message_dicts(messages, native_tools=native), "\n\n".join(extra))
    return dicts, ({"tools": list(tools)} if native and tools else {})


def _render(tokenizer: Any, dicts: list[dict[str, Any]], kwargs: dict[str, Any], *, generation: bool) -> str:
    """``dicts`` through the tokenizer's chat template (else ``role: text`` lines), the assistant's turn opened
    when ``generation``."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(dicts, add_generation_prompt=generation, tokenize=False, **kwargs)
    return "".join(f"{d['role']}: {d['content']}\n" for d in dicts) + ("assistant:" if generation else "")


def render_text(
    tokenizer: Any,
    messages: Sequence[BaseMessage],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    system_text: str = "",
    prefill: str = "",
) -> str:
    """The conversation as text, ending with the assistant's turn opened (and ``prefill``)."""
    dicts, kwargs = _dicts(tokenizer, messages, tools, system_text)
    return _render(tokenizer, dicts, kwargs, generation=True) + prefill


def new_turn(dicts: Sequence[Mapping[str, Any]]) -> int:
    """Where the conversation's new turn, its trailing user and tool messages, starts (0: nothing precedes it, or the
    conversation ends with another role's message)."""
    k = len(dicts)
    while k > 0 and dicts[k - 1]["role"] in ("user", "tool"):
        k -= 1
    return k if k < len(dicts) else 0


def render_prompt(
    tokenizer: Any,
    messages: Sequence[BaseMessage],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    system_text: str = "",
    prefill: str = "",
    mark_prefix: bool = True,
) -> list[int] | SegmentedPrompt:
    """Token ids of :func:`render_text`, stable across turns: a ``SegmentedPrompt`` when messages hold documents
    marked by ``format_documents`` or when messages precede the new turn (the trailing user and tool messages):
    ``prefix_ends`` says where those end, so that the engine keeps a partial chunk there and another question after
    the same messages (a RAG chain's next question after its system message) reuses every token of them
    (``mark_prefix=False``: not looked for, as counting tokens needs only the ids)."""
    dicts, kwargs = _dicts(tokenizer, messages, tools, system_text)
    templated = bool(getattr(tokenizer, "chat_template", None))  # the template writes its own BOS, if any
    ids = tokenize_marked(tokenizer, _render(tokenizer, dicts, kwargs, generation=True) + prefill, add_special_tokens=not templated)
    if not mark_prefix or not (k := new_turn(dicts)):
        return ids
    try:  # a template may insist on a conversation ending with a user's turn
        before = tokenize_marked(tokenizer, _render(tokenizer, dicts[:k], kwargs, generation=False), add_special_tokens=not templated)
    except Exception:  # noqa: BLE001  (jinja's errors, raised by the template itself): no prefix to mark
        return ids
    end = next((i for i, (a, b) in enumerate(zip(before, ids)) if a != b), min(len(before), len(ids)))
    if not end:
        return ids
    return SegmentedPrompt(tuple(ids), document_spans(ids), prefix_ends=(end,))


__all__ = ["new_turn", "render_prompt", "render_text", "renders_tools"]
