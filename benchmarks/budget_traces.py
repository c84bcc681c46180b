"""The request traces of ``benchmarks.store_budget`` and their replay against a real store under a budget.

No model here: a :class:`Costs` (fitted from what ``store_budget`` measured) gives every request's time
to first token from what it found in the store. The store is real (``DiskCacheStore``: its tiers and
its eviction decide what is held), its values are blobs of the real forms' sizes divided by
``scale`` and its size limit the budget divided by ``scale``; manifests are real and name the real sizes.

A request does on the store what the engine does on a local store (``engine/chunks/reader.py``, ``writer.py``):
one ``get_many`` for the manifests of its complete chunks (or documents), one for the partial chunks
that may follow them; each unit streamed in the fastest stored form (raw when its manifest names it,
else the level), a form the store lost replaced by the next one; then the units it computed stored
(raw forms with a manifest, then the level with a manifest naming both), and a reused partial chunk
that this request extended stripped of its raw form (``ChunkWriter.supersede``).
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachegen_core.codec.config import CodecConfig
from cachegen_core.errors import CacheGenFormatError, StoreError
from cachegen_core.keys.manifest import Manifest

CHUNK = 1536
STEP = 64
RAW, LEVEL = "raw", CodecConfig().default_level  # the engine's default level (1 until 2026-11-29)
FORMS = (RAW, LEVEL)


@dataclass(frozen=True)
class Costs:
    """Seconds and bytes by tokens, fitted from measurements (``store_budget.measure``)."""

    prefill: tuple[float, float, float]  # T(a, n) = g + alpha (n - a) + beta (n^2 - a^2) / 2: a reused, n in the prompt
    stream: dict[Any, tuple[float, float]]  # form -> (a, b): fetch + decode of a unit = a + b tokens
    size: dict[Any, tuple[float, float]]  # form -> (a, b): blob bytes = a + b tokens
    probe_s: float  # asking the store for a form it lost
    rag: tuple[float, float] = (0.0, 0.0)  # a RAG prompt's TTFT with no document cached, and with all (less their stream)
    fp16_bytes_per_token: int = 0

    def prefill_s(self, a: int, n: int) -> float:
        g, alpha, beta = self.prefill
        return g + alpha * (n - a) + beta * (n * n - a * a) / 2

    def stream_s(self, form: Any, tokens: int) -> float:
        a, b = self.stream[form]
        return a + b * tokens

    def nbytes(self, form: Any, tokens: int) -> int:
        a, b = self.size[form]
        return max(1, round(a + b * tokens))


def key(*parts: object) -> str:
    """A chunk key of the engine's shape (64 hex digits) for a unit of a trace."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=32).hexdigest()


@dataclass(frozen=True)
class Unit:
    """A stored unit: a complete chunk, a partial chunk or a document piece, by its key and tokens."""

    key: str
    tokens: int


@dataclass(frozen=True)
class Request:
    """One request: its complete chunks (or documents), the partial chunks it may reuse after each run end and
    the one it stores, its context and prompt tokens; ``rag``: documents in any order (``units`` are pieces)."""

    units: tuple[Unit, ...]
    context_tokens: int
    prompt_tokens: int
    partials: Callable[[int], list[Unit]] | None = None  # run end (tokens) -> candidates, shortest first
    stores_partial: Unit | None = None
    rag: bool = False
    context: object = None  # which context (or chat) it is, for reports and tests


@dataclass(frozen=True)
class Trace:
    name: str
    requests: list[Request]
    working_set_tokens: int  # tokens whose fp16 KV a perfect cache would hold


def zipf_order(n_items: int, n_requests: int, rng: random.Random) -> list[int]:
    """``n_requests`` draws of items ranked in a random order, item of rank r with probability 1/r (Zipf 1.0)."""
    ranks = list(range(n_items))
    rng.shuffle(ranks)
    weights = [1.0 / (r + 1) for r in range(n_items)]
    return [ranks[i] for i in rng.choices(range(n_items), weights=weights, k=n_requests)]


