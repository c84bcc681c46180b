"""``with_structured_output`` for a local chat model: a JSON answer steered by prompt and prefill.

Three methods, as in LangChain's other chat models:

* ``"json_schema"`` (the default): the schema is given in the system message and the
  answer is started with ``{``;
* ``"json_mode"``: the answer is started with ``{`` (the prompt says what to put in it);
* ``"function_calling"``: the schema is bound as the one tool, whose call is forced.

Nothing constrains the tokens a model samples: a small model may still answer with JSON
that does not match the schema, which the parser then reports.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

Method = Literal["function_calling", "json_mode", "json_schema"]

#: The start of a JSON-object answer.
JSON_PREFILL = "{"


def response_format_prompt(response_format: Mapping[str, Any] | None) -> tuple[str, str]:
    """(system-message text, answer prefill) for an OpenAI-style ``response_format``.

    ``{"type": "json_schema", "json_schema": {"schema": ...}}`` asks for an object of that
    schema; ``{"type": "json_object"}`` only starts the answer as an object.
    """
    if not response_format:
        return "", ""
    kind = response_format.get("type")
    if kind == "json_object":
        return "", JSON_PREFILL
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema", spec)
        text = "Answer with a JSON object that conforms to this JSON schema:\n" + json.dumps(schema, ensure_ascii=False)
        return text, JSON_PREFILL if schema.get("type", "object") == "object" else ""
    raise ValueError(f"unsupported response_format type {kind!r}: expected 'json_schema' or 'json_object'")


def _is_pydantic(schema: Any) -> bool:
    return isinstance(schema, type) and is_basemodel_subclass(schema)


def _with_raw(llm: Runnable, parser: Runnable) -> Runnable:
    """``{"raw", "parsed", "parsing_error"}``: a parsing failure is returned, not raised."""
    parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parse.with_fallbacks([fallback], exception_key="parsing_error")


def structured_output(
    model: BaseChatModel,
    schema: Mapping[str, Any] | type | None,
    *,
    method: Method = "json_schema",
    include_raw: bool = False,
) -> Runnable[LanguageModelInput, Any]:
    """``model`` answering as ``schema``: a pydantic instance for a pydantic class, else a dict."""
    pydantic = _is_pydantic(schema)
    trace = {"kwargs": {"method": method}, "schema": schema} if schema is not None else None
    extra = {"ls_structured_output_format": trace} if trace else {}
    parser: Runnable
    if method == "function_calling":
        if schema is None:
            raise ValueError("method='function_calling' needs a schema")
        name = convert_to_openai_tool(schema)["function"]["name"]
        llm = model.bind_tools([schema], tool_choice=name, **extra)
        parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic  # type: ignore[list-item]
                  else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))  # fmt: skip
    elif method == "json_schema":
        if schema is None:
            raise ValueError("method='json_schema' needs a schema")
        json_schema = convert_to_json_schema(schema)
        response_format = {"type": "json_schema", "json_schema": {"name": json_schema.get("title", "response"), "schema": json_schema}}
        llm = model.bind(response_format=response_format, **extra)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
    elif method == "json_mode":
        llm = model.bind(response_format={"type": "json_object"}, **extra)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
    else:
        raise ValueError(f"unknown method {method!r}: expected 'json_schema', 'json_mode' or 'function_calling'")
    return _with_raw(llm, parser) if include_raw else llm | parser


__all__ = ["JSON_PREFILL", "Method", "response_format_prompt", "structured_output"]
