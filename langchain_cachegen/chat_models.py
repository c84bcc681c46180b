"""ChatCacheGen: a LangChain chat model whose growing conversation history is reused from the store.

It holds a :class:`CacheGenLLM` and generates through it, as ``ChatHuggingFace`` does
with a ``HuggingFacePipeline``: messages are rendered to token ids with the
tokenizer's chat template, so each turn's prompt extends the previous turn's tokens
and every complete chunk of the history is found in the store instead of being
prefilled again. Tool calls and tool results are rendered into that history too
(:mod:`.messages`), and parsed out of answers (:mod:`.tool_calls`).
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.tool import ToolCallChunk, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, GenerationChunk
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.json import parse_partial_json
from pydantic import model_validator

from cachegen_core.engine import KVEngine
from cachegen_core.engine.aio import run_in_thread

from .chat_template import render_prompt
from .documents import CachedDocuments, cache_documents, tokenize_marked
from .generation import ACCEPTED, GenerationFields, check_keywords, layered, refuse_unknown
from .llms import DEFAULT_MODEL, CacheGenLLM
from .metadata import usage_metadata
from .structured_output import Method, response_format_prompt, structured_output
from .tool_calls import ParsedAnswer, ToolCallStreamer, forced_call_prefill, parse_tool_calls

#: The keyword options of ``CacheGenLLM.from_model_id`` (engine and generation settings).
_LOAD_OPTIONS = frozenset(p.name for p in inspect.signature(CacheGenLLM.from_model_id).parameters.values() if p.kind is p.KEYWORD_ONLY)


def normalize_tool_choice(tool_choice: str | bool | dict[str, Any] | None, names: Sequence[str]) -> str | dict[str, Any] | None:
    """``tool_choice`` in OpenAI's shape: ``None`` (auto), ``"none"``, ``"required"`` or ``{"function": {"name"}}``.

    ``"any"``, ``"required"`` and ``True`` force a call of some tool; a tool's name (or
    such a dict) forces that tool; ``"auto"``, ``False`` and ``None`` leave it to the model.
    """
    if tool_choice in (None, False, "auto"):
        return None
    if tool_choice == "none":
        return "none"
    if tool_choice in (True, "any", "required"):
        return "required"
    name = tool_choice if isinstance(tool_choice, str) else (tool_choice or {}).get("function", {}).get("name")
    if name not in names:
        raise ValueError(f"tool_choice {tool_choice!r} names no bound tool; bound: {list(names)}")
    return {"type": "function", "function": {"name": name}}


def _tool_call_chunks(parsed: ParsedAnswer) -> list[ToolCallChunk]:
    """The parsed calls as the chunks of a stream's last message, which LangChain turns back into calls.

    LangChain re-parses chunk arguments leniently (unclosed JSON is closed), so an invalid
    call whose raw text would parse as an object is passed as a JSON string: it stays invalid.
    """
    chunks = [tool_call_chunk(name=c["name"], args=json.dumps(c["args"], ensure_ascii=False), id=c["id"], index=i)
              for i, c in enumerate(parsed.tool_calls)]  # fmt: skip
    for c in parsed.invalid_tool_calls:
        raw = c["args"] or ""
        try:
            stays_invalid = bool(raw) and not isinstance(parse_partial_json(raw), dict)  # "" reads as {}
        except ValueError:
            stays_invalid = True
        args = raw if stays_invalid else json.dumps(raw, ensure_ascii=False)
        chunks.append(tool_call_chunk(name=c["name"], args=args, id=c["id"], index=len(chunks)))
    return chunks


#: Keywords a call may carry besides the generation parameters (``bind_tools``, ``with_structured_output``, traces).
_CALL_OPTIONS = frozenset({"tools", "tool_choice", "response_format", "model"})


@dataclass
class _Call:
    """One request to the LLM: the rendered prompt, the answer's prefill and how to read the answer."""

    ids: Sequence[int]  # a SegmentedPrompt where messages precede the new turn or hold documents
    prefill: str
    tool_names: tuple[str, ...] | None  # None: do not look for tool calls
    stop: list[str] | None
    gen: dict[str, Any]


