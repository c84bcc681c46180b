"""The streaming controller: per chunk, a level or text, from the measured bandwidth and a deadline.

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

The drivers that run the choice chunk by chunk are in :mod:`.driver`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

TEXT: Literal["text"] = "text"
#: What a chunk is sent as: a compression level, or its tokens as text.
Option = int | Literal["text"]


@dataclass(frozen=True)
class ChunkCost:
    """What one chunk costs per option: bytes and decode seconds per stored level, tokens for text.

    A level missing from ``sizes`` is not stored for this chunk: the controller never picks it.
    """

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
        size = c.sizes.get(option)
        if size is None:  # not stored for this chunk: never feasible
            return math.inf
        arrived += n_requests * size / bandwidth
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
    ordered = sorted(lv for lv in levels if lv in remaining[0].sizes)  # what this chunk has stored
    if not ordered:
        if not allow_text:
            raise ValueError(f"chunk has none of the levels {sorted(levels)} and text is not allowed")
        return Decision(TEXT, bandwidth, None, True)
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
