"""CacheGenLLM: a LangChain LLM over a local Hugging Face model whose long contexts are reused.

A drop-in for ``HuggingFacePipeline``: every prompt is tokenised and cut into chunks;
the leading chunks already in the store are fetched and decoded instead of being
recomputed, and new chunks are stored in the background. Nothing changes in the chain.
``ChatCacheGen`` wraps this class and generates through it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict, Field

from cachegen_core.engine import GenerationInfo, KVEngine
from cachegen_core.stores import KVStore

from .metadata import finish_reason, usage_metadata
from .stop import StopStreamer, cut_at_stop

DEFAULT_MODEL = "smollm2-135m"
#: New tokens per answer when ``generation_kwargs`` names no ``max_new_tokens``.
DEFAULT_MAX_NEW_TOKENS = 256

#: A prompt as text, or as token ids (what ``ChatCacheGen`` renders a conversation to).
Prompt = str | Sequence[int]


class CacheGenLLM(BaseLLM):
    """LangChain LLM backed by a ``KVEngine`` (model + CacheGen codec + KV store).

    Build it with ``CacheGenLLM.from_model_id(...)`` or pass an engine. Generation
    info of each answer reports ``cached_tokens``, ``recomputed_tokens``, ``levels``,
    ``bytes_fetched`` and ``ttft_s`` (the engine's ``GenerationInfo``), plus
    ``finish_reason`` (``"stop"`` or ``"length"``), ``model_name`` and ``usage_metadata``
    (tokens reused from the store as ``input_token_details["cache_read"]``); ``llm_output``
    sums the usage of a batch as ``token_usage``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVEngine = Field(exclude=True)
    model_id: str = DEFAULT_MODEL
    generation_kwargs: dict[str, Any] = Field(default_factory=lambda: {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS})
    """Defaults for transformers' ``generate``; per-call keyword arguments override them."""

    @classmethod
    def from_model_id(
        cls,
        model_id: str | Path = DEFAULT_MODEL,
        *,
        store: KVStore | None = None,
        level: int | str | None = None,
        chunk_tokens: int | None = None,  # None: CACHEGEN_CHUNK_TOKENS, else the engine default (1536)
        profile: Any = "auto",
        background: bool = True,
        slo_s: float | None = None,
        estimator: str = "harmonic",
        device: str | int | None = None,
        device_map: str | dict[str, Any] | None = None,
        dtype: Any = None,
        model_kwargs: dict[str, Any] | None = None,
        generation_kwargs: dict[str, Any] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> CacheGenLLM:
        """Load a local transformers directory, a ``.gguf`` file, a model id of the local Hugging Face cache
        or the bundled reference model by short name; nothing is downloaded.

        ``device`` (``"cuda"``, ``"cpu"``, or ``-1``/``n`` as in ``HuggingFacePipeline``),
        ``device_map``, ``dtype`` and ``model_kwargs`` place and load the model. The other
        keyword-only options configure the engine (``engine_kwargs`` holds the rarer ones of
        ``KVEngine.from_pretrained``); ``kwargs`` set this class's fields.
        """
        engine = KVEngine.from_pretrained(
            model_id,
            store=store,
            profile=profile,
            level=level,
            chunk_tokens=chunk_tokens,
            background=background,
            slo_s=slo_s,
            estimator=estimator,
            device=device,
            device_map=device_map,
            dtype=dtype,
            model_kwargs=model_kwargs,
            **(engine_kwargs or {}),
        )
        gen = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **(generation_kwargs or {})}
        return cls(engine=engine, model_id=str(model_id), generation_kwargs=gen, **kwargs)

    @property
    def _llm_type(self) -> str:
        return "cachegen"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        e = self.engine
        return {
            "model_id": self.model_id,
            "model_fingerprint": e.fingerprint,
            "codec_id": e.codec.codec_id,
            "profile_id": e.codec.profile_id,
            "level": e.level,
            "chunk_tokens": e.chunk_tokens,
            "generation_kwargs": self.generation_kwargs,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        gen = {**self.generation_kwargs, **kwargs}
        params["ls_provider"] = "cachegen"
        params["ls_model_name"] = self.model_id
        params["ls_max_tokens"] = gen.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if gen.get("temperature") is not None:
            params["ls_temperature"] = gen["temperature"]
        if stop:
            params["ls_stop"] = list(stop)
        return params

    def _engine_kwargs(self, stop: Sequence[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """This call's arguments to the engine: the defaults, the call's overrides and ``stop``."""
        out = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **self.generation_kwargs, **kwargs}
        if stop:
            out["stop"] = list(stop)
        return out

    def _info(self, info: GenerationInfo, stopped: bool, max_new_tokens: int | None) -> dict[str, Any]:
        """The generation info of one answer: the engine's counters plus why it ended, the model and usage."""
        out = info.as_dict()
        out["finish_reason"] = info.finish_reason or finish_reason(info.new_tokens, max_new_tokens, stopped)
        out["model_name"] = self.model_id
        out["usage_metadata"] = usage_metadata(out)
        return out

    def _generate(
        self,
        prompts: Sequence[Prompt],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        gen = self._engine_kwargs(stop, kwargs)
        generations = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for text, info in self.engine.generate_many(list(prompts), **gen):
            text, stopped = cut_at_stop(text, stop)
            generations.append([Generation(text=text, generation_info=self._info(info, stopped, gen.get("max_new_tokens")))])
            usage["prompt_tokens"] += info.prompt_tokens
            usage["completion_tokens"] += info.new_tokens
            usage["total_tokens"] += info.prompt_tokens + info.new_tokens
        return LLMResult(generations=generations, llm_output={"model_id": self.model_id, "model_name": self.model_id, "token_usage": usage})

    def _stream(
        self,
        prompt: Prompt,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        """Text chunks cut at ``stop``, then an empty chunk carrying the generation info."""
        gen = self._engine_kwargs(stop, kwargs)
        filt = StopStreamer(stop)
        for item in self.engine.stream(prompt, **gen):
            if isinstance(item, GenerationInfo):
                tail = filt.finish()
                if tail:
                    yield self._chunk(tail, run_manager)
                yield GenerationChunk(text="", generation_info=self._info(item, filt.stopped, gen.get("max_new_tokens")))
                return
            text = filt.feed(item)
            if text:
                yield self._chunk(text, run_manager)

    @staticmethod
    def _chunk(text: str, run_manager: CallbackManagerForLLMRun | None) -> GenerationChunk:
        chunk = GenerationChunk(text=text)
        if run_manager:
            run_manager.on_llm_new_token(text, chunk=chunk)
        return chunk


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DEFAULT_MODEL", "CacheGenLLM", "Prompt"]
