"""Tool calls as text, in the Hermes format that Qwen2.5, Hermes and many other chat templates use.

Tools are described in the system message between ``<tools></tools>``, each call is a
JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call></tool_call>``,
and tool results go back between ``<tool_response></tool_response>``. This module
renders all three, parses a model's answer back into LangChain tool calls, and filters
a stream so that tool-call markup never reaches the streamed text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall
from langchain_core.messages.tool import invalid_tool_call, tool_call
from langchain_core.utils.json import parse_partial_json

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """System-message text describing ``tools`` (OpenAI tool dicts), one JSON line each."""
    return _TOOLS_PROMPT.format(tools="\n".join(_dumps(t) for t in tools))


def format_tool_call(name: str, arguments: Any) -> str:
    """One call as the model is asked to write it (``arguments``: a dict, or raw text if invalid)."""
    args = arguments if isinstance(arguments, str) else _dumps(arguments)
    return f'{CALL_OPEN}\n{{"name": {_dumps(name)}, "arguments": {args}}}\n{CALL_CLOSE}'


def format_tool_response(content: str) -> str:
    """A tool's result as the model is shown it."""
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def forced_call_prefill(tools: Sequence[Mapping[str, Any]], name: str | None) -> str:
    """Start of the answer that forces a call: of tool ``name``, or of any tool if ``None``.

    With a single tool, "any tool" is that tool. The model writes the rest (the arguments).
    """
    if name is None and len(tools) == 1:
        name = tools[0]["function"]["name"]
    if name is None:
        return f'{CALL_OPEN}\n{{"name": "'
    return f'{CALL_OPEN}\n{{"name": {_dumps(name)}, "arguments": {{'


def new_call_id() -> str:
    """A fresh tool-call id (the model does not write one)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedAnswer:
    """A model's answer split into its text and its tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


def _decode_call(obj: Any, raw: str) -> ToolCall | InvalidToolCall:
    """A parsed ``{"name", "arguments"}`` object as a tool call, or as an invalid one saying why."""
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not name:
        return invalid_tool_call(name=None, args=raw, id=new_call_id(), error="a tool call needs a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments given as a JSON string, as in OpenAI's wire format
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return invalid_tool_call(name=name, args=args, id=new_call_id(), error=f"arguments are not JSON: {e}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return invalid_tool_call(name=name, args=_dumps(args), id=new_call_id(), error="arguments must be a JSON object")
    return tool_call(name=name, args=args, id=new_call_id())


def _decode_block(body: str) -> list[ToolCall | InvalidToolCall]:
    """The calls in one ``<tool_call>`` block: a JSON object or a list of them; text after it is ignored."""
    raw = body.strip()
    try:
        obj, _ = json.JSONDecoder().raw_decode(raw)
    except json.JSONDecodeError as e:
        partial = _partial_object(raw)  # cut short, most likely: name the tool it was calling
        name = partial.get("name") if isinstance(partial.get("name"), str) else None
        return [invalid_tool_call(name=name, args=raw, id=new_call_id(), error=f"not JSON: {e}")]
    if isinstance(obj, list):
        return [_decode_call(o, _dumps(o)) for o in obj]
    return [_decode_call(obj, raw)]


def _partial_object(raw: str) -> dict[str, Any]:
    """What an unfinished JSON object already says, ``{}`` if it is not one."""
    try:
        obj = parse_partial_json(raw)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _bare_call(text: str, tool_names: Collection[str]) -> dict[str, Any] | None:
    """``text`` if it is nothing but one JSON call of a bound tool (Llama 3.1 style, no tags)."""
    raw = text.strip()
    if raw.startswith("```"):
        raw = raw.strip("`").removeprefix("json").strip()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if isinstance(obj, dict) and obj.get("name") in tool_names and ("arguments" in obj or "parameters" in obj):
        return obj
    return None


def parse_tool_calls(text: str, tool_names: Collection[str] = ()) -> ParsedAnswer:
    """Split ``text`` into content and tool calls.

    Every ``<tool_call>`` block is parsed (an unclosed last block runs to the end); a
    block that is not a valid call becomes an invalid tool call. Without any block, a
    text that is only a JSON call of one of ``tool_names`` is taken as that call.
    Content is the text outside the blocks, right-stripped when there were blocks.
    """
    if CALL_OPEN not in text:
        bare = _bare_call(text, tool_names) if tool_names else None
        if bare is None:
            return ParsedAnswer(text)
        calls = [_decode_call(bare, text.strip())]
        content = ""
    else:
        parts: list[str] = []
        calls = []
        pos = 0
        while (start := text.find(CALL_OPEN, pos)) >= 0:
            parts.append(text[pos:start])
            body_start = start + len(CALL_OPEN)
            end = text.find(CALL_CLOSE, body_start)
            calls += _decode_block(text[body_start : end if end >= 0 else len(text)])
            pos = end + len(CALL_CLOSE) if end >= 0 else len(text)
        parts.append(text[pos:])
        content = "".join(parts).rstrip()
    valid = [c for c in calls if c.get("type") == "tool_call"]
    invalid = [c for c in calls if c.get("type") == "invalid_tool_call"]
    return ParsedAnswer(content, valid, invalid)  # type: ignore[arg-type]


class ToolCallStreamer:
    """Streams an answer's text while holding back what may be tool-call markup.

    Text before the first ``<tool_call>`` is emitted as it arrives, except a tail that
    could still start the tag and trailing whitespace (which the parsed content may
    drop); everything from the tag on is held. :meth:`finish` parses the whole answer,
    so streamed text plus its remainder equals ``parse_tool_calls(answer).content``.
    """

    def __init__(self, tool_names: Collection[str] = ()) -> None:
        self.tool_names = tool_names
        self.text = ""
        self.emitted = 0

    def feed(self, piece: str) -> str:
        """Text that is safe to stream after ``piece`` arrived."""
        self.text += piece
        if self.tool_names and not self.emitted and self.text.lstrip()[:1] in ("{", "`"):
            return ""  # may be a bare JSON call: hold until the end
        safe = self.text.find(CALL_OPEN)
        if safe < 0:
            safe = len(self.text)
            for k in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1):
                if CALL_OPEN.startswith(self.text[-k:]):
                    safe -= k
                    break
        safe = len(self.text[:safe].rstrip())
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out

    def finish(self) -> tuple[str, ParsedAnswer]:
        """The content not streamed yet, and the parsed answer."""
        parsed = parse_tool_calls(self.text, self.tool_names)
        done = self.text[: self.emitted]
        rest = parsed.content[len(done) :] if parsed.content.startswith(done) else ""
        return rest, parsed


__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "ParsedAnswer",
    "ToolCallStreamer",
    "forced_call_prefill",
    "format_tool_call",
    "format_tool_response",
    "new_call_id",
    "parse_tool_calls",
    "tools_prompt",
]
