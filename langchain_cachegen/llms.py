"""CacheGenLLM: a LangChain LLM over a local Hugging Face model whose long contexts are reused.

A drop-in for ``HuggingFacePipeline``: every prompt is tokenised and cut into chunks;
the leading chunks already in the store are fetched and decoded instead of being
recomputed, and new chunks are stored in the background. Nothing changes in the chain.
``ChatCacheGen`` wraps this class and generates through it.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.llms import BaseLLM
from langchain_core.messages import BaseMessage, get_buffer_string
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict, Field, model_validator

from cachegen_core.engine import GenerationInfo, KVEngine
from cachegen_core.engine.aio import astream_pieces, run_in_thread
from cachegen_core.stores import KVStore

from .documents import CachedDocuments, cache_documents, engine_prompt, tokenize_marked
from .generation import ACCEPTED, GenerationFields, check_generation_kwargs, layered, refuse_unknown, to_transformers
from .metadata import finish_reason, model_name, usage_metadata
from .stop import StopStreamer, cut_at_stop

DEFAULT_MODEL = "smollm2-135m"
#: New tokens per answer when ``generation_kwargs`` names no ``max_new_tokens``.
DEFAULT_MAX_NEW_TOKENS = 256

#: A prompt as text, or as token ids (what ``ChatCacheGen`` renders a conversation to).
Prompt = str | Sequence[int]


class CacheGenLLM(GenerationFields, BaseLLM):
    """LangChain LLM backed by a ``KVEngine`` (model + CacheGen codec + KV store).

    Build it with ``CacheGenLLM.from_model_id(...)`` or pass an engine. Generation
    info of each answer reports ``cached_tokens``, ``recomputed_tokens``, ``levels``,
    ``bytes_fetched`` and ``ttft_s`` (the engine's ``GenerationInfo``), plus
    ``finish_reason`` (``"stop"`` or ``"length"``), ``model_name`` and ``usage_metadata``
    (tokens reused from the store as ``input_token_details["cache_read"]``, tokens this request
    queued for storing as ``"cache_creation"``); ``llm_output`` sums the usage of a batch as
    ``token_usage``.

    LangChain's generation parameters ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed`` and
    ``stop`` are fields (set at construction or by ``from_model_id``) and per-call arguments (and ``bind``'s),
    with the same meaning; a call's override the fields, which override ``generation_kwargs``
    (``generation.py``). Any other keyword is a ``TypeError`` naming the accepted ones. ``ainvoke``,
    ``abatch`` and ``astream`` never block the event loop, and a cancelled one stops generating
    within a token, freeing the model for the next request.

    An empty prompt is answered from the tokenizer's BOS token (its EOS where it has none, the token
    GPT-2-style models start a text with), as transformers' ``generate`` starts without input; a
    ``ChatCacheGen`` answers an empty message from its chat template. Token counting
    (``get_num_tokens``...) uses the engine's tokenizer: nothing is downloaded.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVEngine = Field(exclude=True)
    model_id: str = ""
    """The model's name, reported as ``model_name`` (generation info, traces' ``ls_model_name``): the name or path
    it was loaded by, else the engine's model's ``name_or_path`` (``metadata.model_name``), unless given."""
    generation_kwargs: dict[str, Any] = Field(default_factory=lambda: {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS})
    """Defaults for transformers' ``generate`` (its names: ``max_new_tokens``, ``do_sample``, ``repetition_penalty``...),
    checked at construction; ``temperature``, ``top_p`` and ``top_k`` here sample unless ``do_sample`` is False. The
    generation fields (``GenerationFields``) and each call's arguments (LangChain's names) override them."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_keywords(cls, data: Any) -> Any:
        if isinstance(data, dict):
            where = "an option of CacheGenLLM.from_model_id, which builds the engine (with engine=..., set it on the engine)"
            refuse_unknown(cls.__name__, data, list(cls.model_fields), dict.fromkeys(set(_load_options()) - {"generation_kwargs"}, where))
        return data

    @model_validator(mode="before")
    @classmethod
    def _name_the_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("model_id") and data.get("engine") is not None:
            data = {**data, "model_id": model_name(data["engine"])}
        return data

    @model_validator(mode="after")
    def _check_generation(self) -> CacheGenLLM:
        check_generation_kwargs(self.generation_kwargs, type(self).__name__)
        self._engine_kwargs(None, {})  # the fields' values: ValueError now rather than at the first call
        return self

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
        blend: Any = "fast",
        **kwargs: Any,
    ) -> CacheGenLLM:
        """Load a local transformers directory, a ``.gguf`` file, a Hugging Face hub id (``org/name``, downloaded into
        the Hugging Face cache on first use as ``HuggingFacePipeline.from_model_id`` does; ``HF_HUB_OFFLINE=1``: the
        cache only) or the bundled reference model by short name (never a download).

        ``device`` (``"cuda"``, ``"cpu"``, or ``-1``/``n`` as in ``HuggingFacePipeline``),
        ``device_map``, ``dtype`` and ``model_kwargs`` place and load the model (``model_kwargs`` go to the tokenizer's
        and the model's ``from_pretrained``: ``revision``, ``token``, ``cache_dir``, ``local_files_only``,
        ``trust_remote_code``, a GGUF repository's ``gguf_file``...). The other
        keyword-only options configure the engine (``engine_kwargs`` holds the rarer ones of
        ``KVEngine.from_pretrained``); ``kwargs`` set this class's fields.

        ``blend``: how documents marked by ``format_documents`` are reused wherever they land: ``"fast"``
        (the default: perplexity within +2 % of full prefill on the dev transcripts), ``"balanced"``
        (within +0.5 %, more recomputed) or ``"exact"`` (no blend: documents are reused only inside a
        stored prefix, so answers are the no-cache answers up to the stored level's own loss); or a
        ``BlendConfig``. An unknown keyword, or ``generation_kwargs`` that ``generate`` does not take, is a
        ``TypeError`` raised before the model is loaded.
        """
        fields = [f for f in cls.model_fields if f not in ("engine", "model_id", "generation_kwargs")]
        refuse_unknown(f"{cls.__name__}.from_model_id", kwargs, [*_load_options(), *fields])
        gen = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **(generation_kwargs or {})}
        check_generation_kwargs(gen, cls.__name__)
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
            **{"blend": blend, **(engine_kwargs or {})},
        )
        return cls(engine=engine, model_id=str(model_id), generation_kwargs=gen, **kwargs)

    @property
    def _llm_type(self) -> str:
        return "cachegen"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """The model, codec and store layout, and the generation settings every call starts from (transformers'
        names, after the fields and ``generation_kwargs``), as LangChain's caches and traces key on them."""
        e = self.engine
        gen = self._engine_kwargs(None, {})
        return {
            "model_id": self.model_id,
            "model_fingerprint": e.fingerprint,
            "codec_id": e.codec.codec_id,
            "profile_id": e.codec.profile_id,
            "level": e.level,
            "chunk_tokens": e.chunk_tokens,
            "generation_kwargs": gen,
        }

    def cache_documents(self, documents: Iterable[Document | str], *, progress: bool | None = None) -> CachedDocuments:
        """Compute and store, when documents are indexed, the document caches that later prompts holding them
        (through ``format_documents``) reuse wherever they land, so no question pays a document's prefill.
        Documents already stored are not computed again; a progress bar shows on a terminal. Returns
        which documents were stored, which were already there and which are too short to be reused."""
        return cache_documents(self.engine, documents, progress)

    def get_token_ids(self, text: str) -> list[int]:
        """The token ids the model is prompted with for ``text`` (the engine's tokenizer and special tokens,
        ``format_documents`` markers dropped): no GPT-2 tokenizer is fetched. ``custom_get_token_ids`` when set."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return list(tokenize_marked(self.engine.tokenizer, text, add_special_tokens=self.engine.add_special_tokens))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Tokens of the prompt this LLM gets for ``messages`` (LangChain joins them with ``get_buffer_string``);
        an LLM takes no tools."""
        if tools:
            raise ValueError(f"{type(self).__name__} takes no tools: count them with ChatCacheGen")
        return len(self.get_token_ids(get_buffer_string(messages)))

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "cachegen"
        params["ls_model_name"] = self.model_id
        params.update(self._ls_generation(stop, kwargs))
        return params

    def _ls_generation(self, stop: Sequence[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The tracing parameters of a call: its real new-token limit, temperature (0: greedy) and stop sequences."""
        try:
            gen = self._engine_kwargs(stop, {k: v for k, v in kwargs.items() if k in ACCEPTED})
        except (TypeError, ValueError):  # the call itself reports a bad argument; tracing must not
            gen = self._engine_kwargs(stop, {})
        sampled = getattr(getattr(self.engine.model, "generation_config", None), "temperature", None) or 1.0
        out: dict[str, Any] = {
            "ls_max_tokens": gen["max_new_tokens"],
            "ls_temperature": gen.get("temperature", sampled) if gen.get("do_sample") else 0.0,
        }
        if gen.get("stop"):
            out["ls_stop"] = list(gen["stop"])
        return out

    def _engine_kwargs(self, stop: Sequence[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """This call's arguments to the engine: ``generation_kwargs``, overridden by the fields, overridden by the
        call's (LangChain's names, checked and mapped to transformers': ``generation.py``), and ``stop`` (the call's,
        else the field's)."""
        call = layered(self.generation_fields(), kwargs)
        out = to_transformers({"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **self.generation_kwargs}, call, type(self).__name__)
        stops = list(stop or out.pop("stop", None) or [])
        out.pop("stop", None)
        if stops:
            out["stop"] = stops
        return out

    def _engine_prompt(self, prompt: Prompt) -> str | Sequence[int]:
        """What the engine is given for ``prompt`` (``engine_prompt``); an empty one starts from the tokenizer's BOS
        (else EOS) token, as ``generate`` does without input."""
        if len(prompt):
            return engine_prompt(self.engine, prompt)
        tok = self.engine.tokenizer
        start = self.engine.tokenize("") or [t for t in (tok.bos_token_id, tok.eos_token_id) if t is not None][:1]
        if not start:
            raise ValueError("an empty prompt, and the tokenizer has neither a BOS nor an EOS token to start from")
        return start

    def _info(self, info: GenerationInfo, stopped: bool, max_new_tokens: int | None) -> dict[str, Any]:
        """The generation info of one answer: the engine's counters plus why it ended, the model and usage."""
        out = info.as_dict()
        out["finish_reason"] = info.finish_reason or finish_reason(info.new_tokens, max_new_tokens, stopped)
        out["model_name"] = self.model_id
        out["usage_metadata"] = usage_metadata(out)
        return out

    def _results(self, prompts: Sequence[Prompt], stop: list[str] | None, kwargs: dict[str, Any],
                 cancel: threading.Event | None = None) -> LLMResult:  # fmt: skip
        gen = self._engine_kwargs(stop, kwargs)
        generations = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for text, info in self.engine.generate_many([self._engine_prompt(p) for p in prompts], cancel=cancel, **gen):
            text, stopped = cut_at_stop(text, gen.get("stop"))
            generations.append([Generation(text=text, generation_info=self._info(info, stopped, gen.get("max_new_tokens")))])
            usage["prompt_tokens"] += info.prompt_tokens
            usage["completion_tokens"] += info.new_tokens
            usage["total_tokens"] += info.prompt_tokens + info.new_tokens
        return LLMResult(generations=generations, llm_output={"model_id": self.model_id, "model_name": self.model_id, "token_usage": usage})

    def _generate(
        self,
        prompts: Sequence[Prompt],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        return self._results(prompts, stop, kwargs)

    async def _agenerate(
        self,
        prompts: Sequence[Prompt],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """``_generate`` in a thread of its own (``aio.run_in_thread``): cancelled, it stops within a token."""
        self._engine_kwargs(stop, kwargs)  # a bad keyword fails here, not in the thread
        cancel = threading.Event()
        return await run_in_thread(lambda: self._results(prompts, stop, kwargs, cancel), cancel)

    def _stream(
        self,
        prompt: Prompt,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        """Text chunks cut at ``stop``, then an empty chunk carrying the generation info; leaving early stops generation."""
        gen = self._engine_kwargs(stop, kwargs)
        chunks = _Chunks(self, gen.get("stop"), gen.get("max_new_tokens"))
        for item in self.engine.stream(self._engine_prompt(prompt), **gen):
            for chunk in chunks(item):
                if run_manager and chunk.text:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(
        self,
        prompt: Prompt,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        """``_stream`` without blocking the event loop (tokenising and generating in a thread of its own);
        cancelled or closed, it stops generating within a token."""
        gen = self._engine_kwargs(stop, kwargs)
        chunks = _Chunks(self, gen.get("stop"), gen.get("max_new_tokens"))
        cancel = threading.Event()
        run = lambda streamer: self.engine.generate(self._engine_prompt(prompt), streamer=streamer, cancel=cancel, **gen)  # noqa: E731
        async for item in astream_pieces(self.engine.tokenizer, run, cancel):
            for chunk in chunks(item):
                if run_manager and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk


def _load_options() -> list[str]:
    """The keyword-only options of ``CacheGenLLM.from_model_id`` (loading, engine and generation settings)."""
    params = inspect.signature(CacheGenLLM.from_model_id).parameters.values()
    return [p.name for p in params if p.kind is p.KEYWORD_ONLY]


class _Chunks:
    """A stream's engine items (text pieces, then the ``GenerationInfo``) as generation chunks: text held back while
    a stop sequence could claim it, then an empty chunk carrying the generation info."""

    def __init__(self, llm: CacheGenLLM, stop: list[str] | None, max_new_tokens: int | None) -> None:
        self.llm, self.filter, self.max_new_tokens = llm, StopStreamer(stop), max_new_tokens

    def __call__(self, item: str | GenerationInfo) -> list[GenerationChunk]:
        if not isinstance(item, GenerationInfo):
            text = self.filter.feed(item)
            return [GenerationChunk(text=text)] if text else []
        tail = self.filter.finish()
        info = self.llm._info(item, self.filter.stopped, self.max_new_tokens)
        return [*([GenerationChunk(text=tail)] if tail else []), GenerationChunk(text="", generation_info=info)]


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DEFAULT_MODEL", "CacheGenLLM", "Prompt"]
