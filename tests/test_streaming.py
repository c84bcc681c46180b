"""The streaming controller, the estimators and the pipelined driver, without a model; then the engine under an SLO."""

import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from cachegen_core.streaming import (
    TEXT,
    ChunkCost,
    HarmonicMeanEstimator,
    LastSampleEstimator,
    StreamFailure,
    choose,
    make_estimator,
    option_seconds,
    stream,
    unique_in_order,
)

LEVELS = [0, 1, 2, 3]
MB = 1_000_000


def costs(n, tokens=1536):
    # level L costs (4 - L) MB; decode 10 ms; text costs tokens * prefill
    return [ChunkCost({lv: (4 - lv) * MB for lv in LEVELS}, {lv: 0.01 for lv in LEVELS}, tokens) for _ in range(n)]


def test_harmonic_mean_maths_and_robustness():
    e = HarmonicMeanEstimator(window=20)
    assert e.estimate() is None
    for bps in (100.0, 200.0, 400.0):
        e.update(int(bps), 1.0)
    assert e.estimate() == pytest.approx(3 / (1 / 100 + 1 / 200 + 1 / 400))
    e = HarmonicMeanEstimator()
    for _ in range(19):
        e.update(100, 1.0)
    e.update(10_000, 1.0)  # one very fast sample
    assert e.estimate() < 106
    last = LastSampleEstimator()
    last.update(100, 1.0)
    last.update(10_000, 1.0)
    assert last.estimate() == 10_000


def test_window_drops_old_samples():
    e = HarmonicMeanEstimator(window=3)
    for bps in (1, 1000, 1000, 1000):
        e.update(bps, 1.0)
    assert e.estimate() == pytest.approx(1000)
    with pytest.raises(ValueError, match="unknown estimator"):
        make_estimator("nope")


def test_first_chunk_medium_and_no_slo_best():
    assert choose(costs(3), levels=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=None, prefill_s_per_token=1e-3).option == 2
    assert choose(costs(3), levels=LEVELS, elapsed_s=0, slo_s=None, bandwidth=1.0, prefill_s_per_token=1e-3).option == 0


def test_degrades_in_order_level_then_text():
    picks = []
    for bw in (100 * MB, 11 * MB, 7 * MB, 4 * MB, 0.5 * MB):
        d = choose(costs(3), levels=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=bw, prefill_s_per_token=1e-4, safety=1.0)
        picks.append(d.option)
    assert picks == [0, 1, 2, 3, TEXT]
    # with prefill too slow as well, nothing is feasible: the fastest option
    d = choose(costs(3), levels=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=0.5 * MB, prefill_s_per_token=1.0)
    assert not d.feasible and d.option == 3


def test_batch_scales_expected_delay():
    one = choose(costs(2), levels=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=10 * MB, prefill_s_per_token=1e-2)
    four = choose(costs(2), levels=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=10 * MB, prefill_s_per_token=1e-2, n_requests=4)
    assert four.option > one.option


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 6),
    bw=st.floats(1e5, 1e10),
    slo=st.floats(0.01, 20),
    elapsed=st.floats(0, 5),
    prefill=st.floats(1e-6, 1e-2),
)
def test_never_picks_a_predicted_miss_when_something_fits(n, bw, slo, elapsed, prefill):
    cs = costs(n)
    d = choose(cs, levels=LEVELS, elapsed_s=elapsed, slo_s=slo, bandwidth=bw, prefill_s_per_token=prefill)
    finishes = {o: elapsed + sum(option_seconds(c, o, bw, prefill) for c in cs) for o in [*LEVELS, TEXT]}
    budget = elapsed + 0.85 * max(slo - elapsed, 0)  # the controller's default safety margin
    if any(f <= budget for f in finishes.values()):
        assert d.feasible and finishes[d.option] <= budget <= slo
        better = [o for o in LEVELS if o < d.option] if d.option != TEXT else LEVELS
        assert all(finishes[o] > budget for o in better)  # the best-quality feasible option
    else:
        assert finishes[d.option] == min(finishes.values())


