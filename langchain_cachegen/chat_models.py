"""ChatCacheGen: a LangChain chat model whose growing conversation history is reused from the store.

It holds a :class:`CacheGenLLM` and generates through it, as ``ChatHuggingFace`` does
with a ``HuggingFacePipeline``: messages are rendered to token ids with the
tokenizer's chat template, so each turn's prompt extends the previous turn's tokens
and every complete chunk of the history is found in the store instead of being
prefilled again.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, GenerationChunk

from cachegen_core.engine import KVEngine

from .chat_template import render_prompt
from .llms import DEFAULT_MODEL, CacheGenLLM

#: The keyword options of ``CacheGenLLM.from_model_id`` (engine and generation settings).
_LOAD_OPTIONS = frozenset(
    p.name for p in inspect.signature(CacheGenLLM.from_model_id).parameters.values() if p.kind is p.KEYWORD_ONLY
)


class ChatCacheGen(BaseChatModel):
    """Chat model over a :class:`CacheGenLLM`.

    Build it with ``ChatCacheGen.from_model_id(...)`` (the LLM's loader, same options)
    or ``ChatCacheGen(llm=CacheGenLLM(...))``. ``max_tokens``, ``temperature`` and
    ``stop`` override the LLM's generation settings for each call; ``None`` leaves them.
    """

    llm: CacheGenLLM
    max_tokens: int | None = None
    """New tokens per answer; ``None``: the LLM's ``generation_kwargs["max_new_tokens"]`` (256 by default)."""
    temperature: float | None = None
    """Sampling temperature; ``None`` or ``0``: greedy decoding."""
    stop: list[str] | None = None
    streaming: bool = False

    @classmethod
    def from_model_id(cls, model_id: str | Path = DEFAULT_MODEL, **kwargs: Any) -> ChatCacheGen:
        """Load with ``CacheGenLLM.from_model_id`` and wrap it.

        Its options (``store``, ``level``, ``chunk_tokens``, ``profile``, ``background``,
        ``slo_s``, ``estimator``, ``generation_kwargs``, ``engine_kwargs``) go to the LLM;
        every other keyword (``max_tokens``, ``temperature``, ``stop``, ``streaming``,
        callbacks, ...) sets a field of the chat model.
        """
        load = {k: kwargs.pop(k) for k in _LOAD_OPTIONS & kwargs.keys()}
        return cls(llm=CacheGenLLM.from_model_id(model_id, **load), **kwargs)

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
        return {**self.llm._identifying_params, "max_tokens": self.max_tokens, "temperature": self.temperature}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "cachegen"
        params["ls_model_name"] = kwargs.get("model", self.model_id)
        max_tokens = self.max_tokens if self.max_tokens is not None else self.llm.generation_kwargs.get("max_new_tokens")
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if self.temperature is not None:
            params["ls_temperature"] = self.temperature
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def _llm_call(self, stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[list[str] | None, dict[str, Any]]:
        """This call's stop sequences and generation overrides for the LLM."""
        gen: dict[str, Any] = {}
        if self.max_tokens is not None:
            gen["max_new_tokens"] = self.max_tokens
        if self.temperature:
            gen.update(do_sample=True, temperature=self.temperature)
        gen.update((k, v) for k, v in kwargs.items() if k != "model")  # `model` only names the model in traces
        return list(stop or self.stop or []) or None, gen

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        stop, gen = self._llm_call(stop, kwargs)
        result = self.llm._generate([render_prompt(self.engine.tokenizer, messages)], stop=stop, **gen)
        g = result.generations[0][0]
        msg = AIMessage(content=g.text, **self._metadata(g.generation_info or {}))
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info=g.generation_info)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        stop, gen = self._llm_call(stop, kwargs)
        # no run_manager for the LLM: tokens are reported below, as chat chunks
        for chunk in self.llm._stream(render_prompt(self.engine.tokenizer, messages), stop=stop, **gen):
            out = self._chat_chunk(chunk)
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=out)
            yield out

    def _chat_chunk(self, chunk: GenerationChunk) -> ChatGenerationChunk:
        """A text chunk as a message chunk; the final (info) chunk also carries metadata and usage."""
        if chunk.generation_info is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=chunk.text))
        message = AIMessageChunk(content=chunk.text, chunk_position="last", **self._metadata(chunk.generation_info))
        return ChatGenerationChunk(message=message, generation_info=chunk.generation_info)

    def _metadata(self, info: dict[str, Any]) -> dict[str, Any]:
        """``response_metadata`` and ``usage_metadata`` of a message from the LLM's generation info."""
        prompt_tokens, new_tokens = info.get("prompt_tokens", 0), info.get("new_tokens", 0)
        return {
            "response_metadata": {"model_name": self.model_id, **info},
            "usage_metadata": {
                "input_tokens": prompt_tokens,
                "output_tokens": new_tokens,
                "total_tokens": prompt_tokens + new_tokens,
            },
        }


__all__ = ["ChatCacheGen"]