class ChatCacheGen(GenerationFields, BaseChatModel):
    """Chat model over a :class:`CacheGenLLM`.

    Build it with ``ChatCacheGen.from_model_id(...)`` (the LLM's loader, same options)
    or ``ChatCacheGen(llm=CacheGenLLM(...))``. ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``seed`` and ``stop`` override the LLM's generation settings for each call; ``None`` leaves them.
    Each call (and ``bind``) may override them again (``generation.py``); any other keyword, at
    construction or per call, is a ``TypeError`` naming the accepted ones. ``ainvoke``, ``abatch`` and
    ``astream`` never block the event loop, and a cancelled one stops generating within a token, freeing
    the model. Token counting (``get_num_tokens_from_messages``, so ``trim_messages(...,
    token_counter=chat)``) renders the messages as a call does, with the engine's tokenizer.
    """

    llm: CacheGenLLM
    streaming: bool = False
    """``invoke`` streams (LangChain's ``streaming`` flag): callbacks get each token."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_keywords(cls, data: Any) -> Any:
        if isinstance(data, dict):
            where = "an option of the CacheGenLLM (ChatCacheGen.from_model_id passes it on; with llm=..., set it there)"
            refuse_unknown(cls.__name__, data, list(cls.model_fields), dict.fromkeys(_LOAD_OPTIONS, where))
        return data

    @model_validator(mode="after")
    def _check_generation(self) -> ChatCacheGen:
        self.llm._engine_kwargs(*self._llm_call(None, {}))  # the fields' values: ValueError now rather than at the first call
        return self

    @classmethod
    def from_model_id(cls, model_id: str | Path = DEFAULT_MODEL, **kwargs: Any) -> ChatCacheGen:
        """Load with ``CacheGenLLM.from_model_id`` and wrap it.

        Its options (``store``, ``level``, ``chunk_tokens``, ``profile``, ``background``,
        ``slo_s``, ``estimator``, ``generation_kwargs``, ``engine_kwargs``) go to the LLM;
        every other keyword (``max_tokens``, ``temperature``, ``top_k``, ``stop``, ``streaming``,
        callbacks, ...) sets a field of the chat model; an unknown one is a ``TypeError``, raised before the
        model is loaded.
        """
        load = {k: kwargs.pop(k) for k in _LOAD_OPTIONS & kwargs.keys()}
        refuse_unknown(f"{cls.__name__}.from_model_id", kwargs, sorted({*_LOAD_OPTIONS, *cls.model_fields} - {"llm"}))
        return cls(llm=CacheGenLLM.from_model_id(model_id, **load), **kwargs)

    def cache_documents(self, documents: Iterable[Document | str], *, progress: bool | None = None) -> CachedDocuments:
        """Compute and store, when documents are indexed, the document caches that later prompts holding them
        (through ``format_documents``, in any message) reuse wherever they land: ``CacheGenLLM.cache_documents``."""
        return cache_documents(self.engine, documents, progress)

    @property
    def engine(self) -> KVEngine:
        """The LLM's engine (``chat.engine.flush()``, ``chat.engine.tokenizer``)."""
        return self.llm.engine

    @property
    def model_id(self) -> str:
        """The LLM's model id, reported as ``model_name`` in response metadata."""
        return self.llm.model_id

    @property
    def _llm_type(self) -> str:
        return "cachegen-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """The LLM's, with the generation settings every call starts from after this model's fields."""
        stop, gen = self._llm_call(None, {})
        return {**self.llm._identifying_params, "generation_kwargs": self.llm._engine_kwargs(stop, gen)}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "cachegen"
        params["ls_model_name"] = kwargs.get("model", self.model_id)
        params.update(self.llm._ls_generation(*self._llm_call(stop, {k: v for k, v in kwargs.items() if k in ACCEPTED})))
        return params

    def get_token_ids(self, text: str) -> list[int]:
        """The token ids of ``text`` as a message's content (the engine's tokenizer, no special tokens,
        ``format_documents`` markers dropped): no GPT-2 tokenizer is fetched. ``custom_get_token_ids`` when set."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return list(tokenize_marked(self.engine.tokenizer, text, add_special_tokens=False))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Tokens of the prompt a call on ``messages`` (with ``tools`` bound) renders: the chat template, its
        special tokens and the assistant turn it opens, as ``usage_metadata["input_tokens"]`` counts them."""
        if not messages:
            return 0
        formatted = [convert_to_openai_tool(t) for t in tools] if tools else None
        return len(render_prompt(self.engine.tokenizer, messages, tools=formatted, mark_prefix=False))

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (anything ``convert_to_openai_tool`` takes) to this model.

        The chat template gets them when it renders tools, else they are described in the
        system message (Hermes format: ``<tools>``, answers in ``<tool_call>``). Answers
        are parsed into ``AIMessage.tool_calls`` (``invalid_tool_calls`` for malformed
        ones). ``tool_choice``: ``"auto"``/``None``, ``"none"``, ``"any"``/``"required"``/
        ``True`` or a tool's name; a forced call is started in the answer's first tokens.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        choice = normalize_tool_choice(tool_choice, [t["function"]["name"] for t in formatted])
        if choice is not None:
            kwargs["tool_choice"] = choice
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: Mapping[str, Any] | type | None = None,
        *,
        method: Method = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """This model answering as ``schema`` (a pydantic class, a TypedDict or a JSON schema).

        ``method``: ``"json_schema"`` (default; the schema goes into the system message and
        the answer starts as a JSON object), ``"json_mode"`` (only the latter) or
        ``"function_calling"`` (the schema as a forced tool). ``strict`` is accepted and
        ignored: nothing constrains sampling, so a non-conforming answer fails to parse
        (returned as ``parsing_error`` with ``include_raw=True``).
        """
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        return structured_output(self, schema, method=method, include_raw=include_raw)

    def _llm_call(self, stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[list[str] | None, dict[str, Any]]:
        """This call's stop sequences and generation overrides for the LLM (LangChain's names: the fields, then the call's)."""
        kwargs = {k: v for k, v in kwargs.items() if k != "model"}  # `model` only names the model in traces
        check_keywords(kwargs, type(self).__name__)
        gen = layered(self.generation_fields(), kwargs)
        stop = stop or gen.pop("stop", None)
        gen.pop("stop", None)
        return list(stop or []) or None, gen

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Call:
        """Render the prompt for this call (tools, answer format) and split off the LLM's arguments."""
        tools = kwargs.pop("tools", None) or None
        choice = kwargs.pop("tool_choice", None)
        system_text, prefill = response_format_prompt(kwargs.pop("response_format", None))
        if tools and choice not in (None, "none"):
            prefill = forced_call_prefill(tools, choice["function"]["name"] if isinstance(choice, dict) else None)
        names = tuple(t["function"]["name"] for t in tools) if tools and choice != "none" else None
        stop, gen = self._llm_call(stop, kwargs)  # a bad keyword fails before anything is rendered
        ids = render_prompt(self.engine.tokenizer, messages, tools=tools, system_text=system_text, prefill=prefill)
        return _Call(ids, prefill, names, stop, gen)

    def _result(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any],
                cancel: threading.Event | None = None) -> ChatResult:  # fmt: skip
        call = self._prepare(messages, stop, kwargs)
        result = self.llm._results([call.ids], call.stop, call.gen, cancel)
        g = result.generations[0][0]
        text = call.prefill + g.text
        parsed = parse_tool_calls(text, call.tool_names) if call.tool_names is not None else ParsedAnswer(text)
        info, metadata = self._metadata(g.generation_info or {})
        msg = AIMessage(content=parsed.content, tool_calls=parsed.tool_calls, invalid_tool_calls=parsed.invalid_tool_calls, **metadata)
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info=info)])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._result(messages, stop, kwargs)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """``_generate`` in a thread of its own (``aio.run_in_thread``): cancelled, it stops within a token."""
        check_keywords({k: v for k, v in kwargs.items() if k not in _CALL_OPTIONS}, type(self).__name__)  # fail here, not in the thread
        cancel = threading.Event()
        return await run_in_thread(lambda: self._result(messages, stop, dict(kwargs), cancel), cancel)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """Text chunks as they come (tool-call markup held back), then a last chunk with tool calls and metadata."""
        call = self._prepare(messages, stop, kwargs)
        chunks = _ChatChunks(self, call)
        # no run_manager for the LLM: tokens are reported below, as chat chunks
        for chunk in self.llm._stream(call.ids, stop=call.stop, **call.gen):
            if (out := chunks(chunk)) is not None:
                yield self._emit(out, run_manager)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """``_stream`` without blocking the event loop (the prompt rendered, tokenised and answered in a thread of its
        own); cancelled or closed, it stops generating within a token."""
        call = await run_in_thread(lambda: self._prepare(messages, stop, dict(kwargs)), threading.Event())
        chunks = _ChatChunks(self, call)
        async for chunk in self.llm._astream(call.ids, stop=call.stop, **call.gen):
            if (out := chunks(chunk)) is not None:
                if run_manager and out.text:
                    await run_manager.on_llm_new_token(out.text, chunk=out)
                yield out

    @staticmethod
    def _emit(chunk: ChatGenerationChunk, run_manager: CallbackManagerForLLMRun | None) -> ChatGenerationChunk:
        if run_manager and chunk.text:
            run_manager.on_llm_new_token(chunk.text, chunk=chunk)
        return chunk

    def _metadata(self, llm_info: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The generation info (the LLM's, less its usage) and the message's metadata fields.

        ``response_metadata``: model name, finish reason and the engine's counters (LangChain
        also merges the generation info into it); ``usage_metadata``: the LLM's usage.
        """
        info = {"model_name": self.model_id, **llm_info}
        usage = info.pop("usage_metadata", None) or usage_metadata(info)
        return info, {"response_metadata": dict(info), "usage_metadata": usage}


class _ChatChunks:
    """The LLM's stream of one call as chat chunks: the answer's prefill with its first piece, tool-call markup held
    back, and a last chunk carrying the tool calls and the metadata."""

    def __init__(self, chat: ChatCacheGen, call: _Call) -> None:
        self.chat, self.pending = chat, call.prefill
        self.streamer = ToolCallStreamer(call.tool_names) if call.tool_names is not None else None

    def __call__(self, chunk: GenerationChunk) -> ChatGenerationChunk | None:
        text, self.pending = self.pending + chunk.text, ""
        if chunk.generation_info is None:
            out = self.streamer.feed(text) if self.streamer else text
            return ChatGenerationChunk(message=AIMessageChunk(content=out)) if out else None
        calls: list[ToolCallChunk] = []
        if self.streamer:
            self.streamer.feed(text)
            text, parsed = self.streamer.finish()
            calls = _tool_call_chunks(parsed)
        info, metadata = self.chat._metadata(chunk.generation_info)
        message = AIMessageChunk(content=text, tool_call_chunks=calls, chunk_position="last", **metadata)
        return ChatGenerationChunk(message=message, generation_info=info)


__all__ = ["ChatCacheGen", "normalize_tool_choice", "render_prompt"]
