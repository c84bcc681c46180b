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
import torch

from ..keys.chunks import Chunk, chunk_keys, partial_chunks, partial_ends
from ..codec.kvcodec import KVCodec
from ..errors import CacheGenError, StoreError
from ..keys.fingerprint import model_fingerprint
from ..kv import KVCache
from .. import openmp
from ..ops.metrics import EngineMetrics, MetricsRecorder, summarise
from ..ops.progress import progress_bar
from ..ops.settings import load as load_settings
from ..ops.settings import resolve_store
from ..stores.base import KVStore, fetches_on_cpu
from ..codec.raw import RawCodec
from ..keys.segments import SegmentedPrompt, tokenize_parts
from ..streaming import RAW_OPTIONS, Option, make_estimator, rank
from .model import hf
from .documents.blend import BlendConfig, blend_config
from .serving.buffers import BufferPool
from .costs.cost import model_costs
from .documents.documents import DocumentCaches, Indexed
from .requests import Batch
from .serving.info import GenerationInfo
from .serving.memory import DEFAULT_QUEUE, KVMemory, default_limit
from .serving.prefixes import Held, RequestKV, SharedPrefixes
from .serving.request import Job, Reused
from .serving.scheduler import Scheduler
from .loading import from_pretrained
from .chunks.options import default_options, storable
from .model.positions import check_positions, position_limit
from .costs.probes import Prober
from .chunks.reader import ChunkReader, report
from .chunks.writer import ChunkWriter

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

    Many requests at once (threads, asyncio tasks, ``generate_many``) are batched: the engine's
    :class:`~.serving.scheduler.Scheduler` owns the model and runs every running request's next token in one
    forward, a joining request's prompt in pieces between them (``requests.py``). A prefix held by a running
    request is read in place by every other request whose prompt starts with it (``share_prefixes``).
    ``kv_memory``: bytes the KV of running requests may take (None: ``CACHEGEN_KV_MEMORY``, else a share of the
    device's memory, ``serving/memory.py``); a request that does not fit waits in a queue of ``kv_queue``
    requests, past which it fails with ``EngineBusy``.
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
        kv_memory: int | None = None,
        kv_queue: int | None = None,
        share_prefixes: bool = True,
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
        self.background = background
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
        cost = self.cost_model  # read at each use (never the engine: a dropped engine is freed at once)
        self.scheduler = Scheduler(model, tokenizer, prefill_seconds=lambda n, p: cost.prefill_seconds(n, p),
                                   observe_prefill=lambda *a: cost.observe_prefill(*a))  # fmt: skip
        layers, heads, head_dim = self.kv_geometry
        self.bytes_per_token = 2 * layers * heads * head_dim * hf.model_dtype(model).itemsize
        env = load_settings()
        kv_queue = kv_queue if kv_queue is not None else env.kv_queue if env.kv_queue is not None else DEFAULT_QUEUE
        self.memory = KVMemory(kv_memory or env.kv_memory or default_limit(model.device), kv_queue, make_room=self.buffers.clear)
        self.prefixes = SharedPrefixes()
        self.share_prefixes = share_prefixes
        self.progress = progress  # progress bar on store_kv (None: CACHEGEN_PROGRESS, else on a terminal)
        self.metrics_recorder = MetricsRecorder()
        self.partial_step = partial_step
        self.blend = blend_config(blend)
        self.documents = DocumentCaches(self, self.blend) if self.blend is not None else None
        self.profile_fitter: Any = None  # fits a profile in the background (``profiles.py``; set by from_pretrained)
        self.prober.after_build()  # each raw form's copy on the model's device
        openmp.release()  # the building thread's OpenMP threads (loading the model) would slow the scheduler's steps

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
        return self.compute_kv(self._ids(context))

    def compute_kv(self, ids: Sequence[int]) -> KVCache:
        """The KV of ``ids`` computed by the scheduler into a buffer of its own (``calculate_kv`` without the checks)."""
        layers, heads, head_dim = self.kv_geometry
        shape, dtype = (layers, heads, len(ids), head_dim), hf.model_dtype(self.model)
        kv = KVCache(torch.empty(shape, dtype=dtype, device=self.model.device), torch.empty(shape, dtype=dtype, device=self.model.device))
        self._prefill(list(ids), kv, 0)
        return kv

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
        new_tokens = int(generation_kwargs.get("max_new_tokens", hf.DEFAULT_MAX_NEW_TOKENS))
        ids = self._ids(prompt, new_tokens)
        covered = min(kv.num_tokens if kv is not None else 0, len(ids) - 1)
        batch = Batch(self, [ids], generation_kwargs, share=False)
        with self.writer.busy():
            batch.prepare()
            try:
                r = batch.requests[0]
                if covered:
                    src = kv.slice(0, covered).to(device=r.kv.own.keys.device, dtype=r.kv.own.dtype)  # type: ignore[union-attr]
                    r.kv.slice(0, covered).keys.copy_(src.keys)
                    r.kv.slice(0, covered).values.copy_(src.values)
                r.reused = Reused(max(covered, r.kv.offset), len(ids))
                return batch.generate()[0].text
            finally:
                batch.release()

    # ------------------------------------------------------------ whole requests
    def generate(self, prompt: str | Sequence[int], *, streamer: Any = None, cancel: threading.Event | None = None,
                 **generation_kwargs: Any) -> tuple[str, GenerationInfo]:  # fmt: skip
        """Answer ``prompt``, reusing its longest cached run of leading chunks (and partial chunk) and, for a
        :class:`SegmentedPrompt`, its documents' caches wherever they land; returns (text, info).

        ``generation_kwargs`` are transformers' generation settings (``max_new_tokens``, ``do_sample``,
        ``temperature``...), plus ``stop``: a list of strings after which generation stops (the text is returned
        whole; callers cut it), and ``seed`` (this request's random generator). Setting ``cancel`` (from any
        thread) stops generation after the token being computed, ``finish_reason`` ``"cancelled"``. Requests from
        other threads run batched with it.
        """
        return self._answer([prompt], generation_kwargs, streamer=streamer, cancel=cancel)[0]

    def generate_many(self, prompts: Sequence[str | Sequence[int]], *, cancel: threading.Event | None = None,
                      **generation_kwargs: Any) -> list[tuple[str, GenerationInfo]]:  # fmt: skip
        """Answer several prompts that arrived together: their cached chunks are streamed as one batch and they are
        generated together.

        A chunk shared by several prompts is fetched and decoded once (and its KV held once when they start with
        it), and the controller plans with the bytes of the whole batch against the SLO.
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
        batch = Batch(self, [prompt], {"max_new_tokens": 0}, share=False, generating=False)
        with self.writer.busy():
            try:
                batch.prepare()
                batch.reuse()
                r = batch.requests[0]
                if r.filled < len(r.ids):
                    self._prefill(r.ids[r.filled :], r.kv, r.filled)
                r.kv.holder.lent = True  # the caller keeps it: not a buffer for the next request
                return r.kv.own.slice(0, len(r.ids)), r.info
            finally:
                batch.release()

    def _answer(self, prompts: list[str | Sequence[int]], generation_kwargs: dict[str, Any], streamer: Any = None,
                cancel: threading.Event | None = None) -> list[tuple[str, GenerationInfo]]:  # fmt: skip
        batch = Batch(self, prompts, generation_kwargs, streamer, cancel)
        with self.writer.busy():  # background work waits, or gets the share the schedulers lend it
            try:
                batch.prepare()
                batch.reuse()
                out = batch.finish(batch.generate())
            finally:
                batch.release()
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

    def _prefill(self, ids: list[int], buffer: KVCache | RequestKV, start: int) -> None:
        """KV of ``ids`` computed into ``buffer[start:]`` on top of ``buffer[:start]`` (the text option), by the scheduler
        between its steps (the cost model fed the seconds of the steps that computed it alone)."""
        kv = buffer if isinstance(buffer, RequestKV) else RequestKV(buffer, Held(buffer))
        self.scheduler.run(Job(ids, kv, start))

    def _store_new_chunks(self, chunks: list[Chunk], done: int, buffer: RequestKV, info: GenerationInfo, ids: Sequence[int],
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
        """Wait for queued chunks (and documents, computed in the background after their answers) to be stored; False
        if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.documents is not None and not self.documents.indexer.join(timeout):
            return False
        return self.writer.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float | None = None) -> bool:
        """Store what is queued (up to ``timeout``), stop the writer's thread and free the kept buffers (a
        prompt's KV buffer is 355 MB at 7.7K tokens of the reference model in float32). The store stays open
        (it may be shared). Returns False if chunks were still queued at the timeout (not stored). The
        engine still answers after it, storing new chunks before it returns."""
        if self.profile_fitter is not None:
            self.profile_fitter.stop(timeout)
        self.prober.stop(timeout)
        if self.documents is not None:
            self.documents.indexer.join(timeout)
            self.documents.indexer.stop(timeout)
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
