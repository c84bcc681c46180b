"""KVEngine: the four operations of CacheGen over a model, a codec and a store.

``calculate_kv`` prefills a context; ``store_kv`` encodes its complete chunks and stores them; ``get_kv``
fetches and decodes chunks; ``generate_with_kv`` generates on top of a decoded KV. ``generate`` ties them
together: the longest run of leading chunks stored (and the partial chunk after it) is streamed by the
:class:`ChunkReader`, the documents of a :class:`SegmentedPrompt` come from their document caches
(``documents.py``), the rest is prefilled, and new chunks go to the :class:`ChunkWriter`, off the request's
path. A store error or a bad blob is logged and recomputed: never a crash, never a wrong answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..keys.chunks import Chunk, chunk_keys, partial_chunks, partial_ends, token_array
from ..codec.kvcodec import KVCodec
from ..errors import CacheGenError, StoreError
from ..keys.fingerprint import model_fingerprint
from ..kv import KVCache
from ..ops.metrics import EngineMetrics, MetricsRecorder, summarise
from ..ops.progress import progress_bar
from ..ops.settings import resolve_store
from ..stores.base import KVStore, fetches_on_cpu
from ..codec.raw import RawCodec
from ..keys.segments import SegmentedPrompt, document_spans, prefix_ends, tokenize_parts
from ..streaming import RAW_OPTIONS, Controller, Option, make_estimator, rank
from . import hf
from .blend import BlendConfig, blend_config
from .buffers import BufferPool
from .cost import model_costs
from .documents import DocumentCaches, Indexed, Reused
from .info import GenerationInfo, covered_tokens
from .loading import from_pretrained
from .options import default_options, storable
from .positions import check_positions, position_limit
from .probes import Prober
from .reader import ChunkReader, report
from .writer import ChunkWriter

log = logging.getLogger("cachegen_core.engine")


class KVEngine:
    """CacheGen over one Hugging Face causal LM, one ``KVCodec`` and one ``KVStore``.

    ``codec``: default a codec without a profile and without step weights (chunks about a third larger
    than with the model's profile: ``docs/results.md``); ``KVEngine.from_pretrained`` finds the profile
    (the user cache's, the package's or the store's) or measures the weights, as the integrations do.

    ``chunk_tokens``: tokens per stored chunk. ``level``: the quality a hit must have without a
    deadline: a compression level (default: the codec's default), ``"raw"`` (16-bit KV) or
    ``"lossless"`` (the KV exactly: answers identical to no cache). ``store_options``: what a
    miss writes, levels and raw forms (default: the exact 16-bit form — ``"lossless"`` for a
    16-bit model, else ``"raw"`` — plus ``level``, and with ``slo_s`` the coarsest level;
    ``["lossless"]`` for ``level="lossless"``; where no entropy coder runs, their raw forms alone:
    ``options.py``). Without ``slo_s`` each cached chunk is streamed in the option
    predicted to finish the prompt's chunks first among those at least as fine as ``level``
    (or prefilled as text); with ``slo_s`` (seconds to fetch and decode them) the controller
    picks, chunk by chunk, the finest stored option that meets the deadline at the bandwidth
    measured by ``estimator`` (``"harmonic"`` or ``"last"``), or text (``allow_text=False``: a
    cached chunk is never recomputed instead). ``background``: store new chunks and measure costs (``probes.py``) in
    worker threads (True) or inline before returning (False, deterministic for scripts and tests). ``progress``: a bar on
    stderr while ``store_kv`` encodes chunks (on a terminal only; None: ``CACHEGEN_PROGRESS``).
    ``partial_step``: a prompt's incomplete last chunk is stored rounded down to a multiple of this many
    tokens, so the next prompt extending it reuses it, and so is the chunk ending at its shared prefix (a
    ``SegmentedPrompt``'s ``prefix_ends``, last document), for another question after it (0: complete chunks only). ``blend``: how the
    documents of a :class:`SegmentedPrompt` are reused from document caches wherever they land
    (``documents.py``): a preset of ``blend.PRESETS`` (``"fast"``, ``"balanced"``, ``"exact"``: documents
    are plain text, reused only in a prefix) or a ``BlendConfig``; None is ``"exact"``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        codec: KVCodec | None = None,
        store: KVStore | None = None,
        *,
        chunk_tokens: int = 1536,
        level: Option | None = None,
        store_options: Sequence[Option] | None = None,
        background: bool = True,
        queue_size: int = 64,
        add_special_tokens: bool = True,
        slo_s: float | None = None,
        estimator: str = "harmonic",
        allow_text: bool = True,
        progress: bool | None = None,
        partial_step: int = 64,
        blend: BlendConfig | str | None = "fast",
    ) -> None:
        if chunk_tokens < 1 or partial_step < 0:
            raise ValueError("chunk_tokens must be >= 1 and partial_step >= 0")
        self.model = model
        self.tokenizer = tokenizer
        self.fingerprint = model_fingerprint(model, tokenizer)
        self.codec = codec or KVCodec(fingerprint=self.fingerprint)
        if not self.codec.fingerprint:
            self.codec.fingerprint = self.fingerprint
        store = resolve_store(store)  # CACHEGEN_STORE when None; signed when CACHEGEN_HMAC_KEY is set
        self.chunk_tokens = chunk_tokens
        self.level = self.codec.config.default_level if level is None else level
        if self.level not in (*RAW_OPTIONS, *self.codec.levels):
            raise ValueError(f"level {self.level!r} is neither a raw form {RAW_OPTIONS} nor in {self.codec.levels}")
        dtype = hf.model_dtype(model)
        options = list(store_options) if store_options is not None else default_options(self.level, self.codec, dtype, slo_s)
        self.store_options = storable(options, self.codec, dtype)  # the raw forms alone where no entropy coder runs
        if not any(rank(o) <= rank(self.level) for o in self.store_options):
            raise ValueError(f"store_options {self.store_options} hold nothing as fine as level {self.level!r}")
        self.add_special_tokens = add_special_tokens
        self.slo_s = slo_s
        self.allow_text = allow_text
        self.estimator_name = estimator
        self.estimator = make_estimator(estimator, fixed_cost=fetches_on_cpu(store))  # a read's fixed cost apart: estimators.py
        self.kv_geometry = hf.supported_geometry(model)  # raises UnsupportedModel
        self.max_positions = position_limit(model.config)  # a longer request is refused (positions.py)
        self.buffers = BufferPool(*self.kv_geometry, hf.model_dtype(model), model.device)  # prompts' KV, reused
        self.cost_model = model_costs(model, self.kv_geometry, chunk_tokens)  # measured as it runs: cost.py, probes.py
        raw = RawCodec(self.fingerprint, limits=self.codec.limits, max_tokens=self.codec.max_tokens)
        self.writer = ChunkWriter(self.codec, store, self.store_options, raw=raw, background=background, queue_size=queue_size)
        self.reader = ChunkReader(self.codec, store, self.kv_geometry, self.cost_model, self.writer.health, raw=raw, hot=self.writer.hot)
        self.reader.prober = self.prober = Prober(self, background=background)
        why = self.reader.use_device(model.device)
        if why is not None:
            log.warning("the model is on %s but chunks decode on the CPU: %s", model.device, why)
        self._lock = threading.Lock()  # one model call at a time
        self.progress = progress  # progress bar on store_kv (None: CACHEGEN_PROGRESS, else on a terminal)
        self.metrics_recorder = MetricsRecorder()
        self.partial_step = partial_step
        self.blend = blend_config(blend)
        self.documents = DocumentCaches(self, self.blend) if self.blend is not None else None
        self.profile_fitter: Any = None  # fits a profile in the background (``profiles.py``; set by from_pretrained)
        self.prober.after_build()  # each raw form's copy on the model's device

    from_pretrained = classmethod(from_pretrained)  # load a model (or take one) and build an engine: loading.py

    @property
    def store(self) -> KVStore:
        """The store chunks are read from and written to (assignable: the writer follows)."""
        return self.writer.store

    @store.setter
    def store(self, store: KVStore) -> None:
        self.writer.store = self.reader.store = resolve_store(store)

    # ------------------------------------------------------------ the four operations
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as the model sees it."""
        return list(self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])

    def _ids(self, context: str | Sequence[int], new_tokens: int = 0) -> list[int]:
        """Token ids of ``context``; ``ValueError`` when empty, or when they and ``new_tokens`` exceed the model's positions."""
        if not (ids := self.tokenize(context) if isinstance(context, str) else list(map(int, context))):
            raise ValueError("empty context: nothing to compute")
        check_positions(self.max_positions, len(ids), new_tokens)
        return ids

    def segment(self, parts: Sequence[tuple[str, bool]]) -> SegmentedPrompt:
        """A prompt from ``(text, is_document)`` parts, each tokenised on its own (``segments.tokenize_parts``)."""
        return tokenize_parts(self.tokenizer, parts, add_special_tokens=self.add_special_tokens)

    def chunks(self, context: str | Sequence[int]) -> list[Chunk]:
        """The complete chunks of a context, with their store keys."""
        return self._chunk_keys(self._ids(context))

    def _chunk_keys(self, ids: Sequence[int] | np.ndarray) -> list[Chunk]:
        return chunk_keys(ids, chunk_tokens=self.chunk_tokens, fingerprint=self.fingerprint,
                          codec_id=self.codec.codec_id, profile_id=self.codec.profile_id or "")  # fmt: skip

    def calculate_kv(self, context: str | Sequence[int]) -> KVCache:
        """Prefill ``context`` with the model and return its KV cache."""
        ids = self._ids(context)
        with self._lock:
            return hf.prefill(self.model, ids)

    def store_kv(self, context: str | Sequence[int]) -> list[str]:
        """Encode every complete chunk of ``context`` at every stored level, put them; return the chunk ids."""
        ids = self._ids(context)
        chunks = self._chunk_keys(ids)
        if not chunks:
            return []
        kv = self.calculate_kv(ids[: chunks[-1].end])
        for c in progress_bar(chunks, self.progress, desc="encoding KV chunks", unit="chunk"):
            self.writer.write(c, kv.slice(c.start, c.end))
        return [c.key for c in chunks]

    def store_documents(self, documents: Sequence[str | Sequence[int]], progress: bool | None = None) -> Indexed:
        """Compute each document's KV on its own and store it now (unless stored already), for any later prompt holding
        it as a document, wherever (``documents.py``); says which were stored (every one skipped without a blend)."""
        if self.documents is None:
            return Indexed(skipped=tuple(range(len(documents))))
        return self.documents.store_documents(documents, self.progress if progress is None else progress)

    def get_kv(self, chunk_ids: Sequence[str], level: Option | None = None, info: GenerationInfo | None = None) -> KVCache:
        """Fetch and decode chunks (in order) stored as ``level`` (a level or raw form; default the engine's);
        raises ``StoreError`` (``BlobMissing``) or ``CacheGenFormatError``."""
        return self.reader.get(chunk_ids, self.level if level is None else level, info)

    def generate_with_kv(self, kv: KVCache | None, prompt: str | Sequence[int], **generation_kwargs: Any) -> str:
        """Generate a continuation of ``prompt`` whose first ``kv.num_tokens`` tokens are covered by ``kv``."""
        covered = kv.num_tokens if kv is not None else 0
        text, _ = self._generate_ids(self._ids(prompt), kv, covered, time.perf_counter(), GenerationInfo(), generation_kwargs)
        return text

    # ------------------------------------------------------------ whole requests
    def generate(self, prompt: str | Sequence[int], *, streamer: Any = None, cancel: threading.Event | None = None,
                 **generation_kwargs: Any) -> tuple[str, GenerationInfo]:  # fmt: skip
        """Answer ``prompt``, reusing its longest cached run of leading chunks (and partial chunk) and, for a
        :class:`SegmentedPrompt`, its documents' caches wherever they land; returns (text, info).

        ``generation_kwargs`` go to transformers' ``generate``, plus ``stop``: a list of
        strings after which generation stops (the text is returned whole; callers cut it), and
        ``seed`` (sampling's random generators for this request). Setting ``cancel`` (from any
        thread) stops generation after the token being computed, ``finish_reason`` ``"cancelled"``.
        """
        return self._answer([prompt], generation_kwargs, streamer=streamer, cancel=cancel)[0]

    def generate_many(self, prompts: Sequence[str | Sequence[int]], *, cancel: threading.Event | None = None,
                      **generation_kwargs: Any) -> list[tuple[str, GenerationInfo]]:  # fmt: skip
        """Answer several prompts that arrived together: their cached chunks are streamed as one batch.

        A chunk shared by several prompts is fetched and decoded once, and the
        controller plans with the bytes of the whole batch against the SLO.
        """
        return self._answer(list(prompts), generation_kwargs, cancel=cancel)

    def stream(self, prompt: str | Sequence[int], *, cancel: threading.Event | None = None,
               **generation_kwargs: Any) -> Iterator[str | GenerationInfo]:  # fmt: skip
        """Yield text pieces as they are generated, then the ``GenerationInfo`` last; closing the iterator early
        stops generation within a token (as setting ``cancel`` does)."""
        cancel = cancel or threading.Event()
        run = lambda streamer: self.generate(prompt, streamer=streamer, cancel=cancel, **generation_kwargs)  # noqa: E731
        return hf.stream_pieces(self.tokenizer, run, cancel)

    def prompt_kv(self, prompt: str | Sequence[int]) -> tuple[KVCache, GenerationInfo]:
        """The KV of ``prompt`` as a request builds it (stored chunks streamed, documents' caches moved and blended,
        the rest prefilled), without generating or storing anything: for measuring what reuse costs in quality."""
        ids, _, buffer, _, r, info = next(zip(*self._reuse([prompt], 0)))
        if r.filled < len(ids):
            self._prefill(ids[r.filled :], buffer, r.filled)
        return buffer.slice(0, len(ids)), info

    def _reuse(self, prompts: list[str | Sequence[int]], new_tokens: int) -> tuple[list, ...]:
        """Per prompt: ids, chunks, a buffer for them and ``new_tokens``, covered prefix, ``Reused``, info."""
        infos = [GenerationInfo() for _ in prompts]
        all_ids = [self._ids(p, new_tokens) for p in prompts]
        buffers = [self.buffers.take(len(ids) + new_tokens + 1) for ids in all_ids]  # uninitialised, model dtype and device
        arrays = [token_array(ids) for ids in all_ids]  # converted once: keys, then partial chunks' keys
        all_chunks = [self._chunk_keys(a) for a in arrays]
        for ids, info in zip(all_ids, infos):
            info.prompt_tokens = len(ids)
        controller = Controller(tuple(self.stream_options), self.slo_s, self.cost_model.prefill_s_per_token, allow_text=self.allow_text,
                                floor=self.level, serial=fetches_on_cpu(self.store))  # fmt: skip
        partials = [self._partials(a) for a in arrays] if 0 < self.partial_step < self.chunk_tokens else None
        spans = [document_spans(p) for p in prompts]
        documents = self.documents is not None and any(spans)
        # one prompt, no deadline, no documents: text chunks that end the stream are prefilled with the prompt's rest
        defer = len(prompts) == 1 and self.slo_s is None and not documents
        streamed = self.reader.stream(list(zip(all_ids, all_chunks, buffers)), infos, floor=self.level, controller=controller,
                                      estimator=self.estimator, prefill=self._prefill, partials=partials, defer_text=defer)  # fmt: skip
        covered = [c for c, _ in streamed]  # found in the store: not stored again
        for done, info in zip(covered, infos):
            info.partial_tokens = done % self.chunk_tokens
        reused = [Reused(filled, len(ids)) for ids, (_, filled) in zip(all_ids, streamed)]
        if documents:
            reused = self.documents.reuse(all_ids, spans, buffers, [f for _, f in streamed], infos, controller)  # type: ignore[union-attr]
        return all_ids, all_chunks, buffers, covered, reused, infos

    def _answer(self, prompts: list[str | Sequence[int]], generation_kwargs: dict[str, Any], streamer: Any = None,
                cancel: threading.Event | None = None) -> list[tuple[str, GenerationInfo]]:  # fmt: skip
        start, new_tokens = time.perf_counter(), int(generation_kwargs.get("max_new_tokens", hf.DEFAULT_MAX_NEW_TOKENS))
        out, seen = [], set()
        with self.writer.busy():  # the background writer encodes no level beside this request
            for i, (prompt, ids, chunks, buffer, done, r, info) in enumerate(zip(prompts, *self._reuse(prompts, new_tokens))):
                text, cache = self._generate_ids(ids, buffer, r.filled, start, info, generation_kwargs, streamer=streamer,
                                                 computed=r.computed, cancel=cancel)  # fmt: skip
                if done > r.filled:  # text chunks left to the generation's pass count as reused, as when the stream prefills them
                    info.cached_tokens = min(done, len(ids) - 1)
                    info.recomputed_tokens = len(ids) - info.cached_tokens
                if cache is not None:  # None: cancelled before the prompt was computed, nothing to store
                    queued = self._store_new_chunks(chunks, done, buffer, info, ids, r.exact, document_spans(prompt), prefix_ends(prompt))
                    if self.documents is not None and r.missing:
                        queued += self.documents.store(ids, r, info, seen)
                    info.tokens_queued = covered_tokens(queued)
                info.total_s = time.perf_counter() - start
                self.metrics_recorder.record(info, store=repr(self.store), chunk_tokens=self.chunk_tokens,
                                             prefill_s_per_token=self.cost_model.prefill_s_per_token, fetch_counted=i > 0)
                out.append((text, info))
                if (not info.chunks_queued or buffer.keys.is_cuda) and not r.missing:  # no view of it queued for the writer
                    self.buffers.give(buffer)  # (from a GPU the writer took copies, made before any later use of it)
        self.prober.drain()  # without a background thread, the costs due a measurement are measured now
        return out

    # ------------------------------------------------------------ the warm path
    @property
    def stream_options(self) -> list[Option]:
        """What the controller may fetch: every stored option (finest first)."""
        return sorted(self.store_options, key=rank)

    def _partials(self, ids: Sequence[int] | np.ndarray) -> Callable[[int], list[Chunk]]:
        """The partial chunks of ``ids`` that may follow a run of complete chunks ending at a token."""
        return lambda end: partial_chunks(ids, end, chunk_tokens=self.chunk_tokens, step=self.partial_step, fingerprint=self.fingerprint, codec_id=self.codec.codec_id, profile_id=self.codec.profile_id or "")  # fmt: skip  # noqa: E501

    def _prefill(self, ids: list[int], buffer: KVCache, start: int) -> None:
        """KV of ``ids`` computed into ``buffer[start:]`` on top of ``buffer[:start]`` (the text option), timed."""
        t = time.perf_counter()
        with self._lock:
            hf.prefill_into(self.model, ids, buffer, start)
        self.cost_model.observe_prefill(len(ids), start, time.perf_counter() - t)

    # ------------------------------------------------------------ generation and storing
    def _generate_ids(
        self, ids: list[int], kv: KVCache | None, covered: int, start: float, info: GenerationInfo,
        generation_kwargs: dict[str, Any], streamer: Any = None, computed: int = 0, cancel: threading.Event | None = None,
    ) -> tuple[str, Any]:  # fmt: skip
        """Generate after ``ids``, the first ``covered`` of which ``kv`` holds (its other tokens: room to write in),
        ``computed`` of them computed in this request rather than reused; returns the text and the model's cache
        (None: ``cancel`` was set before the prompt was computed)."""
        covered = min(covered, len(ids) - 1)  # generate() needs at least one token to prefill
        info.cached_tokens = max(0, covered - computed)
        info.recomputed_tokens = len(ids) - info.cached_tokens
        with self._lock:
            if cancel is not None and cancel.is_set():
                info.finish_reason = "cancelled"
                if streamer is not None:
                    streamer.end()
                return "", None
            began = time.perf_counter() - start  # the generation's pass: the prompt's rest prefilled, the first token
            out = hf.generate(self.model, self.tokenizer, ids, kv, start, generation_kwargs, streamer, filled=covered, cancel=cancel)
        info.new_tokens = out.new_tokens
        info.finish_reason, info.stop_sequence = out.finish_reason, out.stop_sequence
        info.ttft_s = out.ttft_s if out.ttft_s is not None else time.perf_counter() - start
        if out.ttft_s is not None and not computed:  # (reused documents blend: not a plain prefill)
            self.cost_model.observe_prefill(info.recomputed_tokens, covered, out.ttft_s - began)
        return out.text, out.cache

    def _store_new_chunks(self, chunks: list[Chunk], done: int, buffer: KVCache, info: GenerationInfo, ids: Sequence[int],
                          exact: int, spans: Sequence[tuple[int, int]] = (), prefixes: Sequence[int] = ()) -> list[tuple[int, int]]:  # fmt: skip
        """Hand the writer, as views of the request's buffer (filled in place, written to no more), the complete chunks
        computed (not fetched) here and the partial chunks ending before ``exact`` (past it reused documents made the KV
        approximate) where ``partial_ends`` says (``prefixes``: a chat's messages before its new turn). A reused partial
        chunk they extend keeps only its levels (``supersede``), unless it ends at a shared mark. Returns the spans of
        the prompt queued that were not read from the store (past ``done``)."""
        limit, partial, queued = min(exact, len(ids)), 0 < self.partial_step < self.chunk_tokens, []
        ends, superseded = partial_ends(limit, done, self.chunk_tokens, self.partial_step, spans, prefixes)
        for c in dict.fromkeys([*chunks, *(p for end in ends for p in self._partials(list(ids[:end]))(end - end % self.chunk_tokens)[-1:])]):
            if c.end <= done or c.end > limit:
                continue
            try:
                if self.writer.submit(c, buffer.slice(c.start, c.end)):
                    info.chunks_queued += 1
                    queued.append((max(c.start, done), c.end))
                    if partial and c.start < done and not superseded:  # done % chunk_tokens > 0: the partial chunk ending at done
                        superseded = True
                        self.writer.supersede(self._partials(list(ids[:done]))(c.start)[-1], self.level)
            except StoreError as e:  # logged once by the writer, not per chunk
                info.errors.append(f"storing chunk {c.index} failed: {e}")
            except CacheGenError as e:
                report(info, f"storing chunk {c.index} failed: {e}")
        return queued

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued chunks to be stored; False if ``timeout`` passed first."""
        return self.writer.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Store what is queued (up to ``timeout``), stop the writer's thread and free the kept buffers (a
        prompt's KV buffer is 355 MB at 7.7K tokens of the reference model in float32). The store stays open
        (it may be shared). Returns False if chunks were still queued at the timeout (not stored). The
        engine still answers after it, storing new chunks before it returns."""
        if self.profile_fitter is not None:
            self.profile_fitter.stop(timeout)
        self.prober.stop(timeout)
        done = self.writer.close(timeout)
        self.buffers.clear()
        self.reader.clear()
        return done

    def __enter__(self) -> KVEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def metrics(self) -> EngineMetrics:
        """What this engine's requests did so far: hits, tokens reused, bytes, seconds (``cachegen_core.ops.metrics``)."""
        rejected = getattr(self.store, "rejected", 0)
        return summarise(self.metrics_recorder.snapshot(), self.store_stats, rejected, self.cost_model.prefill_s_per_token)

    @property
    def store_stats(self) -> dict[str, int]:
        """Chunks written, failed and dropped (queue full) by the background writer, and still queued."""
        return self.writer.stats

