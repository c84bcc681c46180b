"""Running the controller over a stream of chunks: fetch chunk i+1 while chunk i decodes.

:func:`stream_chunks` runs the choice chunk by chunk, fetching chunk i+1 in a worker thread
while chunk i decodes on the caller's thread, and feeds each measured fetch to the
estimator; :func:`stream_batch` streams several requests' chunks as one stream, each
distinct chunk fetched and decoded once. Every chunk leaves a :class:`ChunkRecord`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence, Sized
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

from .controller import TEXT, ChunkCost, Controller, Decision, Option, compute_seconds, rank
from .estimators import Estimator, read_fixed_s

C = TypeVar("C", bound=Hashable)
T = TypeVar("T")


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
        return {f.name: getattr(self, f.name) for f in fields(self)}  # flat: no deep copy on a request's path


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
class _Inline:
    """An executor that runs each call as it is submitted, on the calling thread (``overlap=False``)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        f: Future[Any] = Future()
        try:
            f.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001
            f.set_exception(e)
        return f

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def stream_chunks(
    chunk_ids: Sequence[C],
    costs: Sequence[ChunkCost] | Callable[[C], ChunkCost],
    *,
    fetch: Callable[[C, Option], Sized],
    decode: Callable[[Any, C, Option], T],
    on_text: Callable[[C], T],
    controller: Controller,
    estimator: Estimator,
    n_requests: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    overlap: bool = True,
    missing: tuple[type[BaseException], ...] = (),
) -> StreamResult[T]:
    """Stream ``chunk_ids`` in order, choosing each one's option; fetch i+1 overlaps decode i.

    ``costs``: one per chunk, or a function of the chunk read at every decision (so live
    measurements reach the plan). ``fetch(chunk, level)`` runs in one worker thread and
    returns the blob, or anything with its length (e.g. the blob with its checksums verified
    there; raise if it is missing); ``decode(blob, chunk, level)`` and
    ``on_text(chunk)`` (the text option: the caller prefills) run on the calling thread, in
    stream order, each after the previous chunk's has returned, so they may build on it.
    Each fetch's bytes and seconds update ``estimator``; with a ``serial`` controller only the
    first one, the fetch no decode or prefill ran beside: for a store whose fetch is the same
    CPU's work as decoding (memory, local disk), where a fetch timed beside a decode measures the
    contention for the cores, not the store (on 2 cores, a level's decode made the disk store look
    5x slower than it is, and the controller then kept choosing levels over raw chunks). A failing
    fetch, decode or prefill raises :class:`StreamFailure` with the parts decoded before it.
    ``overlap=False``: each fetch runs on the calling thread when planned, for a store whose fetch costs
    nothing (it hands back an object it holds): there a thread's start and hand-offs were the only
    fetch time (0.7 of the 1.5 ms the memory store's 7.5K request spent beside fp16's copies).
    A fetch raising one of ``missing`` (the form is no longer stored: a tiered store evicted a raw
    form before the chunk's level) is not a failure while the chunk has another stored form the
    controller may take: the chunk is planned again without that option.
    """
    ids = list(chunk_ids)
    given: Callable[[int], ChunkCost] = (lambda i: costs(ids[i])) if callable(costs) else (lambda i: costs[i])  # type: ignore[index,arg-type,operator]
    lost: dict[int, set[Option]] = {}  # options a fetch found missing, per stream position

    def cost_of(i: int) -> ChunkCost:
        c = given(i)
        if i not in lost:
            return c
        return ChunkCost({o: n for o, n in c.sizes.items() if o not in lost[i]}, c.decode_s, c.tokens, c.text_s)

    start = clock()
    records: list[ChunkRecord] = []
    parts: list[T] = []

    def plan(i: int, busy_s: float) -> Decision:
        return controller.decide([cost_of(j) for j in range(i, len(ids))], elapsed_s=clock() - start, bandwidth=estimator.estimate(),
                                 n_requests=n_requests, busy_s=busy_s, fixed_s=read_fixed_s(estimator))  # fmt: skip

    def timed_fetch(chunk: C, level: Option) -> tuple[Sized, float]:
        t = clock()
        blob = fetch(chunk, level)
        return blob, clock() - t

    def result() -> StreamResult[T]:
        return StreamResult(list(parts), StreamPlan(tuple(records), clock() - start, controller.slo_s, n_requests))

    if not ids:
        return result()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachegen-fetch") if overlap else _Inline()
    try:
        decision = plan(0, 0.0)
        pending: Future[tuple[Sized, float]] | None = None
        if decision.option != TEXT:
            pending = pool.submit(timed_fetch, ids[0], decision.option)
        for i, chunk in enumerate(ids):
            blob: Sized = b""
            fetch_s = 0.0
            while decision.option != TEXT:
                assert pending is not None
                try:
                    blob, fetch_s = pending.result()
                except missing as e:
                    lost.setdefault(i, set()).add(decision.option)
                    if not _usable(cost_of(i), controller):  # no stored form left: a plain miss from here
                        raise StreamFailure(i, chunk, e, result()) from e
                    decision = plan(i, 0.0)  # the previous chunk is done: nothing is busy
                    pending = pool.submit(timed_fetch, chunk, decision.option) if decision.option != TEXT else None
                    continue
                except Exception as e:
                    raise StreamFailure(i, chunk, e, result()) from e
                if not controller.serial or i == 0:
                    estimator.update(len(blob), fetch_s)
                break
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


def _usable(cost: ChunkCost, controller: Controller) -> bool:
    """Whether ``cost`` names a stored option the controller may take (without a deadline: as fine as its floor)."""
    finest = controller.floor if controller.floor is not None else controller.options[0]
    return any(o in cost.sizes and (controller.slo_s is not None or rank(o) <= rank(finest)) for o in controller.options)


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
    fetch: Callable[[C, Option], Sized],
    decode: Callable[[Any, C, Option], T],
    on_text: Callable[[C], T],
    controller: Controller,
    estimator: Estimator,
    clock: Callable[[], float] = time.perf_counter,
    overlap: bool = True,
    missing: tuple[type[BaseException], ...] = (),
) -> BatchResult[T]:
    """Stream the chunks of requests that arrived together as one stream; a shared chunk goes once.

    The stream is :func:`unique_in_order` of ``requests`` (with prefix-chained chunk
    keys, a chunk's predecessors in its request come before it), so each distinct chunk
    gets one option and is fetched and decoded once, its part handed to every request
    that asked for it. The controller plans over that whole stream: it counts the bytes of
    every request, a shared chunk once, so the expected delay grows with the batch without
    the ``n_requests`` scaling (which stands in for chunks it cannot see, and would count
    these twice); ``plan.n_requests`` records the batch size. Failures raise
    :class:`StreamFailure` whose ``partial`` follows the order of the shared stream; a fetch raising one
    of ``missing`` is planned again without that option (see :func:`stream_chunks`).
    """
    order = unique_in_order(requests)
    cost_of = costs if callable(costs) else costs.__getitem__
    res = stream_chunks(order, cost_of, fetch=fetch, decode=decode, on_text=on_text, controller=controller,
                        estimator=estimator, clock=clock, overlap=overlap, missing=missing)  # fmt: skip
    part_of = dict(zip(order, res.parts))
    plan = StreamPlan(res.plan.records, res.plan.seconds, res.plan.slo_s, len(requests))
    return BatchResult([[part_of[c] for c in chunks] for chunks in requests], plan)