class FakeLink:
    """A link whose bandwidth follows a trace, one sample per chunk, on a fake clock."""

    def __init__(self, trace_bps):
        self.trace, self.now, self.i = list(trace_bps), 0.0, 0

    def clock(self):
        return self.now

    def fetch(self, key, level):
        nbytes = (4 - level) * MB
        self.now += nbytes / self.trace[min(self.i, len(self.trace) - 1)]
        self.i += 1
        return bytes(nbytes - 1) + bytes([level])  # real size: the estimator measures it


def run_trace(trace, slo, n=8):
    link = FakeLink(trace)
    res = stream(
        list(range(n)),
        costs(n),
        fetch=link.fetch,
        decode=lambda blob, i, parts: blob[-1],
        prefill=lambda i, parts: "text",
        levels=LEVELS,
        estimator=HarmonicMeanEstimator(),
        slo_s=slo,
        prefill_s_per_token=1.0,  # text is never attractive here
        clock=link.clock,
    )
    return res, link.now


def test_meets_a_feasible_slo_on_a_fluctuating_trace():
    trace = [m * MB for m in (10, 8, 12, 9, 11, 7, 10, 9)]  # +-30 % around 10 MB/s
    res, total = run_trace(trace, slo=3.0)  # level 3 throughout would take ~0.85 s, level 0 ~3.4 s
    assert total <= 3.0
    assert any(t.option < 3 for t in res.trace)  # it did not just take the coarsest level
    assert res.trace[0].option == 2 and len(res.parts) == 8
    fixed_best, _ = run_trace(trace, slo=None)
    assert all(p == 0 for p in fixed_best.parts)


def test_link_drop_lowers_the_level():
    res, _ = run_trace([20 * MB] * 3 + [2 * MB] * 5, slo=3.0)
    levels = [t.option for t in res.trace]
    assert max(levels[4:]) >= max(levels[:3]) and levels[-1] == 3


def test_text_fallback_when_the_link_collapses():
    link = FakeLink([50 * MB, 0.01 * MB])
    res = stream(
        list(range(4)), costs(4, tokens=100), fetch=link.fetch, decode=lambda b, i, p: b[-1],
        prefill=lambda i, parts: TEXT, levels=LEVELS, estimator=LastSampleEstimator(), slo_s=1.0,
        prefill_s_per_token=1e-3, clock=link.clock,
    )  # fmt: skip
    assert TEXT in [t.option for t in res.trace] and res.parts[-1] == TEXT


def test_fetch_of_next_chunk_overlaps_decode():
    events, lock = [], threading.Lock()

    def log(e):
        with lock:
            events.append(e)

    def fetch(key, level):
        log(("fetch-start", key))
        time.sleep(0.05)
        log(("fetch-end", key))
        return b"blob"

    def decode(blob, i, parts):
        log(("decode-start", i))
        time.sleep(0.05)
        log(("decode-end", i))
        return i

    res = stream(list(range(3)), costs(3), fetch=fetch, decode=decode, prefill=lambda i, p: i, levels=LEVELS,
                 estimator=HarmonicMeanEstimator())  # fmt: skip
    assert res.parts == [0, 1, 2]
    # chunk 1's fetch started before chunk 0's decode ended
    assert events.index(("fetch-start", 1)) < events.index(("decode-end", 0))


def test_failure_keeps_the_decoded_prefix():
    def fetch(key, level):
        if key == 2:
            raise OSError("store died")
        return b"ok"

    with pytest.raises(StreamFailure) as err:
        stream(list(range(4)), costs(4), fetch=fetch, decode=lambda b, i, p: i, prefill=lambda i, p: i, levels=LEVELS,
               estimator=HarmonicMeanEstimator())  # fmt: skip
    assert err.value.index == 2 and err.value.partial.parts == [0, 1]


def test_unique_in_order_shares_chunks():
    assert unique_in_order([["a", "b", "c"], ["a", "b", "d"], ["a"]]) == ["a", "b", "c", "d"]
