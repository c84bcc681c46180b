"""KVEngine: the four operations of CacheGen over a model, a codec and a store.

``calculate_kv`` prefills a context; ``store_kv`` encodes its complete chunks at every
level and puts them in the store; ``get_kv`` fetches and decodes chunks; and
``generate_with_kv`` generates on top of a decoded KV, prefilling only the tokens it
does not cover. ``generate`` ties them together like a prefix cache: the longest run
of leading chunks found in the store is fetched and decoded, the rest of the prompt is
prefilled by the model, and new complete chunks are stored by a background worker, off
the request's path. A store error or a bad blob is logged and the chunk recomputed:
never a crash, never a wrong answer.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .chunks import Chunk, blob_key, chunk_keys
from .codec import KVCodec
from .config import CodecConfig
from .errors import CacheGenError, CacheGenFormatError, StoreError
from .fingerprint import model_fingerprint
from .kv import KVCache
from .profile import Profile
from .stores.base import KVStore
from .streaming import TEXT, ChunkCost, StreamFailure, make_estimator, stream

log = logging.getLogger(__name__)


@dataclass
class GenerationInfo:
    """What one request did: reported by ``generate`` and in LangChain's generation info."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    levels: list[int] = field(default_factory=list)
    bytes_fetched: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0
    chunks_queued: int = 0
    errors: list[str] = field(default_factory=list)
    stream: list[dict[str, Any]] = field(default_factory=list)
    text_chunks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _FirstTokenTimer:
    """A transformers streamer that records when the first generated token appears."""

    def __init__(self, start: float, inner: Any = None) -> None:
        self.start = start
        self.ttft: float | None = None
        self.inner = inner
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True  # generate() first pushes the prompt ids
        elif self.ttft is None:
            self.ttft = time.perf_counter() - self.start
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


class _StopOnText:
    """Stop generation once the decoded new text contains a stop sequence; works with any tokenizer."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_len: int) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.prompt_len = prompt_len
        self.window = 2 * max(len(s) for s in self.stops) + 4  # tokens: a stop can span at most this many

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        new = input_ids[0, self.prompt_len :][-self.window :]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        done = any(s in text for s in self.stops)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class _StoreWorker:
    """Encodes chunks at every level and writes them, in a daemon thread with a bounded queue."""

    def __init__(self, engine: "KVEngine", maxsize: int) -> None:
        self._engine = weakref.proxy(engine)
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.dropped = 0
        self.failed = 0
        self.written = 0
        self._full = False  # dropping chunks since the queue last had room (logged once)
        self._thread = threading.Thread(target=self._run, name="cachegen-store", daemon=True)
        self._thread.start()

    def submit(self, chunk: Chunk, kv: KVCache) -> bool:
        try:
            self.queue.put_nowait((chunk, kv))
            self._full = False
            return True
        except queue.Full:
            self.dropped += 1
            if not self._full:  # once per overload, not per dropped chunk
                log.warning("store queue full (%d chunks): chunk %s not stored (further drops counted in "
                            "store_stats, not logged, until it drains)", self.queue.maxsize, chunk.key[:12])  # fmt: skip
            self._full = True
            return False

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                chunk, kv = item
                self._engine._store_chunk(chunk, kv)
                self.written += 1
            except ReferenceError:
                lost = 1 + self.queue.qsize()
                log.warning("the KVEngine was garbage-collected with %d KV chunk(s) not stored (call flush() first)", lost)
                return
            except StoreError:  # the engine logs a failing store once, not per chunk
                self.failed += 1
            except Exception as e:  # a failed write is reported, never raised into a request
                self.failed += 1
                log.warning("storing chunk failed: %s", e)
            finally:
                self.queue.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk is written (or failed); False on timeout."""
        if timeout is None:
            self.queue.join()
            return True
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


