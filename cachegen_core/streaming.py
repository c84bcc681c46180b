"""Streaming KV chunks under a deadline: bandwidth estimation, per-chunk choice of level or text.

Every chunk is stored at several levels. For each chunk still to come, the controller
picks the best-quality option (level 0 first, then coarser levels, then ``"text"``:
send the tokens and let the model prefill them) whose predicted finish still meets the
SLO, assuming the bandwidth estimate holds for the rest of the stream and the rest is
sent at the same option (the rule of the CacheGen paper: it never spends the budget of
later chunks on this one), keeping a margin (``safety``) of the time left for drops
the estimate has not seen yet. The first chunk, before any measurement, uses the medium
level; with no SLO, the best level. If no option can meet the SLO, the one predicted to
finish first. Plain functions over plain data: no model, no store.

``stream`` runs the choice chunk by chunk and overlaps the fetch of chunk i+1 with the
decode of chunk i (one fetch thread), measuring each fetch to update the estimator.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Literal, Mapping, Protocol, Sequence, TypeVar, Union

TEXT: Literal["text"] = "text"
Option = Union[int, Literal["text"]]
T = TypeVar("T")


class Estimator(Protocol):
    """Bandwidth estimate (bytes/s) from measured chunk fetches."""

    def update(self, nbytes: int, seconds: float) -> None: ...

    def estimate(self) -> float | None: ...


class HarmonicMeanEstimator:
    """Harmonic mean of the last ``window`` throughput samples: one fast sample barely moves it."""

    def __init__(self, window: int = 20) -> None:
        self.samples: deque[float] = deque(maxlen=window)

    def update(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.samples.append(nbytes / seconds)

    def estimate(self) -> float | None:
        if not self.samples:
            return None
        return len(self.samples) / sum(1.0 / s for s in self.samples)


class LastSampleEstimator:
    """The original paper's estimator: the throughput of the last chunk."""

    def __init__(self) -> None:
        self.last: float | None = None

    def update(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.last = nbytes / seconds

    def estimate(self) -> float | None:
        return self.last


ESTIMATORS: dict[str, Callable[[], Estimator]] = {"harmonic": HarmonicMeanEstimator, "last": LastSampleEstimator}


def make_estimator(name: str) -> Estimator:
    """``"harmonic"`` (default) or ``"last"``."""
    try:
        return ESTIMATORS[name]()
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; choose from {sorted(ESTIMATORS)}") from None


@dataclass(frozen=True)
class ChunkCost:
    """What one chunk costs per option: bytes and decode seconds per level, tokens for text."""

    sizes: Mapping[int, int]
    decode_s: Mapping[int, float]
    tokens: int


@dataclass(frozen=True)
class Decision:
    """The option chosen for the next chunk, the estimate it used and the finish it predicts."""

    option: Option
    estimate_bps: float | None
    predicted_finish_s: float | None
    feasible: bool


def option_seconds(cost: ChunkCost, option: Option, bandwidth: float, prefill_s_per_token: float, n_requests: int = 1) -> float:
    """Predicted seconds for one chunk: transfer (shared by ``n_requests``) and decode, or prefill for text."""
    if option == TEXT:
        return n_requests * cost.tokens * prefill_s_per_token
    transfer = n_requests * cost.sizes[option] / bandwidth
    return max(transfer, cost.decode_s.get(option, 0.0))  # decode of one chunk overlaps the next fetch


def choose(
    remaining: Sequence[ChunkCost],
    *,
    levels: Sequence[int],
    elapsed_s: float,
    slo_s: float | None,
    bandwidth: float | None,
    prefill_s_per_token: float,
    n_requests: int = 1,
    allow_text: bool = True,
    safety: float = 0.85,
) -> Decision:
    """The option for ``remaining[0]`` (see the module docstring for the rule).

    ``safety``: the plan must fit in this fraction of the time left, a margin for
    bandwidth drops the estimate has not seen yet.
    """
    if not remaining:
        raise ValueError("no chunk left to choose for")
    levels = sorted(levels)
    if slo_s is None:
        return Decision(levels[0], bandwidth, None, True)
    if bandwidth is None or bandwidth <= 0:
        return Decision(levels[len(levels) // 2], bandwidth, None, True)
    options: list[Option] = [*levels, TEXT] if allow_text else list(levels)
    budget = elapsed_s + safety * max(slo_s - elapsed_s, 0.0)
    best: tuple[float, Option] | None = None
    for opt in options:
        finish = elapsed_s + sum(option_seconds(c, opt, bandwidth, prefill_s_per_token, n_requests) for c in remaining)
        if finish <= budget:
            return Decision(opt, bandwidth, finish, True)
        if best is None or finish < best[0]:
            best = (finish, opt)
    assert best is not None
    return Decision(best[1], bandwidth, best[0], False)


@dataclass
class ChunkTrace:
    """What happened to one streamed chunk (reported in generation info)."""

    index: int
    option: Option
    estimate_bps: float | None
    predicted_finish_s: float | None
    bytes: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    throughput_bps: float | None = None

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass
class StreamResult(Generic[T]):
    """Decoded parts in order, the per-chunk trace, and the total time."""

    parts: list[T]
    trace: list[ChunkTrace] = field(default_factory=list)
    seconds: float = 0.0


class StreamFailure(Exception):
    """A fetch or decode failed at chunk ``index``; ``partial`` holds what was decoded before it."""

    def __init__(self, index: int, cause: BaseException, partial: StreamResult) -> None:
        super().__init__(f"chunk {index}: {cause}")
        self.index, self.cause, self.partial = index, cause, partial


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
    """Stream ``keys`` in order, choosing each chunk's option, overlapping fetch i+1 with decode i.

    ``fetch(key, level)`` returns the blob; ``decode(blob, index, parts_so_far)`` and
    ``prefill(index, parts_so_far)`` (the text option) return the part of chunk
    ``index``. A failing fetch or decode raises ``StreamFailure`` with the parts decoded
    before it, so the caller can recompute the rest.
    """
    start = clock()
    result: StreamResult[T] = StreamResult(parts=[])
    if not keys:
        return result

    def timed_fetch(key: Hashable, level: int) -> tuple[bytes, float]:
        t = clock()
        blob = fetch(key, level)
        return blob, clock() - t

    def decide(i: int) -> Decision:
        return choose(
            costs[i:],
            levels=levels,
            elapsed_s=clock() - start,
            slo_s=slo_s,
            bandwidth=estimator.estimate(),
            prefill_s_per_token=prefill_s_per_token,
            n_requests=n_requests,
            safety=safety,
        )

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachegen-fetch") as pool:
        pending: Future | None = None
        decision = decide(0)
        if decision.option != TEXT:
            pending = pool.submit(timed_fetch, keys[0], decision.option)
        for i in range(len(keys)):
            tr = ChunkTrace(i, decision.option, decision.estimate_bps, decision.predicted_finish_s)
            try:
                if decision.option == TEXT:
                    t = clock()
                    part = prefill(i, result.parts)
                    tr.decode_s = clock() - t
                    next_decision = decide(i + 1) if i + 1 < len(keys) else None
                else:
                    assert pending is not None
                    blob, tr.fetch_s = pending.result()
                    tr.bytes = len(blob)
                    estimator.update(len(blob), tr.fetch_s)
                    tr.throughput_bps = len(blob) / tr.fetch_s if tr.fetch_s > 0 else None
                    next_decision = decide(i + 1) if i + 1 < len(keys) else None
                    if next_decision is not None and next_decision.option != TEXT:
                        pending = pool.submit(timed_fetch, keys[i + 1], next_decision.option)  # overlaps the decode below
                    t = clock()
                    part = decode(blob, i, result.parts)
                    tr.decode_s = clock() - t
            except Exception as e:
                result.seconds = clock() - start
                raise StreamFailure(i, e, result) from e
            if decision.option == TEXT and next_decision is not None and next_decision.option != TEXT:
                pending = pool.submit(timed_fetch, keys[i + 1], next_decision.option)
            result.parts.append(part)
            result.trace.append(tr)
            if next_decision is not None:
                decision = next_decision
    result.seconds = clock() - start
    return result


def unique_in_order(requests: Sequence[Sequence[Hashable]]) -> list[Hashable]:
    """The distinct chunk keys of several requests, in order of first appearance (for shared fetches)."""
    seen: dict[Hashable, None] = {}
    for keys in requests:
        for k in keys:
            seen.setdefault(k, None)
    return list(seen)