def _prefix_request(name: object, context: int, question: int) -> Request:
    """A prompt of ``context`` tokens (a multiple of 64) of the context ``name`` and a question under 64 tokens."""
    full = context // CHUNK
    units = tuple(Unit(key(name, i), CHUNK) for i in range(full))
    tail = context - full * CHUNK

    def partials(end: int) -> list[Unit]:
        last = min(end + CHUNK - STEP, (context + question) // STEP * STEP)
        return [Unit(key(name, "p", end, e), e - end) for e in range(end + STEP, last + 1, STEP)]

    stores = Unit(key(name, "p", full * CHUNK, context), tail) if tail else None
    return Request(units, context, context + question, partials, stores, context=name)


def zipf_trace(lengths: Sequence[int], n_requests: int, question: int, seed: int = 0) -> Trace:
    """Distinct contexts of ``lengths`` tokens, requested in Zipf(1.0) order."""
    order = zipf_order(len(lengths), n_requests, random.Random(seed))
    reqs = [_prefix_request(("zipf", c), lengths[c], question) for c in order]
    return Trace("zipf", reqs, sum(lengths))


def chat_trace(n_chats: int, turns: int, first: int, growth: int, question: int, seed: int = 0) -> Trace:
    """``n_chats`` chats whose prompt grows by ``growth`` tokens a turn from ``first``, their turns interleaved at random."""
    rng = random.Random(seed)
    pending = [c for c in range(n_chats) for _ in range(turns)]
    rng.shuffle(pending)
    turn = [0] * n_chats
    reqs = []
    for c in pending:
        reqs.append(_prefix_request(("chat", c), first + turn[c] * growth, question))
        turn[c] += 1
    return Trace("chat", reqs, n_chats * (first + (turns - 1) * growth))


def rag_trace(n_docs: int, doc_tokens: int, per_question: int, n_requests: int, prompt_extra: int, seed: int = 0) -> Trace:
    """Questions over ``per_question`` of ``n_docs`` documents each (Zipf(1.0) popularity, any order)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n_requests):
        docs: list[int] = []
        while len(docs) < per_question:
            d = _zipf_one(n_docs, rng)
            if d not in docs:
                docs.append(d)
        units = tuple(Unit(key("doc", d), doc_tokens) for d in docs)
        context = per_question * doc_tokens
        reqs.append(Request(units, context, context + prompt_extra, rag=True))
    return Trace("rag", reqs, n_docs * doc_tokens)


def _zipf_one(n: int, rng: random.Random) -> int:
    """A document by Zipf(1.0) popularity (ranks in a fixed random order)."""
    order = random.Random(n).sample(range(n), n)
    return order[rng.choices(range(n), weights=[1.0 / (r + 1) for r in range(n)])[0]]


@dataclass
class Tally:
    """What a replay measured."""

    ttft: list[float] = field(default_factory=list)
    hits: int = 0
    context_tokens: int = 0
    reused_tokens: int = 0
    forms: dict[str, int] = field(default_factory=lambda: {str(f): 0 for f in FORMS})
    probes: int = 0
    write_failures: int = 0
    held: list[int] = field(default_factory=list)


class Replay:
    """A trace's requests against ``store``, storing ``forms`` (see the module doc)."""

    def __init__(self, store: Any, forms: Sequence[Any], costs: Costs, scale: float) -> None:
        self.store, self.forms, self.costs, self.scale = store, tuple(forms), costs, scale
        self.real: dict[str, int] = {}  # key -> the real bytes its value stands for
        self._zeros: dict[int, bytes] = {}
        self.tally = Tally()

    def _value(self, real: int) -> bytes:
        n = max(1, math.ceil(real / self.scale))
        return self._zeros.setdefault(n, bytes(n))

    def _manifest(self, data: bytes | None) -> Manifest | None:
        try:
            m = Manifest.from_bytes(data) if data else None
        except CacheGenFormatError:
            return None
        return m if m is not None and any(f in m for f in self.forms) else None

    def _stream(self, unit: Unit, manifest: Manifest) -> Any:
        """The form the unit was streamed in (None: none of them is still stored)."""
        for form in (f for f in self.forms if f in manifest):  # raw first: the fastest on a local store
            if self.store.get(f"{unit.key}-L{form}") is not None:
                return form
            self.tally.probes += 1
        return None

    def _put(self, unit: Unit, stage: Sequence[Any]) -> None:
        blobs = [(f"{unit.key}-L{f}", self.costs.nbytes(f, unit.tokens)) for f in stage]
        stored = self._manifest(self.store.get(f"{unit.key}-M"))
        sizes = {**(dict(stored.sizes) if stored else {}), **{f: self.costs.nbytes(f, unit.tokens) for f in stage}}
        manifest = Manifest(sizes).to_bytes()
        try:
            self.store.put_many([(k, self._value(n)) for k, n in blobs])
            self.store.put(f"{unit.key}-M", manifest)
        except StoreError:  # a blob over the whole budget: the writer logs it, the request was answered anyway
            self.tally.write_failures += 1
            return
        self.real.update(blobs)
        self.real[f"{unit.key}-M"] = len(manifest)

    def _write(self, unit: Unit) -> None:
        for stage in ([f for f in self.forms if f == RAW], [f for f in self.forms if f != RAW]):
            if stage:
                self._put(unit, stage)

    def _drop_raw(self, unit: Unit) -> None:
        m = self._manifest(self.store.get(f"{unit.key}-M"))
        if m is None or RAW not in m or LEVEL not in m:
            return
        self.store.put(f"{unit.key}-M", Manifest({f: n for f, n in m.sizes.items() if f != RAW}).to_bytes())
        self.store.delete(f"{unit.key}-L{RAW}")

    def run(self, req: Request) -> float:
        """One request: its TTFT from the costs, its reads and writes on the store."""
        run = []
        for u, data in zip(req.units, self.store.get_many([f"{u.key}-M" for u in req.units])):
            if (m := self._manifest(data)) is not None:
                run.append((u, m))
            elif not req.rag:  # a prefix: the run ends at the first chunk not stored (documents: any of them)
                break
        partial = None
        if req.partials is not None and (cands := req.partials(sum(u.tokens for u, _ in run))):
            for u, data in reversed(list(zip(cands, self.store.get_many([f"{c.key}-M" for c in cands])))):
                if (m := self._manifest(data)) is not None:  # the longest partial chunk stored extends the run
                    run.append((u, m))
                    partial = u
                    break
        seconds, used, probes = 0.0, [], self.tally.probes
        for u, m in run:
            form = self._stream(u, m)
            if form is None:  # no form of it left: recomputed from here (documents: this one)
                if req.rag:
                    continue
                break
            seconds += self.costs.stream_s(form, u.tokens)
            self.tally.forms[str(form)] += 1
            used.append(u)
        reused = sum(u.tokens for u in used)
        ttft = seconds + (self.tally.probes - probes) * self.costs.probe_s + self._compute_s(req, reused)
        self.tally.ttft.append(ttft)
        self.tally.hits += bool(used)
        self.tally.context_tokens += req.context_tokens
        self.tally.reused_tokens += reused
        for u in req.units:  # what this request computed is stored
            if u not in used:
                self._write(u)
        if req.stores_partial is not None and req.stores_partial not in used:
            self._write(req.stores_partial)
            if partial is not None and partial in used:
                self._drop_raw(partial)  # a reused partial chunk this request extended: its levels only
        return ttft

    def _compute_s(self, req: Request, reused: int) -> float:
        if not req.rag:
            return self.costs.prefill_s(reused, req.prompt_tokens)
        miss, hit = self.costs.rag
        return miss + (hit - miss) * reused / req.context_tokens

    def held(self) -> tuple[int, int]:
        """Real bytes the store holds now, and those of raw forms."""
        keys = list(self.store.keys())
        total = sum(self.real.get(k, 0) for k in keys)
        raw = sum(self.real.get(k, 0) for k in keys if k.endswith(f"-L{RAW}"))
        return total, raw


def summarise(tally: Tally, n_requests: int) -> dict[str, Any]:
    """The row of one replay: hit rates, TTFT statistics, forms streamed."""
    t = sorted(tally.ttft)
    return {
        "requests": n_requests,
        "hit_rate": round(tally.hits / n_requests, 4),
        "token_hit_rate": round(tally.reused_tokens / max(1, tally.context_tokens), 4),
        "mean_ttft_s": round(statistics.fmean(t), 4),
        "p50_ttft_s": round(t[len(t) // 2], 4),
        "p95_ttft_s": round(t[min(len(t) - 1, math.ceil(0.95 * len(t)) - 1)], 4),
        "units_streamed": dict(tally.forms),
        "lost_form_probes": tally.probes,
        "write_failures": tally.write_failures,
    }
