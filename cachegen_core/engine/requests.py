"""The request path of an engine: prompts in, answers out (``KVEngine.generate``, ``generate_many``, ``stream``).

A :class:`Batch` is the prompts of one call (one for ``generate``, several for ``generate_many``); each prompt
becomes a :class:`~.serving.request.Request` and goes through, in the caller's thread:

1. **KV.** The longest prefix of its prompt already held by a running request (or by an earlier prompt of the
   batch) is read in place (``serving/prefixes.py``; a prefix another request is filling is waited for); the rest
   gets a buffer of its own, counted against the engine's KV memory (``serving/memory.py``: a request that does not
   fit waits in a bounded queue);
2. **reuse.** Its stored chunks after that prefix are streamed into its buffer (one stream for the batch, a chunk
   shared by prompts fetched once), its documents come from their caches (``documents/``), and what it holds is
   published for the requests after it;
3. **generation.** A job of the engine's scheduler computes the rest of the prompt and decodes among the other
   running requests (``serving/scheduler.py``); a request whose generation settings need transformers' ``generate``
   (beam search...), or any request of a model the packed forward does not serve, is generated alone between two
   steps, the reason logged once;
4. **after the answer.** New chunks and partial chunks go to the writer, documents not stored to the background
   indexer, the request's figures to the metrics, and its KV is let go (a buffer others still read lives on).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import openmp
from ..keys.chunks import partial_chunks, token_array
from ..keys.segments import document_spans, prefix_ends
from ..stores.base import fetches_on_cpu
from ..streaming import Controller
from .model import hf
from .model.decoding import Decoding, decoding
from .serving.info import GenerationInfo, covered_tokens
from .serving.prefixes import Held, Prefix, RequestKV
from .serving.memory import Grant
from .serving.request import Job, Request, Reused, State

log = logging.getLogger("cachegen_core.engine")
_told: set[str] = set()  # reasons already logged for serving requests one at a time


def _tell(reason: str) -> None:
    if reason not in _told:
        _told.add(reason)
        log.warning("requests are generated one at a time by transformers' generate: %s", reason)


class Batch:
    """The prompts of one call and their requests (see the module doc)."""

    def __init__(self, engine: Any, prompts: Sequence[Any], generation_kwargs: dict[str, Any], streamer: Any = None,
                 cancel: threading.Event | None = None, *, share: bool = True, generating: bool = True) -> None:  # fmt: skip
        self.engine, self.prompts, self.kwargs, self.streamer, self.cancel = engine, list(prompts), generation_kwargs, streamer, cancel
        self.start, self.share = time.perf_counter(), share
        self.new_tokens = int(generation_kwargs.get("max_new_tokens", hf.DEFAULT_MAX_NEW_TOKENS))
        self.ids = [engine._ids(p, self.new_tokens) for p in self.prompts]  # ValueError before anything is held
        self.decodings: list[Decoding | str] = [self._decoding(len(ids)) if generating else "" for ids in self.ids]
        self.requests: list[Request] = []
        self.leaders: dict[int, tuple[int, int]] = {}  # request -> (the batch-mate whose buffer it reads, up to)
        self.stored = 0  # what the store holds of the prompt being prepared (``_shared``)
        self.notes: list[Any] = []

    def _decoding(self, prompt_tokens: int) -> Decoding | str:
        why = self.engine.scheduler.why_not
        if why is None:
            d = decoding(self.engine.model, self.engine.tokenizer, prompt_tokens, self.kwargs)
            why = d if isinstance(d, str) else None
            if why is None:
                return d  # type: ignore[return-value]
        _tell(why)
        return why

    # ------------------------------------------------------------ 1. KV
    def prepare(self) -> None:
        for i, (prompt, ids) in enumerate(zip(self.prompts, self.ids)):
            self.requests.append(self._request(i, prompt, ids))

    def _shareable(self, i: int) -> bool:
        e = self.engine
        return (
            self.share
            and e.share_prefixes
            and not isinstance(self.decodings[i], str)
            and not (e.documents is not None and document_spans(self.prompts[i]))
        )

    def _request(self, i: int, prompt: Any, ids: list[int]) -> Request:
        e = self.engine
        arr = token_array(ids)
        chunks = e._chunk_keys(arr)
        info = GenerationInfo(prompt_tokens=len(ids))
        candidates = prefix_keys(e, arr, chunks) if self._shareable(i) else []
        taken = self._shared(candidates, chunks, arr, info) if candidates else None
        offset = taken[1] if taken else 0
        mate = self._batch_mate(candidates, max(offset, self.stored if candidates else 0))
        if mate is not None:
            if taken:
                taken[0].release()
            j, offset = mate
            taken = (self.requests[j].kv.holder.acquire(), offset)
            self.leaders[i] = (j, offset)
        tokens = len(ids) + self.new_tokens + 1 - offset
        grant = e.memory.admit(tokens * e.bytes_per_token, self.cancel)
        cancelled = grant is None  # cancelled while waiting for memory: it computes nothing
        if cancelled:
            if taken:
                taken[0].release()
            taken, offset, tokens, grant, candidates = None, 0, 1, Grant(e.memory, 0), []
            self.leaders.pop(i, None)
        own = e.buffers.take(tokens)
        holder = Held(own)
        holder.on_free(_freeing(grant, e.buffers, own))
        kv = RequestKV(own, holder, offset, taken[0] if taken else None)
        info.shared_tokens = offset
        r = Request(prompt, ids, [] if cancelled else chunks, info, kv, self.start, candidates=candidates, cancelled=cancelled)
        if candidates and offset == 0:  # it fills its prompt from position 0: requests after it may read it
            r.note = e.prefixes.announce(candidates)
            self.notes.append(r.note)
        return r

    def _shared(self, candidates: list[Prefix], chunks: Sequence[Any], arr: Any, info: GenerationInfo) -> tuple[Held, int] | None:
        """The prefix of this prompt to read from another request's buffer, and where it ends: one at least as long as
        what the store holds of the prompt (waited for when announced), else the longest held ending at a chunk
        boundary before that (the store's chunks after it are streamed); None: none."""
        e = self.engine
        self.stored = _stored_end(e, chunks, arr, GenerationInfo())  # a store request or two (its errors: the stream's)
        taken = e.prefixes.take([c for c in candidates if c[1] >= self.stored], skip=self.notes, cancel=self.cancel)
        if taken is None and self.stored:  # the store holds more: memory only for its leading complete chunks
            taken = e.prefixes.take([(c.key, c.end) for c in chunks if c.end <= self.stored], skip=self.notes, wait=False)
        return taken

    def _batch_mate(self, candidates: list[Prefix], better_than: int) -> tuple[int, int] | None:
        """An earlier prompt of the batch whose buffer will hold a longer prefix of this one than ``better_than``."""
        keys = dict(candidates)
        best = None
        for j, r in enumerate(self.requests):
            if r.kv.offset or not r.candidates:
                continue
            common = max((end for key, end in r.candidates if keys.get(key) == end), default=0)
            if common > max(better_than, best[1] if best else 0):
                best = (j, common)
        return best

    # ------------------------------------------------------------ 2. reuse
    def reuse(self) -> None:
        """Stream every request's stored chunks after its shared prefix (one stream), then its documents; publish."""
        e, requests = self.engine, self.requests
        controller = Controller(tuple(e.stream_options), e.slo_s, e.cost_model.prefill_s_per_token, allow_text=e.allow_text,
                                floor=e.level, serial=fetches_on_cpu(e.store))  # fmt: skip
        streams = [_stream_part(e, r) for r in requests]
        documents = e.documents is not None and any(document_spans(r.prompt) for r in requests)
        defer = len(requests) == 1 and e.slo_s is None and not documents
        streamed = e.reader.stream([(r.ids, chunks, r.kv) for r, (chunks, _) in zip(requests, streams)], [r.info for r in requests],
                                   floor=e.level, controller=controller, estimator=e.estimator, prefill=e._prefill,
                                   partials=[p for _, p in streams], defer_text=defer)  # fmt: skip
        for r, (covered, filled) in zip(requests, streamed):
            r.covered, filled = max(covered, r.kv.offset), max(filled, r.kv.offset)
            r.info.partial_tokens = r.covered % e.chunk_tokens if covered else 0
            r.reused = Reused(filled, len(r.ids))
        if documents:
            reused = e.documents.reuse([r.ids for r in requests], [document_spans(r.prompt) for r in requests], [r.kv.own for r in requests],
                                       [r.filled for r in requests], [r.info for r in requests], controller)  # fmt: skip
            for r, x in zip(requests, reused):
                r.reused = x
        for r in requests:
            if r.note is not None:
                e.prefixes.publish(r.kv.holder, [(k, end) for k, end in r.candidates if end <= r.filled])

    # ------------------------------------------------------------ 3. generation
    def generate(self) -> list[Job]:
        """Each request's job, submitted to the scheduler (the legacy ones generated alone), all waited for."""
        openmp.release()  # this thread's torch work is done until the answer: its OpenMP threads would slow the steps
        jobs: list[Job | None] = [None] * len(self.requests)
        for stage in (False, True):  # requests reading a batch-mate's buffer once it is filled
            for i, (r, d) in enumerate(zip(self.requests, self.decodings)):
                if isinstance(d, str) or (i in self.leaders) is not stage:
                    continue
                if stage:
                    j, upto = self.leaders[i]
                    leader = jobs[j]
                    if self.requests[j].filled < upto and leader is not None:
                        leader.prefilled.wait()
                        if leader.error is not None:
                            raise leader.error
                jobs[i] = self.engine.scheduler.submit(self._job(r, d))
        for i, (r, d) in enumerate(zip(self.requests, self.decodings)):
            if isinstance(d, str):
                jobs[i] = self._alone(r)
        for job in jobs:  # every one ends before any KV is let go, whatever failed
            assert job is not None
            job.done.wait()
        for job in jobs:
            job.wait()  # type: ignore[union-attr]
        return jobs  # type: ignore[return-value]

    def _job(self, r: Request, d: Decoding) -> Job:
        covered = min(r.filled, len(r.ids) - 1)  # at least one token is computed: its logits give the first token
        job = Job(r.ids[covered:], r.kv, covered, d, start=self.start, streamer=self.streamer, cancel=self.cancel, prompt=r.ids)
        note = r.note
        if note is not None:
            e, exact = self.engine, r.reused.exact if r.reused is not None else len(r.ids)
            job.on_prefilled = lambda: (e.prefixes.publish(r.kv.holder, [(k, end) for k, end in r.candidates if end <= exact]),
                                        e.prefixes.settle(note))  # fmt: skip
        r.state = State.PREFILLING
        return job

    def _alone(self, r: Request) -> Job:
        """A request transformers' ``generate`` serves, between two steps of the scheduler."""
        e, covered = self.engine, min(r.filled, len(r.ids) - 1)
        job = Job(r.ids[covered:], r.kv, covered, None, start=self.start, prompt=r.ids)
        with e.scheduler.exclusive():
            if self.cancel is not None and self.cancel.is_set():
                job.finish_reason = "cancelled"
                if self.streamer is not None:
                    self.streamer.end()
            else:
                began = time.perf_counter() - self.start
                out = hf.generate(e.model, e.tokenizer, r.ids, r.kv.own, self.start, self.kwargs, self.streamer, filled=covered, cancel=self.cancel)
                job.text, job.finish_reason, job.stop_sequence, job.ttft_s = out.text, out.finish_reason, out.stop_sequence, out.ttft_s
                job.new, job.computed = [0] * out.new_tokens, out.cache is not None
                if out.ttft_s is not None and r.reused is not None and not r.reused.computed:  # a plain prefill (no blend)
                    e.cost_model.observe_prefill(len(r.ids) - covered, covered, out.ttft_s - began)
        job.done.set()
        return job

    # ------------------------------------------------------------ 4. after the answer
    def finish(self, jobs: list[Job]) -> list[tuple[str, GenerationInfo]]:
        e, out, seen = self.engine, [], set()
        for i, (r, job) in enumerate(zip(self.requests, jobs)):
            info, reused = r.info, r.reused
            assert reused is not None
            covered = min(reused.filled, len(r.ids) - 1)
            info.cached_tokens = max(0, covered - reused.computed)
            if r.covered > reused.filled:  # text chunks left to the generation's pass count as reused, as when streamed
                info.cached_tokens = min(r.covered, len(r.ids) - 1)
            info.recomputed_tokens = len(r.ids) - info.cached_tokens
            info.new_tokens, info.finish_reason, info.stop_sequence = len(job.new), job.finish_reason, job.stop_sequence
            info.ttft_s = job.ttft_s if job.ttft_s is not None else time.perf_counter() - self.start
            if job.computed:  # not cancelled before the prompt was computed: its new chunks are stored
                spans = document_spans(r.prompt)
                queued = e._store_new_chunks(r.chunks, r.covered, r.kv, info, r.ids, reused.exact, spans, prefix_ends(r.prompt))
                if e.documents is not None and reused.missing:
                    queued += e.documents.store(r.ids, reused, info, seen)
                info.tokens_queued = covered_tokens(queued)
                if (info.chunks_queued and not r.kv.own.keys.is_cuda) or reused.missing:  # the writer reads views of it
                    r.kv.holder.lent = True
            info.total_s = time.perf_counter() - self.start
            e.metrics_recorder.record(info, store=repr(e.store), chunk_tokens=e.chunk_tokens, prefill_s_per_token=e.cost_model.prefill_s_per_token,
                                      fetch_counted=i > 0)  # fmt: skip
            r.state = State.FINISHED
            out.append((job.text, info))
        return out

    def release(self) -> None:
        """Let go of every request's KV and of what it announced (also after a failure)."""
        for r in self.requests:
            self.engine.prefixes.settle(r.note)
            r.kv.release()
        openmp.release()  # storing the answer's chunks ran torch ops here: this thread's OpenMP threads go too


def _freeing(grant: Grant, pool: Any, own: Any) -> Any:
    """What a request's buffer does when the last reader lets go: its memory counted back, the buffer to its pool
    (unless the writer still reads views of it); nothing that refers to the engine."""

    def free(held: Held) -> None:
        grant.free()
        if not held.lent:
            pool.give(own)

    return free


def _stored_end(engine: Any, chunks: Sequence[Any], arr: Any, info: GenerationInfo) -> int:
    """Where the store's run of this prompt's leading chunks (and the partial chunk after it) ends, as a stream
    would find it (0: nothing stored)."""
    run = engine.reader.lookup(chunks, engine.level, info, engine.stream_options)
    end = len(run) * engine.chunk_tokens
    if 0 < engine.partial_step < engine.chunk_tokens:
        tail = engine.reader.lookup_partial(engine._partials(arr)(end), engine.level, info, engine.stream_options)
        end = tail[0].end if tail is not None else end
    return end


def prefix_keys(engine: Any, arr: Any, chunks: Sequence[Any]) -> list[Prefix]:
    """The prefixes of a prompt another request may hold: each complete chunk's key and each partial chunk's (every
    ``partial_step`` tokens), ending before its last token (which a request computes itself)."""
    n, out = len(arr), [(c.key, c.end) for c in chunks if c.end < len(arr)]
    if 0 < engine.partial_step < engine.chunk_tokens:
        for start in range(0, n, engine.chunk_tokens):
            out += [(p.key, p.end) for p in partial_chunks(arr, start, chunk_tokens=engine.chunk_tokens, step=engine.partial_step,
                                                            fingerprint=engine.fingerprint, codec_id=engine.codec.codec_id,
                                                            profile_id=engine.codec.profile_id or "") if p.end < n]  # fmt: skip
    return out


def _stream_part(engine: Any, r: Request) -> tuple[list[Any], Any]:
    """The chunks a request streams after its shared prefix, and its partial chunks: after a prefix ending at a chunk
    boundary, the chunks from there on; after one ending inside a chunk, none (its own tokens come next)."""
    offset = r.kv.offset
    if offset % engine.chunk_tokens or r.cancelled:
        return [], None
    chunks = [c for c in r.chunks if c.start >= offset]
    if not 0 < engine.partial_step < engine.chunk_tokens:
        return chunks, None
    more = engine._partials(token_array(r.ids))
    return chunks, (lambda end: more(max(end, offset)))
