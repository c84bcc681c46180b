"""Streaming KV chunks under a deadline: bandwidth estimation, per-chunk choice of level or text.

Every chunk is stored at several levels (0 = best quality, higher = smaller). Before each
chunk the controller (:func:`choose`) picks an option: a level, or ``"text"`` (send the
tokens and let the model prefill them on top of the KV already decoded; the last resort
in quality, its cost is compute, not bytes). Plain functions over plain data: no model,
no store.

Decision rule, after the CacheGen paper (SIGCOMM'24, section 5.3): try the options in
quality order (levels ascending, then text) and take the first whose predicted finish
*if every remaining chunk were sent at that same option* fits the SLO, the estimated
bandwidth holding for the rest of the stream. Why "the rest at the same option" rather
than "this chunk at the candidate, the rest at whatever still fits": the latter spends the
budget of later chunks on this one, so any estimate error lands on the last chunks with
no slack left; the same-option rule keeps the slack, and because it re-plans before every
chunk, time saved early is spent later (quality rises towards the end of the stream). It is
also self-consistent: if the estimate holds, the option chosen now stays feasible for the
next chunk, so the plan never corners itself into a predicted miss. One exception to the
quality order: text is lossless, so a feasible level predicted to finish *later* than text is
dominated and text is taken instead (on a link so slow that recomputing is faster, the
stream is never slower than recomputing, whatever slack the SLO leaves).

The prediction is a two-stage pipeline, as :func:`stream_chunks` runs it: the link fetches
chunks back to back, the compute stage decodes chunk k once it has arrived and chunk k-1 is
done (``busy_s``: compute already committed, the chunk being decoded now); text needs no
link and costs ``tokens * prefill_s_per_token``. Each chunk stands for ``n_requests`` like
chunks of a batch sharing the link and the GPU, so every cost scales with it. The plan must
fit in ``safety`` of the time left, a margin for drops the estimate has not seen. With no
option fitting, the one predicted to finish first (which meets the SLO if any option does).
The first chunk, before any measurement, uses the medium level; with no SLO, the best level.

:func:`stream_chunks` runs the choice chunk by chunk, fetching chunk i+1 in a worker thread
while chunk i decodes on the caller's thread, and feeds each measured fetch to the
estimator; :func:`stream_batch` streams several requests' chunks as one stream, each
distinct chunk fetched and decoded once.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Generic, Literal, Protocol, TypeVar

TEXT: Literal["text"] = "text"
Option = int | Literal["text"]
C = TypeVar("C", bound=Hashable)
T = TypeVar("T")


# ------------------------------------------------------------------ estimators
class Estimator(Protocol):
    """Bandwidth estimate (bytes/s) from measured chunk fetches; ``None`` before any."""

    def update(self, nbytes: int, seconds: float) -> None: ...

    def estimate(self) -> float | None: ...


class HarmonicMeanEstimator:
    """Harmonic mean of the last ``window`` throughput samples.

    Dominated by the slow samples, so one fast sample (a small blob served from a warm
    buffer) barely moves it, while a drop shows at once: the safe side for a deadline.
    """

    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.samples: deque[float] = deque(maxlen=window)

    def update(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.samples.append(nbytes / seconds)

    def estimate(self) -> float | None:
        if not self.samples:
            return None
        return len(self.samples) / sum(1.0 / s for s in self.samples)


class LastSampleEstimator:
    """The original paper's estimator: the throughput of the last fetch."""

    def __init__(self) -> None:
        self.last: float | None = None

    def update(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.last = nbytes / seconds

    def estimate(self) -> float | None:
        return self.last


ESTIMATORS: dict[str, Callable[[], Estimator]] = {"harmonic": HarmonicMeanEstimator, "last": LastSampleEstimator}


def make_estimator(name: str = "harmonic") -> Estimator:
    """A fresh estimator by name: ``"harmonic"`` (default) or ``"last"``."""
    try:
        return ESTIMATORS[name]()
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; choose from {sorted(ESTIMATORS)}") from None


# ------------------------------------------------------------------ the controller
@dataclass(frozen=True)
class ChunkCost:
    """What one chunk costs per option: bytes and decode seconds per level, tokens for text."""

    sizes: Mapping[int, int]
    decode_s: Mapping[int, float]
    tokens: int


@dataclass(frozen=True)
class Decision:
    """The option chosen for the next chunk, the estimate (bytes/s) it used, the finish it predicts.

    ``predicted_finish_s`` counts from the start of the stream; ``None`` when there was
    nothing to predict with (no estimate yet). ``feasible``: the prediction fits the SLO's
    budget (True too when there is no SLO or no estimate: nothing to check).
    """

    option: Option
    estimate_bps: float | None
    predicted_finish_s: float | None
    feasible: bool


def compute_seconds(cost: ChunkCost, option: Option, prefill_s_per_token: float, n_requests: int = 1) -> float:
    """Expected decode seconds of one chunk at a level, or prefill seconds for text."""
    if option == TEXT:
        return n_requests * cost.tokens * prefill_s_per_token
    return n_requests * cost.decode_s.get(option, 0.0)


def predict_finish(
    remaining: Sequence[ChunkCost],
    option: Option,
    *,
    elapsed_s: float,
    bandwidth: float,
    prefill_s_per_token: float,
    n_requests: int = 1,
    busy_s: float = 0.0,
) -> float:
    """When (seconds from the stream's start) every remaining chunk is ready if all go at ``option``.

    Two-stage pipeline: fetches back to back on the link, each decode once its chunk
    has arrived and the compute stage is free (it is busy for ``busy_s`` from now).
    """
    ready = elapsed_s + busy_s
    if option == TEXT:
        return ready + sum(compute_seconds(c, TEXT, prefill_s_per_token, n_requests) for c in remaining)
    arrived = elapsed_s
    for c in remaining:
        arrived += n_requests * c.sizes[option] / bandwidth
        ready = max(ready, arrived) + compute_seconds(c, option, prefill_s_per_token, n_requests)
    return ready


def choose(
    remaining: Sequence[ChunkCost],
    *,
    levels: Sequence[int],
    elapsed_s: float,
    slo_s: float | None,
    bandwidth: float | None,
    prefill_s_per_token: float,
    n_requests: int = 1,
    busy_s: float = 0.0,
    allow_text: bool = True,
    safety: float = 0.85,
) -> Decision:
    """The option for ``remaining[0]`` (the rule is in the module docstring).

    ``bandwidth``: the estimate in bytes/s (``None`` before any fetch). ``safety``: the
    plan must fit in this fraction of the time left before ``slo_s``.
    """
    if not remaining:
        raise ValueError("no chunk left to choose for")
    if not levels:
        raise ValueError("no level to choose from")
    ordered = sorted(levels)
    if bandwidth is None or bandwidth <= 0:
        option = ordered[0] if slo_s is None else ordered[len(ordered) // 2]
        return Decision(option, bandwidth, None, True)

    def finish(opt: Option) -> float:
        return predict_finish(remaining, opt, elapsed_s=elapsed_s, bandwidth=bandwidth, busy_s=busy_s,
                              prefill_s_per_token=prefill_s_per_token, n_requests=n_requests)  # fmt: skip

    if slo_s is None:
        return Decision(ordered[0], bandwidth, finish(ordered[0]), True)
    budget = elapsed_s + safety * max(slo_s - elapsed_s, 0.0)
    text_finish = finish(TEXT) if allow_text else math.inf
    fastest: tuple[float, Option] | None = None
    for opt in ordered:
        f = finish(opt)
        if f <= budget:
            if text_finish < f:  # text is lossless: a level that would finish later is dominated
                return Decision(TEXT, bandwidth, text_finish, True)
            return Decision(opt, bandwidth, f, True)
        if fastest is None or f < fastest[0]:
            fastest = (f, opt)
    assert fastest is not None
    if text_finish <= budget or text_finish < fastest[0]:  # inf when text is not allowed
        return Decision(TEXT, bandwidth, text_finish, text_finish <= budget)
    return Decision(fastest[1], bandwidth, fastest[0], False)


@dataclass(frozen=True)
class Controller:
    """The controller's settings: stored ``levels``, ``slo_s`` (None: always the best level),
    the expected prefill seconds per token (the cost of text), whether text is allowed, and
    the ``safety`` fraction of the time left a plan may use."""

    levels: tuple[int, ...]
    slo_s: float | None = None
    prefill_s_per_token: float = 1e-3
    allow_text: bool = True
    safety: float = 0.85

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("no level to choose from")
        if not 0 < self.safety <= 1:
            raise ValueError("safety must be in (0, 1]")
        object.__setattr__(self, "levels", tuple(sorted(self.levels)))

    def decide(
        self, remaining: Sequence[ChunkCost], *, elapsed_s: float, bandwidth: float | None, n_requests: int = 1, busy_s: float = 0.0
    ) -> Decision:
        """:func:`choose` with these settings."""
        return choose(remaining, levels=self.levels, elapsed_s=elapsed_s, slo_s=self.slo_s, bandwidth=bandwidth,
                      prefill_s_per_token=self.prefill_s_per_token, n_requests=n_requests, busy_s=busy_s,
                      allow_text=self.allow_text, safety=self.safety)  # fmt: skip


# ------------------------------------------------------------------ trace records
@dataclass(frozen=True)
class ChunkRecord:
    """What happened to one streamed chunk, for generation info.

    ``estimate_bps``: the estimate before the choice; ``throughput_bps``: measured by this
    chunk's fetch, after it (None for text). ``decode_s`` is the prefill time for text.
    """

    index: int
    chunk: Hashable
    option: Option
    estimate_bps: float | None
    predicted_finish_s: float | None
    feasible: bool
    bytes: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    throughput_bps: float | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class StreamPlan:
    """The record of one stream: per-chunk records, total seconds, its SLO and batch size."""

    records: tuple[ChunkRecord, ...] = ()
    seconds: float = 0.0
    slo_s: float | None = None
    n_requests: int = 1

    @property
    def options(self) -> list[Option]:
        return [r.option for r in self.records]

    @property
    def slo_met(self) -> bool | None:
        return None if self.slo_s is None else self.seconds <= self.slo_s

    def as_dict(self) -> dict[str, object]:
        return {"slo_s": self.slo_s, "n_requests": self.n_requests, "seconds": self.seconds,
                "chunks": [r.as_dict() for r in self.records]}  # fmt: skip


@dataclass(frozen=True)
class StreamResult(Generic[T]):
    """Decoded parts in stream order and the plan that produced them."""

    parts: list[T]
    plan: StreamPlan

    @property
    def trace(self) -> tuple[ChunkRecord, ...]:
        return self.plan.records

    @property
    def seconds(self) -> float:
        return self.plan.seconds


@dataclass(frozen=True)
class BatchResult(Generic[T]):
    """Each request's parts in its own order, and the plan of the one shared stream."""

    parts: list[list[T]]
    plan: StreamPlan


class StreamFailure(Exception):
    """A fetch, decode or prefill failed at stream position ``index`` (``chunk``).

    ``partial`` holds what was decoded before it, so the caller can recompute the rest.
    """

    def __init__(self, index: int, chunk: Hashable, cause: BaseException, partial: StreamResult) -> None:
        super().__init__(f"chunk {index}: {cause}")
        self.index, self.chunk, self.cause, self.partial = index, chunk, cause, partial


# ------------------------------------------------------------------ the drivers
def stream_chunks(
    chunk_ids: Sequence[C],
    costs: Sequence[ChunkCost] | Callable[[C], ChunkCost],
    *,
    fetch: Callable[[C, int], bytes],
    decode: Callable[[bytes, C, int], T],
    on_text: Callable[[C], T],
    controller: Controller,
    estimator: Estimator,
    n_requests: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> StreamResult[T]:
    """Stream ``chunk_ids`` in order, choosing each one's option; fetch i+1 overlaps decode i.

    ``costs``: one per chunk, or a function of the chunk read at every decision (so live
    measurements reach the plan). ``fetch(chunk, level)`` runs in one worker thread and
    returns the blob (raise if it is missing); ``decode(blob, chunk, level)`` and
    ``on_text(chunk)`` (the text option: the caller prefills) run on the calling thread, in
    stream order, each after the previous chunk's has returned, so they may build on it.
    Each fetch's bytes and seconds update ``estimator``. A failing fetch, decode or
    prefill raises :class:`StreamFailure` with the parts decoded before it.
    """
    ids = list(chunk_ids)
    cost_of: Callable[[int], ChunkCost] = (lambda i: costs(ids[i])) if callable(costs) else (lambda i: costs[i])  # type: ignore[index,arg-type,operator]
    start = clock()
    records: list[ChunkRecord] = []
    parts: list[T] = []

    def plan(i: int, busy_s: float) -> Decision:
        return controller.decide([cost_of(j) for j in range(i, len(ids))], elapsed_s=clock() - start,
                                 bandwidth=estimator.estimate(), n_requests=n_requests, busy_s=busy_s)  # fmt: skip

    def timed_fetch(chunk: C, level: int) -> tuple[bytes, float]:
        t = clock()
        blob = fetch(chunk, level)
        return blob, clock() - t

    def result() -> StreamResult[T]:
        return StreamResult(list(parts), StreamPlan(tuple(records), clock() - start, controller.slo_s, n_requests))

    if not ids:
        return result()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachegen-fetch")
    try:
        decision = plan(0, 0.0)
        pending: Future[tuple[bytes, float]] | None = None
        if decision.option != TEXT:
            pending = pool.submit(timed_fetch, ids[0], decision.option)
        for i, chunk in enumerate(ids):
            blob, fetch_s = b"", 0.0
            if decision.option != TEXT:
                assert pending is not None
                try:
                    blob, fetch_s = pending.result()
                except Exception as e:
                    raise StreamFailure(i, chunk, e, result()) from e
                estimator.update(len(blob), fetch_s)
            nxt: Decision | None = None
            if i + 1 < len(ids):  # plan and start the next fetch now: it overlaps this chunk's decode or prefill
                nxt = plan(i + 1, compute_seconds(cost_of(i), decision.option, controller.prefill_s_per_token, n_requests))
                pending = pool.submit(timed_fetch, ids[i + 1], nxt.option) if nxt.option != TEXT else None
            t = clock()
            try:
                part = on_text(chunk) if decision.option == TEXT else decode(blob, chunk, decision.option)
            except Exception as e:
                raise StreamFailure(i, chunk, e, result()) from e
            records.append(ChunkRecord(
                i, chunk, decision.option, decision.estimate_bps, decision.predicted_finish_s, decision.feasible,
                len(blob), fetch_s, clock() - t, len(blob) / fetch_s if blob and fetch_s > 0 else None,
            ))  # fmt: skip
            parts.append(part)
            if nxt is not None:
                decision = nxt
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # after a failure, do not wait for an orphan fetch
    return result()


def unique_in_order(requests: Sequence[Sequence[C]]) -> list[C]:
    """The distinct chunks of several requests, in order of first appearance."""
    seen: dict[C, None] = {}
    for chunks in requests:
        for c in chunks:
            seen.setdefault(c, None)
    return list(seen)


def stream_batch(
    requests: Sequence[Sequence[C]],
    costs: Mapping[C, ChunkCost] | Callable[[C], ChunkCost],
    *,
    fetch: Callable[[C, int], bytes],
    decode: Callable[[bytes, C, int], T],
    on_text: Callable[[C], T],
    controller: Controller,
    estimator: Estimator,
    clock: Callable[[], float] = time.perf_counter,
) -> BatchResult[T]:
    """Stream the chunks of requests that arrived together as one stream; a shared chunk goes once.

    The stream is :func:`unique_in_order` of ``requests`` (with prefix-chained chunk
    keys, a chunk's predecessors in its request come before it), so each distinct chunk
    gets one option and is fetched and decoded once, its part handed to every request
    that asked for it. The controller plans over that whole stream: it counts the bytes of
    every request, a shared chunk once, so the expected delay grows with the batch without
    the ``n_requests`` scaling (which stands in for chunks it cannot see, and would count
    these twice); ``plan.n_requests`` records the batch size. Failures raise
    :class:`StreamFailure` whose ``partial`` follows the order of the shared stream.
    """
    order = unique_in_order(requests)
    cost_of = costs if callable(costs) else costs.__getitem__
    res = stream_chunks(order, cost_of, fetch=fetch, decode=decode, on_text=on_text, controller=controller,
                        estimator=estimator, clock=clock)  # fmt: skip
    part_of = dict(zip(order, res.parts))
    plan = StreamPlan(res.plan.records, res.plan.seconds, res.plan.slo_s, len(requests))
    return BatchResult([[part_of[c] for c in chunks] for chunks in requests], plan)


def stream(
    keys: Sequence[Hashable],
    costs: Sequence[ChunkCost],
    *,
    fetch: Callable[[Hashable, int], bytes],
    decode: Callable[[bytes, int, list[T]], T],
    prefill: Callable[[int, list[T]], T],
    levels: Sequence[int],
    estimator: Estimator,
    slo_s: float | None = None,
    prefill_s_per_token: float = 1e-3,
    n_requests: int = 1,
    safety: float = 0.85,
    clock: Callable[[], float] = time.perf_counter,
) -> StreamResult[T]:
    """:func:`stream_chunks` over positions, with ``decode(blob, i, parts_so_far)`` and
    ``prefill(i, parts_so_far)``; the entry point the engine was first written against."""
    done: list[T] = []

    def dec(blob: bytes, i: int, level: int) -> T:
        done.append(decode(blob, i, done))
        return done[-1]

    def text(i: int) -> T:
        done.append(prefill(i, done))
        return done[-1]

    controller = Controller(tuple(levels), slo_s, prefill_s_per_token, safety=safety)
    return stream_chunks(range(len(keys)), costs, fetch=lambda i, level: fetch(keys[i], level), decode=dec,
                         on_text=text, controller=controller, estimator=estimator, n_requests=n_requests, clock=clock)  # fmt: skip
