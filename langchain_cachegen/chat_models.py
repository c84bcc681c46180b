"""ChatCacheGen: a LangChain chat model whose growing conversation history is reused from the store.

Messages are rendered with the tokenizer's chat template (or a plain ``role: text``
template when it has none), so each turn's prompt extends the previous turn's tokens:
every complete chunk of the history is found in the store and decoded instead of
being prefilled again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field

from cachegen_core.engine import GenerationInfo, KVEngine
from cachegen_core.stores.base import KVStore

from .chat_template import render_prompt
from .llms import DEFAULT_MODEL
from .stop import StopStreamer, cut_at_stop

class ChatCacheGen(BaseChatModel):
    """Chat model over a ``KVEngine``; build with ``ChatCacheGen.from_model_id(...)`` or pass an engine."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    engine: KVEngine = Field(exclude=True)
    model_id: str = Field(default=DEFAULT_MODEL, alias="model")
    max_tokens: int | None = 256
    temperature: float | None = None
    stop: list[str] | None = None
    streaming: bool = False
    timeout: float | None = None
    max_retries: int | None = None
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_model_id(
        cls,
        model_id: str | Path = DEFAULT_MODEL,
        *,
        store: KVStore | None = None,
        level: int | None = None,
        chunk_tokens: int = 1536,
        profile: Any = "auto",
        background: bool = True,
        slo_s: float | None = None,
        estimator: str = "harmonic",
        **kwargs: Any,
    ) -> "ChatCacheGen":
        """Load a local transformers directory, a ``.gguf`` file or the bundled reference model by short name."""
        engine = KVEngine.from_pretrained(
            model_id, store=store, profile=profile, level=level, chunk_tokens=chunk_tokens, background=background,
            slo_s=slo_s, estimator=estimator,
        )  # fmt: skip
        return cls(engine=engine, model_id=str(model_id), **kwargs)

    @property
    def _llm_type(self) -> str:
        return "cachegen-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        e = self.engine
        return {"model_id": self.model_id, "model_fingerprint": e.fingerprint, "codec_id": e.codec.codec_id, "level": e.level}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "cachegen"
        params["ls_model_name"] = kwargs.get("model", self.model_id)
        if self.max_tokens is not None:
            params["ls_max_tokens"] = self.max_tokens
        if self.temperature is not None:
            params["ls_temperature"] = self.temperature
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def _kwargs(self, stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        stops = list(stop or self.stop or [])
        out: dict[str, Any] = dict(self.generation_kwargs)
        if self.max_tokens is not None:
            out["max_new_tokens"] = self.max_tokens
        if self.temperature:
            out.update(do_sample=True, temperature=self.temperature)
        kwargs = dict(kwargs)
        kwargs.pop("model", None)
        out.update(kwargs)
        if stops:
            out["stop"] = stops
        return out, stops

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        gen, stops = self._kwargs(stop, kwargs)
        text, info = self.engine.generate(render_prompt(self.engine.tokenizer, messages), **gen)
        text, _ = cut_at_stop(text, stops)
        meta = info.as_dict()
        msg = AIMessage(
            content=text,
            response_metadata={"model_name": self.model_id, **meta},
            usage_metadata={
                "input_tokens": info.prompt_tokens,
                "output_tokens": info.new_tokens,
                "total_tokens": info.prompt_tokens + info.new_tokens,
            },
        )
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info=meta)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        gen, stops = self._kwargs(stop, kwargs)
        filt = StopStreamer(stops)
        for item in self.engine.stream(render_prompt(self.engine.tokenizer, messages), **gen):
            if isinstance(item, GenerationInfo):
                tail = filt.finish()
                if tail:
                    yield self._chunk(tail, run_manager)
                meta = item.as_dict()
                yield ChatGenerationChunk(
                    message=AIMessageChunk(
                        content="",
                        response_metadata={"model_name": self.model_id, **meta},
                        usage_metadata={
                            "input_tokens": item.prompt_tokens,
                            "output_tokens": item.new_tokens,
                            "total_tokens": item.prompt_tokens + item.new_tokens,
                        },
                        chunk_position="last",
                    ),
                    generation_info=meta,
                )
                return
            text = filt.feed(item)
            if text:
                yield self._chunk(text, run_manager)

    @staticmethod
    def _chunk(text: str, run_manager: CallbackManagerForLLMRun | None) -> ChatGenerationChunk:
        chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
        if run_manager:
            run_manager.on_llm_new_token(text, chunk=chunk)
        return chunk
