"""CacheGenLLM: a LangChain LLM over a local Hugging Face model whose long contexts are reused.

A drop-in for ``HuggingFacePipeline``: every prompt is tokenised and cut into chunks;
the leading chunks already in the store are fetched and decoded instead of being
recomputed, and new chunks are stored in the background. Nothing changes in the chain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict, Field

from cachegen_core.engine import GenerationInfo, KVEngine
from cachegen_core.stores.base import KVStore

from .stop import StopStreamer, cut_at_stop

DEFAULT_MODEL = "smollm2-135m"


class CacheGenLLM(BaseLLM):
    """LangChain LLM backed by a ``KVEngine`` (model + CacheGen codec + KV store).

    Build it with ``CacheGenLLM.from_model_id(...)`` or pass an engine. Generation
    info of each answer reports ``cached_tokens``, ``recomputed_tokens``, ``levels``,
    ``bytes_fetched`` and ``ttft_s``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVEngine = Field(exclude=True)
    model_id: str = DEFAULT_MODEL
    generation_kwargs: dict[str, Any] = Field(default_factory=lambda: {"max_new_tokens": 256})

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
        generation_kwargs: dict[str, Any] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> "CacheGenLLM":
        """Load a local transformers directory, a ``.gguf`` file or the bundled reference model by short name."""
        engine = KVEngine.from_pretrained(
            model_id,
            store=store,
            profile=profile,
            level=level,
            chunk_tokens=chunk_tokens,
            background=background,
            slo_s=slo_s,
            estimator=estimator,
            **(engine_kwargs or {}),
        )
        gen = {"max_new_tokens": 256, **(generation_kwargs or {})}
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

    def _kwargs(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        out = {**self.generation_kwargs, **kwargs}
        if stop:
            out["stop"] = list(stop)
        return out

    def _prompt(self, prompt: str) -> Any:
        """What the engine generates from (token ids in ``ChatCacheGen``)."""
        return prompt

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        results = self.engine.generate_many([self._prompt(p) for p in prompts], **self._kwargs(stop, kwargs))
        for text, info in results:
            text, _ = cut_at_stop(text, stop)
            generations.append([Generation(text=text, generation_info=info.as_dict())])
        return LLMResult(generations=generations, llm_output={"model_id": self.model_id})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        filt = StopStreamer(stop)
        for item in self.engine.stream(self._prompt(prompt), **self._kwargs(stop, kwargs)):
            if isinstance(item, GenerationInfo):
                tail = filt.finish()
                if tail:
                    yield self._chunk(tail, run_manager)
                yield GenerationChunk(text="", generation_info=item.as_dict())
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