class KVEngine:
    """CacheGen over one Hugging Face causal LM, one ``KVCodec`` and one ``KVStore``.

    ``chunk_tokens``: tokens per stored chunk. ``level``: the finest level fetched on a
    hit (default: the codec's default); without ``slo_s`` every hit uses it.
    ``store_levels``: levels written on a miss (default: all). ``slo_s``: time budget
    for fetching and decoding a prompt's cached chunks; the streaming controller then
    picks, chunk by chunk, ``level`` or a coarser stored level, or sends the chunk as
    text to be prefilled, from the bandwidth measured by ``estimator`` (``"harmonic"``
    or ``"last"``). ``background``: store new chunks in a worker thread (True) or inline
    before returning (False, deterministic for scripts and tests).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        codec: KVCodec | None = None,
        store: KVStore | None = None,
        *,
        chunk_tokens: int = 1536,
        level: int | None = None,
        store_levels: Sequence[int] | None = None,
        background: bool = True,
        queue_size: int = 64,
        add_special_tokens: bool = True,
        slo_s: float | None = None,
        estimator: str = "harmonic",
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.fingerprint = model_fingerprint(model, tokenizer)
        self.codec = codec or KVCodec(fingerprint=self.fingerprint)
        if not self.codec.fingerprint:
            self.codec.fingerprint = self.fingerprint
        if store is None:
            from .stores.disk import DiskCacheStore  # noqa: PLC0415

            store = DiskCacheStore()
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.level = self.codec.config.default_level if level is None else level
        if self.level not in self.codec.levels:
            raise ValueError(f"level {self.level} not in {self.codec.levels}")
        self.store_levels = list(self.codec.levels if store_levels is None else store_levels)
        if self.level not in self.store_levels:
            raise ValueError(f"the fetched level {self.level} must be among store_levels {self.store_levels}")
        self.add_special_tokens = add_special_tokens
        self.slo_s = slo_s
        self.estimator_name = estimator
        self.estimator = make_estimator(estimator)
        # Running measurements the controller plans with (priors until measured).
        self._bytes_per_token: dict[int, float] = {}
        self._decode_s_per_token: dict[int, float] = {}
        self._prefill_s_per_token = 2e-3  # a prior, replaced by the first measurement
        self._prefill_measured = False
        self._lock = threading.Lock()  # one model call at a time
        self._worker = _StoreWorker(self, queue_size) if background else None
        self._store_failing = False
        atexit.register(_flush_at_exit, weakref.ref(self))

    # ------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path_or_model: str | Path | Any,
        *,
        tokenizer: Any = None,
        store: KVStore | None = None,
        profile: Profile | str | Path | None = "auto",
        config: CodecConfig | None = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> "KVEngine":
        """Load a model (local dir, ``.gguf`` file, or the bundled reference model's short name) and build an engine.

        ``profile="auto"`` uses the profile stored beside the model in the user cache
        when there is one for this codec configuration, else chunks carry their own tables.
        """
        if isinstance(path_or_model, (str, Path)):
            from .models import load_model  # noqa: PLC0415

            model, tok = load_model(path_or_model, dtype=dtype)
            tokenizer = tokenizer or tok
        else:
            model = path_or_model
            if tokenizer is None:
                raise ValueError("pass tokenizer= with a model object")
        fp = model_fingerprint(model, tokenizer)
        config = config or CodecConfig()
        if profile == "auto":
            from .profile import find_profile  # noqa: PLC0415

            profile = find_profile(fp, config)
        elif isinstance(profile, (str, Path)):
            profile = Profile.load(profile)
        codec = KVCodec(config, profile, fingerprint=fp)
        return cls(model, tokenizer, codec, store, **kwargs)

    # ------------------------------------------------------------ the four operations
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as the model sees it."""
        return list(self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])

    def _ids(self, context: str | Sequence[int]) -> list[int]:
        ids = self.tokenize(context) if isinstance(context, str) else [int(t) for t in context]
        if not ids:
            raise ValueError("empty context: nothing to compute")
        return ids

    def chunks(self, context: str | Sequence[int]) -> list[Chunk]:
        """The complete chunks of a context, with their store keys."""
        return chunk_keys(
            self._ids(context),
            chunk_tokens=self.chunk_tokens,
            fingerprint=self.fingerprint,
            codec_id=self.codec.codec_id,
            profile_id=self.codec.profile_id or "",
        )

    @torch.no_grad()
    def calculate_kv(self, context: str | Sequence[int]) -> KVCache:
        """Prefill ``context`` with the model and return its KV cache."""
        ids = self._ids(context)
        with self._lock:
            out = self.model(torch.tensor([ids], device=self.model.device), use_cache=True)
        return KVCache.from_dynamic_cache(out.past_key_values)

    def store_kv(self, context: str | Sequence[int]) -> list[str]:
        """Encode every complete chunk of ``context`` at every level, put them; return the chunk ids."""
        chunks = self.chunks(context)
        if not chunks:
            return []
        kv = self.calculate_kv(self._ids(context)[: chunks[-1].end])
        for c in chunks:
            self._store_chunk(c, kv.slice(c.start, c.end))
        return [c.key for c in chunks]

    def get_kv(self, chunk_ids: Sequence[str], level: int | None = None, info: GenerationInfo | None = None) -> KVCache:
        """Fetch and decode chunks (in order) at ``level``; raises ``StoreError`` or ``CacheGenFormatError``."""
        level = self.level if level is None else level
        parts = []
        for key in chunk_ids:
            t0 = time.perf_counter()
            blob = self.store.get(blob_key(key, level))
            t1 = time.perf_counter()
            if blob is None:
                raise StoreError(f"chunk {key[:12]} at level {level} is not in the store")
            parts.append(self._check_fits_model(self.codec.decode(blob), f"chunk {key[:12]}"))
            if info is not None:
                info.fetch_s += t1 - t0
                info.decode_s += time.perf_counter() - t1
                info.bytes_fetched += len(blob)
                info.levels.append(level)
        if not parts:
            raise ValueError("get_kv needs at least one chunk id")
        return KVCache.concat(parts)

    @torch.no_grad()
    def generate_with_kv(self, kv: KVCache | None, prompt: str | Sequence[int], **generation_kwargs: Any) -> str:
        """Generate a continuation of ``prompt`` whose first ``kv.num_tokens`` tokens are covered by ``kv``."""
        text, _ = self._generate_ids(self._ids(prompt), kv, time.perf_counter(), GenerationInfo(), generation_kwargs)
        return text

    # ------------------------------------------------------------ the whole request
    def generate(self, prompt: str | Sequence[int], *, streamer: Any = None, **generation_kwargs: Any) -> tuple[str, GenerationInfo]:
        """Answer ``prompt``, reusing its longest cached run of leading chunks; returns (text, info).

        ``generation_kwargs`` go to transformers' ``generate``, plus ``stop``: a list of
        strings after which generation stops (the text is returned whole; callers cut it).
        """
        start = time.perf_counter()
        info = GenerationInfo()
        ids = self._ids(prompt)
        info.prompt_tokens = len(ids)
        chunks = self.chunks(ids)
        kv = self._fetch_prefix(chunks, ids, info)
        text, cache = self._generate_ids(ids, kv, start, info, generation_kwargs, streamer=streamer)
        self._store_new_chunks(chunks, kv, cache, info)
        info.total_s = time.perf_counter() - start
        return text, info

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """The model's (layers, KV heads, head dim), from its config."""
        cfg = self.model.config
        text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return text.num_hidden_layers, heads, head_dim

    @property
    def cost_model(self) -> dict[str, Any]:
        """What the streaming controller plans with, as measured so far: bytes and decode
        seconds per token for each level fetched, and prefill seconds per token (a 2 ms prior
        until the first prefill is timed)."""
        return {
            "bytes_per_token": dict(self._bytes_per_token),
            "decode_s_per_token": dict(self._decode_s_per_token),
            "prefill_s_per_token": self._prefill_s_per_token,
            "prefill_measured": self._prefill_measured,
        }

    @property
    def stream_levels(self) -> list[int]:
        """Levels the controller may fetch: ``level`` and every coarser stored level."""
        return sorted(lv for lv in self.store_levels if lv >= self.level)

    def _cached_run(self, chunks: list[Chunk], info: GenerationInfo) -> list[Chunk]:
        """The longest run of leading chunks present in the store."""
        run = []
        for c in chunks:
            try:
                if not self.store.contains(blob_key(c.key, self.level)):
                    break
            except StoreError as e:
                self._store_trouble(info, f"store failure, recomputing from chunk {c.index}: {e}")
                break
            self._store_recovered()
            run.append(c)
        return run

    def _cost(self, chunk: Chunk, kv_elements_per_token: int) -> ChunkCost:
        prior_bits = {0: 6.5, 1: 5.0, 2: 4.0, 3: 3.2}
        sizes, decode = {}, {}
        for lv in self.stream_levels:
            per_token = self._bytes_per_token.get(lv, kv_elements_per_token * prior_bits.get(lv, 3.0) / 8)
            sizes[lv] = int(per_token * chunk.num_tokens)
            decode[lv] = self._decode_s_per_token.get(lv, 0.0) * chunk.num_tokens
        return ChunkCost(sizes, decode, chunk.num_tokens)

    def _fetch_prefix(self, chunks: list[Chunk], ids: list[int], info: GenerationInfo) -> KVCache | None:
        """Stream the longest cached run of leading chunks (levels or text under the SLO); stop at a failure."""
        run = self._cached_run(chunks, info)
        parts = self._stream_chunks([(c, ids, [c.key for c in run[: c.index]]) for c in run], info)
        return KVCache.concat(parts) if parts else None

    def _stream_chunks(self, items: list[tuple[Chunk, list[int], list[str]]], info: GenerationInfo) -> list[KVCache]:
        """Stream chunks given as (chunk, prompt ids, keys of its predecessors); returns the parts decoded before any failure."""
        if not items:
            return []
        run = [c for c, _, _ in items]
        layers, heads, head_dim = self.kv_geometry
        elements = 2 * layers * heads * head_dim

        def fetch(key: Any, level: int) -> bytes:
            blob = self.store.get(blob_key(key, level))
            if blob is None:
                raise StoreError(f"chunk {key[:12]} at level {level} is not in the store")
            return blob

        def decode(blob: bytes, i: int, parts: list[KVCache]) -> KVCache:
            t = time.perf_counter()
            kv = self._check_fits_model(self.codec.decode(blob), f"chunk {i}")
            if kv.num_tokens != run[i].num_tokens:
                raise CacheGenFormatError(f"chunk {i} decoded to {kv.num_tokens} tokens, expected {run[i].num_tokens}")
            level = self._level_of(blob)
            self._observe(self._decode_s_per_token, level, (time.perf_counter() - t) / kv.num_tokens)
            self._observe(self._bytes_per_token, level, len(blob) / kv.num_tokens)
            return kv

        position = {c.key: i for i, c in enumerate(run)}

        def prefill(i: int, parts: list[KVCache]) -> KVCache:
            c, ids, before = items[i]
            prior = [parts[position[k]] for k in before]
            return self._prefill(ids[c.start : c.end], KVCache.concat(prior) if prior else None)

        try:
            res = stream(
                [c.key for c in run],
                [self._cost(c, elements) for c in run],
                fetch=fetch,
                decode=decode,
                prefill=prefill,
                levels=self.stream_levels,
                estimator=self.estimator,
                slo_s=self.slo_s,
                prefill_s_per_token=self._prefill_s_per_token,
            )
        except StreamFailure as f:
            kind = "bad blob" if isinstance(f.cause, CacheGenFormatError) else "store failure"
            if isinstance(f.cause, StoreError):
                if "not in the store" not in str(f.cause):
                    self._store_trouble(info, f"{kind} for chunk {f.index}, recomputing from there: {f.cause}")
            else:
                self._report(info, f"{kind} for chunk {f.index}, recomputing from there: {f.cause}")
            res = f.partial
        for tr in res.trace:
            info.stream.append(tr.as_dict())
            info.levels.append(tr.option)  # type: ignore[arg-type]
            info.bytes_fetched += tr.bytes
            info.fetch_s += tr.fetch_s
            info.decode_s += tr.decode_s
            info.text_chunks += tr.option == TEXT
        return res.parts

    def _check_fits_model(self, kv: KVCache, what: str) -> KVCache:
        """``kv`` if its layers, KV heads and head size are the model's, else ``CacheGenFormatError``.

        A blob's checksums and fingerprint say nothing of a forged, well-formed blob of
        another shape; used as is it would crash the concatenation or the model."""
        want = self.kv_geometry
        if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != want:
            raise CacheGenFormatError(f"{what} decoded to KV of shape {kv.shape}, the model's is (layers, kv heads, head dim) = {want}")
        return kv

    @staticmethod
    def _observe(table: dict[int, float], key: int, value: float, weight: float = 0.3) -> None:
        table[key] = value if key not in table else (1 - weight) * table[key] + weight * value

    def _observe_prefill(self, per_token: float) -> None:
        """Running prefill seconds per token: the first measurement replaces the prior."""
        w = 0.3 if self._prefill_measured else 1.0
        self._prefill_s_per_token = (1 - w) * self._prefill_s_per_token + w * per_token
        self._prefill_measured = True

    @staticmethod
    def _level_of(blob: bytes) -> int:
        from .format import read_header  # noqa: PLC0415

        return int(read_header(blob)["level"])

    @torch.no_grad()
    def _prefill(self, ids: list[int], past: KVCache | None) -> KVCache:
        """KV of ``ids`` computed by the model on top of ``past`` (the text option of streaming)."""
        t = time.perf_counter()
        dtype = next(self.model.parameters()).dtype
        cache = past.to(device=self.model.device, dtype=dtype).to_dynamic_cache(self.model.config) if past is not None else None
        with self._lock:
            out = self.model(torch.tensor([ids], device=self.model.device), past_key_values=cache, use_cache=True)
        start = past.num_tokens if past is not None else 0
        kv = KVCache.from_dynamic_cache(out.past_key_values).slice(start)
        self._observe_prefill((time.perf_counter() - t) / len(ids))
        return KVCache(kv.keys.clone(), kv.values.clone())

    def generate_many(self, prompts: Sequence[str | Sequence[int]], **generation_kwargs: Any) -> list[tuple[str, GenerationInfo]]:
        """Answer several prompts that arrived together: their cached chunks are streamed as one batch.

        A chunk shared by several prompts is fetched and decoded once, and the
        controller plans with the bytes of the whole batch against the SLO.
        """
        start = time.perf_counter()
        infos = [GenerationInfo() for _ in prompts]
        all_ids = [self._ids(p) for p in prompts]
        runs = []
        for ids, info in zip(all_ids, infos):
            info.prompt_tokens = len(ids)
            runs.append(self._cached_run(self.chunks(ids), info))
        items, seen = [], set()
        for ids, run in zip(all_ids, runs):
            for c in run:
                if c.key not in seen:
                    seen.add(c.key)
                    items.append((c, ids, [p.key for p in run[: c.index]]))
        batch_info = GenerationInfo()
        parts = self._stream_chunks(items, batch_info)
        decoded = {items[i][0].key: part for i, part in enumerate(parts)}
        option_of = {items[i][0].key: tr["option"] for i, tr in enumerate(batch_info.stream)}
        out = []
        for ids, run, info in zip(all_ids, runs, infos):
            mine = []
            for c in run:
                if c.key not in decoded:
                    break
                mine.append(decoded[c.key])
            info.levels = [option_of[c.key] for c in run[: len(mine)]]
            info.text_chunks = sum(lv == TEXT for lv in info.levels)
            # fetch figures are the batch's: the chunks were streamed once for every prompt
            info.stream, info.errors = batch_info.stream, info.errors + batch_info.errors
            info.bytes_fetched, info.fetch_s, info.decode_s = batch_info.bytes_fetched, batch_info.fetch_s, batch_info.decode_s
            kv = KVCache.concat(mine) if mine else None
            text, cache = self._generate_ids(ids, kv, start, info, generation_kwargs)
            self._store_new_chunks(self.chunks(ids), kv, cache, info)
            info.total_s = time.perf_counter() - start
            out.append((text, info))
        return out

    def _store_new_chunks(self, chunks: list[Chunk], kv: KVCache | None, cache: Any, info: GenerationInfo) -> None:
        """Queue the complete chunks that were computed (not fetched) in this request."""
        done = kv.num_tokens if kv is not None else 0
        full = None
        for c in chunks:
            if c.end > done and cache is not None:
                full = full or KVCache.from_dynamic_cache(cache)
                part = full.slice(c.start, c.end)
                self._queue_chunk(c, KVCache(part.keys.clone(), part.values.clone()), info)

    def _report(self, info: GenerationInfo, msg: str) -> None:
        info.errors.append(msg)
        log.warning(msg)

    def _store_trouble(self, info: GenerationInfo, msg: str) -> None:
        """A store failure: in the request's errors always, in the log once until the store recovers."""
        info.errors.append(msg)
        if not self._store_failing:
            log.warning("%s (further store failures not logged until it recovers)", msg)
        self._store_failing = True

    def _store_recovered(self) -> None:
        if self._store_failing:
            self._store_failing = False
            log.info("store is reachable again")

    def _generate_ids(
        self,
        ids: list[int],
        kv: KVCache | None,
        start: float,
        info: GenerationInfo,
        generation_kwargs: dict[str, Any],
        streamer: Any = None,
    ) -> tuple[str, Any]:
        if kv is not None and kv.num_tokens >= len(ids):
            kv = kv.slice(0, len(ids) - 1)  # generate() needs at least one token to prefill
        covered = kv.num_tokens if kv is not None else 0
        info.cached_tokens = covered
        info.recomputed_tokens = len(ids) - covered
        kwargs = {"max_new_tokens": 64, "do_sample": False}
        kwargs.update(generation_kwargs)
        stops = kwargs.pop("stop", None)
        if stops:
            from transformers import StoppingCriteriaList  # noqa: PLC0415

            criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
            criteria.append(_StopOnText(self.tokenizer, stops, len(ids)))
            kwargs["stopping_criteria"] = criteria
        if kwargs.get("pad_token_id") is None and self.tokenizer.pad_token_id is None:
            kwargs["pad_token_id"] = self.tokenizer.eos_token_id
        timer = _FirstTokenTimer(start, streamer)
        input_ids = torch.tensor([ids], device=self.model.device)
        past = None
        if kv is not None:
            dtype = next(self.model.parameters()).dtype
            past = kv.to(device=self.model.device, dtype=dtype).to_dynamic_cache(self.model.config)
        with self._lock, torch.no_grad():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                past_key_values=past,
                streamer=timer,
                return_dict_in_generate=True,
                **kwargs,
            )
        new = out.sequences[0, len(ids) :]
        info.new_tokens = int(new.numel())
        info.ttft_s = timer.ttft if timer.ttft is not None else time.perf_counter() - start
        if info.recomputed_tokens > 64 and timer.ttft is not None:
            per_token = (timer.ttft - info.fetch_s - info.decode_s) / info.recomputed_tokens
            if per_token > 0:
                self._observe_prefill(per_token)
        return self.tokenizer.decode(new, skip_special_tokens=True), out.past_key_values

    def stream(self, prompt: str | Sequence[int], **generation_kwargs: Any) -> Iterator[str | GenerationInfo]:
        """Yield text pieces as they are generated, then the ``GenerationInfo`` last."""
        from transformers import TextIteratorStreamer  # noqa: PLC0415

        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["text"], result["info"] = self.generate(prompt, streamer=streamer, **generation_kwargs)
            except BaseException as e:  # surfaced in the caller's thread below
                result["error"] = e
                streamer.end()

        thread = threading.Thread(target=run, name="cachegen-generate", daemon=True)
        thread.start()
        for piece in streamer:
            if piece:
                yield piece
        thread.join()
        if "error" in result:
            raise result["error"]
        yield result["info"]

    # ------------------------------------------------------------ storing
    def _queue_chunk(self, chunk: Chunk, kv: KVCache, info: GenerationInfo) -> None:
        if self._worker is None:
            try:
                self._store_chunk(chunk, kv)
                info.chunks_queued += 1
            except StoreError as e:  # logged once by _store_chunk, not per chunk
                info.errors.append(f"storing chunk {chunk.index} failed: {e}")
            except CacheGenError as e:
                self._report(info, f"storing chunk {chunk.index} failed: {e}")
        elif self._worker.submit(chunk, kv):
            info.chunks_queued += 1

    def _store_chunk(self, chunk: Chunk, kv: KVCache) -> None:
        """Encode one chunk at every stored level and write the blobs (finest level last)."""
        items = [(blob_key(chunk.key, lv), self.codec.encode(kv, lv)) for lv in self.store_levels]
        for (_, blob), lv in zip(items, self.store_levels):
            self._observe(self._bytes_per_token, lv, len(blob) / max(chunk.num_tokens, 1))
        try:
            self.store.put_many(items)
            if self._store_failing:
                log.info("store is writable again")
            self._store_failing = False
        except StoreError as e:
            if not self._store_failing:  # log a dead store once, not per chunk
                log.warning("store write failed (further failures not logged until it recovers): %s", e)
            self._store_failing = True
            raise

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued chunks to be stored; False if ``timeout`` passed first."""
        return True if self._worker is None else self._worker.flush(timeout)

    @property
    def store_stats(self) -> dict[str, int]:
        """Chunks written, failed and dropped (queue full) by the background worker."""
        w = self._worker
        return {"written": w.written, "failed": w.failed, "dropped": w.dropped, "queued": w.queue.qsize()} if w else {}


def _flush_at_exit(ref: Callable[[], KVEngine | None]) -> None:
    engine = ref()
    if engine is None or engine._worker is None:
        return
    pending = engine._worker.queue.unfinished_tasks
    if pending and not engine.flush(timeout=60):
        log.warning("exiting with %d KV chunks not yet stored", engine._worker.queue.unfinished_tasks)
