"""The streaming controller: per chunk, a stored form or text, from the measured bandwidth and a deadline.

Every chunk is stored in several forms (*options*): ``"lossless"`` (the KV exactly, in the
model's dtype), ``"raw"`` (the KV as 16-bit floats: exact for 16-bit models), and
compression levels 0, 1, ... (0 = best quality, higher = smaller), in that quality order
(:func:`rank`). Before each chunk the controller (:func:`choose`) picks one of the chunk's
stored options, or ``"text"`` (send the tokens and let the model prefill them on top of the
KV already decoded: exact, its cost is compute, not bytes). Plain functions over plain
data: no model, no store.

Without a deadline (``slo_s=None``) the choice is the option predicted to finish the whole
stream first among those at least as fine as the configured ``floor`` (text, being exact,
always qualifies): each candidate for this chunk is scored by the pipeline's finish when
every later chunk greedily takes the option that frees the two stages soonest, so on a link
fast enough to keep the decoder waiting raw chunks go between compressed ones. Plans are scored at
``safety`` times the estimated bandwidth: a near tie goes to the option with fewer bytes on the
link, whose finish depends less on the estimate (at 1 Gbit/s a raw chunk predicted 8 % sooner
than a level-1 chunk arrived later than it: 0.66 s against 0.58 s for level 1 alone,
``benchmarks.warm_path``).

On a local store (memory, disk) or a Redis server on this host fetching is the work of the cores
that decode, so plans are made ``serial``: a fetch does not overlap a decode (on 2 cores, mixing a
level chunk with a raw one was 17 % slower than plain fp16 bytes on the disk store and 17 % slower
over loopback Redis, the plan having counted on the overlap).

A fetch is planned to take ``fixed_s + bytes / bandwidth`` (``fixed_s``: what every read costs whatever its size, fitted
by the engine's estimator on a store on this host, ``estimators.py``): the fixed cost is paid once per read by every
stored form alike, so it never makes a big raw form look slow, and it makes a stored form dearer against text.

With a deadline:

decision rule, after the CacheGen paper (SIGCOMM'24, section 5.3): try the options in
quality order (:func:`rank`, then text) and take the first whose predicted finish
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
link and costs the chunk's ``text_s`` (its prefill at its position), else ``tokens * prefill_s_per_token``. Each chunk stands for ``n_requests`` like
chunks of a batch sharing the link and the GPU, so every cost scales with it. The plan must
fit in ``safety`` of the time left, a margin for drops the estimate has not seen. With no
option fitting, the one predicted to finish first (which meets the SLO if any option does).
The first chunk, before any measurement, uses the medium option; with no SLO, the floor, or on
a local store (``serial``) the fastest option planned at ``LOCAL_BANDWIDTH_PRIOR`` (a memory or
disk read is not the slow part: the floor level there cost the first warm request of the demo
0.07 s more than raw bytes).

The drivers that run the choice chunk by chunk are in :mod:`.driver`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

TEXT: Literal["text"] = "text"
RAW: Literal["raw"] = "raw"
LOSSLESS: Literal["lossless"] = "lossless"
#: What a chunk is sent as: a stored form (a compression level, ``"raw"``, ``"lossless"``) or its tokens as text.
Option = int | Literal["raw", "lossless", "text"]
#: Bytes per second a local store (memory, disk) is assumed to read at before its first fetch is measured.
LOCAL_BANDWIDTH_PRIOR = 1e9
#: The stored forms that are not compression levels, finest first.
RAW_OPTIONS: tuple[str, ...] = (LOSSLESS, RAW)


def rank(option: Option) -> int:
    """Quality rank of a stored option: lower is finer (lossless -2, raw -1, level n is n)."""
    if option == LOSSLESS:
        return -2
    if option == RAW:
        return -1
    if isinstance(option, int) and not isinstance(option, bool) and option >= 0:
        return option
    raise ValueError(f"not a stored option: {option!r}")


@dataclass(frozen=True)
class ChunkCost:
    """What one chunk costs per option: bytes and decode seconds per stored level, tokens for text.

    A level missing from ``sizes`` is not stored for this chunk: the controller never picks it.
    ``text_s``: the seconds recomputing the chunk costs at its position in the prompt (a chunk late in a
    long prompt costs more: attention); None: ``tokens`` at the controller's ``prefill_s_per_token``.
    """

    sizes: Mapping[Option, int]
    decode_s: Mapping[Option, float]
    tokens: int
    text_s: float | None = None


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
    """Expected decode seconds of one chunk in a stored form, or prefill seconds for text (``cost.text_s``
    when known, else ``tokens * prefill_s_per_token``)."""
    if option == TEXT:
        return n_requests * (cost.tokens * prefill_s_per_token if cost.text_s is None else cost.text_s)
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
    serial: bool = False,
    fixed_s: float = 0.0,
) -> float:
    """When (seconds from the stream's start) every remaining chunk is ready if all go at ``option``.

    Two-stage pipeline: fetches back to back on the link, each decode once its chunk
    has arrived and the compute stage is free (it is busy for ``busy_s`` from now).
    ``serial``: fetching is the same CPU's work as decoding (a local store), so they take turns.
    ``fixed_s``: the seconds each read costs on top of its bytes at ``bandwidth``.
    """
    ready = elapsed_s + busy_s
    if option == TEXT:
        return ready + sum(compute_seconds(c, TEXT, prefill_s_per_token, n_requests) for c in remaining)
    arrived = elapsed_s
    for c in remaining:
        size = c.sizes.get(option)
        if size is None:  # not stored for this chunk: never feasible
            return math.inf
        arrived = (max(arrived, ready) if serial else arrived) + n_requests * (fixed_s + size / bandwidth)
        ready = max(ready, arrived) + compute_seconds(c, option, prefill_s_per_token, n_requests)
    return ready


def choose(
    remaining: Sequence[ChunkCost],
    *,
    options: Sequence[Option],
    elapsed_s: float,
    slo_s: float | None,
    bandwidth: float | None,
    prefill_s_per_token: float,
    n_requests: int = 1,
    busy_s: float = 0.0,
    allow_text: bool = True,
    safety: float = 0.85,
    floor: Option | None = None,
    serial: bool = False,
    fixed_s: float = 0.0,
) -> Decision:
    """The option for ``remaining[0]`` (the rules are in the module docstring).

    ``options``: the stored options the controller may fetch (a chunk lacking one in its
    ``sizes`` never gets it). ``bandwidth``: the estimate in bytes/s (``None`` before any
    fetch). ``safety``: with ``slo_s``, the plan must fit in this fraction of the time left; without,
    plans are scored at this fraction of ``bandwidth``.
    ``floor``: without ``slo_s``, the coarsest acceptable option (default: the finest of ``options``).
    ``serial``: fetching takes the CPU that decodes (a local store): no fetch overlaps a decode in the plans.
    ``fixed_s``: the seconds every read costs on top of its bytes at ``bandwidth`` (the estimator's).
    """
    if not remaining:
        raise ValueError("no chunk left to choose for")
    if not options:
        raise ValueError("no option to choose from")
    ordered = sorted((o for o in options if o in remaining[0].sizes), key=rank)  # what this chunk has stored
    if not ordered:
        if not allow_text:
            raise ValueError(f"chunk has none of the options {sorted(options, key=rank)} and text is not allowed")
        return Decision(TEXT, bandwidth, None, True)
    if slo_s is None:
        bound = rank(floor) if floor is not None else min(rank(o) for o in options)
        good = [o for o in sorted(options, key=rank) if rank(o) <= bound]
        if (bandwidth is None or bandwidth <= 0) and serial:
            bandwidth = LOCAL_BANDWIDTH_PRIOR
        if bandwidth is None or bandwidth <= 0:  # nothing measured yet: the floor itself, or the finest there is
            first = floor if floor in ordered else next((o for o in ordered if rank(o) <= bound), None)
            return Decision(first if first is not None else TEXT, bandwidth, None, True)
        return _fastest(remaining, good, elapsed_s=elapsed_s, bandwidth=safety * bandwidth, busy_s=busy_s, fixed_s=fixed_s,
                        prefill_s_per_token=prefill_s_per_token, n_requests=n_requests, allow_text=allow_text, serial=serial)  # fmt: skip
    if bandwidth is None or bandwidth <= 0:
        return Decision(ordered[len(ordered) // 2], bandwidth, None, True)

    def finish(opt: Option) -> float:
        return predict_finish(remaining, opt, elapsed_s=elapsed_s, bandwidth=bandwidth, busy_s=busy_s, fixed_s=fixed_s,
                              prefill_s_per_token=prefill_s_per_token, n_requests=n_requests, serial=serial)  # fmt: skip

    budget = elapsed_s + safety * max(slo_s - elapsed_s, 0.0)
    text_finish = finish(TEXT) if allow_text else math.inf
    fastest: tuple[float, Option] | None = None
    for opt in ordered:
        f = finish(opt)
        if f <= budget:
            if text_finish < f:  # text is exact: a stored form that would finish later is dominated
                return Decision(TEXT, bandwidth, text_finish, True)
            return Decision(opt, bandwidth, f, True)
        if fastest is None or f < fastest[0]:
            fastest = (f, opt)
    assert fastest is not None
    if text_finish <= budget or text_finish < fastest[0]:  # inf when text is not allowed
        return Decision(TEXT, bandwidth, text_finish, text_finish <= budget)
    return Decision(fastest[1], bandwidth, fastest[0], False)


def _fastest(
    remaining: Sequence[ChunkCost],
    good: Sequence[Option],
    *,
    elapsed_s: float,
    bandwidth: float,
    busy_s: float,
    prefill_s_per_token: float,
    n_requests: int,
    allow_text: bool,
    serial: bool = False,
    fixed_s: float = 0.0,
) -> Decision:
    """No deadline: the candidate for ``remaining[0]`` whose greedy plan of the rest finishes first
    (ties go to the finer option)."""

    def place(c: ChunkCost, o: Option, link: float, compute: float) -> tuple[float, float]:
        if o == TEXT:
            return link, compute + compute_seconds(c, TEXT, prefill_s_per_token, n_requests)
        arrived = (max(link, compute) if serial else link) + n_requests * (fixed_s + c.sizes[o] / bandwidth)
        return arrived, max(compute, arrived) + compute_seconds(c, o, prefill_s_per_token, n_requests)

    def candidates(c: ChunkCost) -> list[Option]:
        return [o for o in good if o in c.sizes] + ([TEXT] if allow_text else [])

    best: tuple[float, Option] | None = None
    for first in candidates(remaining[0]):
        link, compute = place(remaining[0], first, elapsed_s, elapsed_s + busy_s)
        for c in remaining[1:]:
            steps = [place(c, o, link, compute) for o in candidates(c)]
            if not steps:
                link = compute = math.inf
                break
            link, compute = min(steps, key=lambda lc: (max(lc), lc[1]))
        if best is None or compute < best[0]:
            best = (compute, first)
    if best is None:  # nothing this chunk has is fine enough, and text is not allowed
        raise ValueError("no option at least as fine as the floor is stored for this chunk")
    return Decision(best[1], bandwidth, best[0], True)


@dataclass(frozen=True)
class Controller:
    """The controller's settings: the stored ``options`` it may fetch, ``slo_s`` (None: the fastest
    option at least as fine as ``floor``, default the finest option), the expected prefill
    seconds per token (the cost of text), whether text is allowed, the ``safety``
    fraction of the time left a plan may use, and whether fetching is ``serial`` with decoding
    (a local store: a file read or a copy by the same cores)."""

    options: tuple[Option, ...]
    slo_s: float | None = None
    prefill_s_per_token: float = 1e-3
    allow_text: bool = True
    safety: float = 0.85
    floor: Option | None = None
    serial: bool = False

    def __post_init__(self) -> None:
        if not self.options:
            raise ValueError("no option to choose from")
        if not 0 < self.safety <= 1:
            raise ValueError("safety must be in (0, 1]")
        object.__setattr__(self, "options", tuple(sorted(self.options, key=rank)))
        if self.floor is not None:
            rank(self.floor)

    def decide(
        self,
        remaining: Sequence[ChunkCost],
        *,
        elapsed_s: float,
        bandwidth: float | None,
        n_requests: int = 1,
        busy_s: float = 0.0,
        fixed_s: float = 0.0,
    ) -> Decision:
        """:func:`choose` with these settings (``fixed_s``: a read's fixed seconds, the estimator's)."""
        return choose(remaining, options=self.options, elapsed_s=elapsed_s, slo_s=self.slo_s, bandwidth=bandwidth,
                      prefill_s_per_token=self.prefill_s_per_token, n_requests=n_requests, busy_s=busy_s,
                      allow_text=self.allow_text, safety=self.safety, floor=self.floor, serial=self.serial, fixed_s=fixed_s)  # fmt: skip
