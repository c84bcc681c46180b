"""The streaming controller, the estimators and the pipelined drivers, without a model or a store."""

import threading
import time
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.throttled_proxy import TRACES, TraceLink, load_traces
from cachegen_core.streaming import (
    LOSSLESS,
    RAW,
    TEXT,
    ChunkCost,
    Controller,
    Decision,
    HarmonicMeanEstimator,
    LastSampleEstimator,
    StreamFailure,
    choose,
    make_estimator,
    predict_finish,
    rank,
    stream_batch,
    stream_chunks,
    unique_in_order,
)

LEVELS = (0, 1, 2, 3)
MB = 1_000_000
RANK = {0: 0, 1: 1, 2: 2, 3: 3, TEXT: 4}  # quality order, best first


def costs(n, tokens=1536, decode_s=0.01):
    """Level L costs (4 - L) MB and ``decode_s``; text costs tokens * prefill."""
    return [ChunkCost({lv: (4 - lv) * MB for lv in LEVELS}, {lv: decode_s for lv in LEVELS}, tokens) for _ in range(n)]


# ------------------------------------------------------------------ estimators
def test_harmonic_mean_exact_values():
    e = HarmonicMeanEstimator()
    assert e.estimate() is None
    for nbytes, seconds in ((100, 1.0), (400, 2.0), (400, 1.0)):  # 100, 200, 400 bytes/s
        e.update(nbytes, seconds)
    assert e.estimate() == pytest.approx(3 / (1 / 100 + 1 / 200 + 1 / 400))  # 171.43
    e.update(0, 1.0)  # empty or instant fetches carry no information
    e.update(10, 0.0)
    assert len(e.samples) == 3


def test_one_fast_sample_barely_moves_the_harmonic_mean_but_sets_the_last():
    h, last = HarmonicMeanEstimator(), LastSampleEstimator()
    for est in (h, last):
        for _ in range(19):
            est.update(100, 1.0)
        est.update(1_000_000, 1.0)  # one sample 10^4 times faster
    assert h.estimate() == pytest.approx(20 / (19 / 100 + 1 / 1_000_000))  # 105.26
    assert h.estimate() < 1.06 * 100
    assert last.estimate() == 1_000_000
    h.update(10, 1.0)  # a slow sample shows at once (the oldest 100 falls out)
    assert h.estimate() == pytest.approx(20 / (18 / 100 + 1 / 1_000_000 + 1 / 10))  # 71.43


def test_window_keeps_the_last_n_samples():
    e = HarmonicMeanEstimator(window=3)
    for bps in (1, 1000, 1000):
        e.update(bps, 1.0)
    assert e.estimate() == pytest.approx(3 / (1 + 2 / 1000))
    e.update(1000, 1.0)  # the slow one falls out
    assert e.estimate() == pytest.approx(1000)
    assert HarmonicMeanEstimator().samples.maxlen == 20
    with pytest.raises(ValueError):
        HarmonicMeanEstimator(window=0)


def test_estimator_factory():
    assert isinstance(make_estimator("harmonic"), HarmonicMeanEstimator)
    assert isinstance(make_estimator("last"), LastSampleEstimator)
    assert make_estimator("harmonic") is not make_estimator("harmonic")
    with pytest.raises(ValueError, match="unknown estimator"):
        make_estimator("nope")


# ------------------------------------------------------------------ prediction and choice
def test_predict_finish_is_a_two_stage_pipeline():
    two = [ChunkCost({0: 10}, {0: 0.5}, 7)] * 2
    kw = dict(elapsed_s=1.0, bandwidth=10.0, prefill_s_per_token=0.1)
    # arrivals at 2 and 3; decodes end at 2.5 and 3.5
    assert predict_finish(two, 0, **kw) == pytest.approx(3.5)
    # decode-bound: the compute stage is busy until 4, then 2 decodes of 2 s
    slow = [ChunkCost({0: 10}, {0: 2.0}, 7)] * 2
    assert predict_finish(slow, 0, busy_s=3.0, **kw) == pytest.approx(8.0)
    # a batch of 3 costs 3x on both stages
    assert predict_finish(two, 0, n_requests=3, **kw) == pytest.approx(1 + 3 + 3 + 1.5)  # arrivals 4, 7; the second decode ends at 8.5
    # text: no link; prefill after the busy compute stage
    assert predict_finish(two, TEXT, busy_s=0.5, **kw) == pytest.approx(1 + 0.5 + 2 * 7 * 0.1)


def test_first_chunk_uses_the_medium_level_and_no_slo_the_floor():
    kw = dict(elapsed_s=0.0, prefill_s_per_token=1e-3)
    assert choose(costs(3), options=[3, 1, 0, 2], slo_s=1.0, bandwidth=None, **kw).option == 2
    assert choose(costs(3), options=[0, 1, 2], slo_s=1.0, bandwidth=None, **kw).option == 1
    assert choose(costs(3), options=LEVELS, slo_s=None, bandwidth=None, **kw).option == 0
    assert choose(costs(3), options=LEVELS, slo_s=None, bandwidth=None, floor=2, **kw).option == 2
    slow = choose(costs(3), options=LEVELS, slo_s=None, bandwidth=1.0, allow_text=False, **kw)  # hopelessly slow, no SLO
    assert slow.option == 0 and slow.predicted_finish_s > 1e6
    # no SLO, but a link that slow: text (exact, 4.6 s) is the fastest option at least as fine as level 0
    assert choose(costs(3), options=LEVELS, slo_s=None, bandwidth=1.0, **kw).option == TEXT


def test_degrades_level_by_level_then_text():
    picks = []
    for bw in (100 * MB, 12 * MB, 9 * MB, 5 * MB, 0.5 * MB):
        d = choose(costs(3), options=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=bw, prefill_s_per_token=2e-4, safety=1.0)
        assert d.feasible and d.predicted_finish_s <= 1.0 and d.estimate_bps == bw
        picks.append(d.option)
    assert picks == [0, 1, 2, 3, TEXT]
    # nothing fits (text too slow as well): the option predicted to finish first
    d = choose(costs(3), options=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=0.5 * MB, prefill_s_per_token=1.0)
    assert not d.feasible and d.option == 3
    # text disallowed: the coarsest level, flagged as a predicted miss
    d = choose(costs(3), options=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=0.5 * MB, prefill_s_per_token=1e-4, allow_text=False)
    assert not d.feasible and d.option == 3


def test_text_wins_over_a_feasible_level_that_would_finish_later():
    # 3 chunks, text 3 * 1536 * 1e-4 = 0.46 s; at 12 MB/s level 1 (3 MB each) takes 0.76 s:
    # both fit the 1 s SLO, text is lossless and sooner, so it is taken
    kw = dict(options=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=12 * MB, safety=1.0)
    d = choose(costs(3), prefill_s_per_token=1e-4, **kw)
    assert d.option == TEXT and d.feasible and d.predicted_finish_s == pytest.approx(3 * 1536 * 1e-4)
    # slower prefill (0.92 s): level 1 finishes first and keeps the pick
    assert choose(costs(3), prefill_s_per_token=2e-4, **kw).option == 1
    # without text, the level
    assert choose(costs(3), prefill_s_per_token=1e-4, allow_text=False, **kw).option == 1
    # no SLO: the fastest option at least as fine as the floor; text is exact, so it qualifies when faster
    assert choose(costs(3), options=LEVELS, elapsed_s=0, slo_s=None, bandwidth=1 * MB, prefill_s_per_token=1e-6).option == TEXT
    assert choose(costs(3), options=LEVELS, elapsed_s=0, slo_s=None, bandwidth=1 * MB, prefill_s_per_token=1e-2).option == 0


def test_batch_size_scales_the_expected_delay():
    kw = dict(options=LEVELS, elapsed_s=0, slo_s=1.0, bandwidth=20 * MB, prefill_s_per_token=1e-2)
    one, four = choose(costs(2), **kw), choose(costs(2), n_requests=4, **kw)
    assert one.option == 0 and RANK[four.option] > RANK[one.option]


def test_safety_margin_and_time_already_spent():
    kw = dict(options=LEVELS, slo_s=1.0, bandwidth=10 * MB, prefill_s_per_token=1.0)
    # two chunks at level 0 take 0.81 s: fits 1.0 s, not 0.75 * 1.0 s; level 1 takes 0.61 s
    assert choose(costs(2), elapsed_s=0, safety=1.0, **kw).option == 0
    assert choose(costs(2), elapsed_s=0, safety=0.75, **kw).option == 1
    # 0.5 s already spent: level 2 (0.41 s) is the best that still fits
    assert choose(costs(2), elapsed_s=0.5, safety=1.0, **kw).option == 2


cost_st = st.builds(
    lambda sizes, dec, tokens: ChunkCost(dict(zip(LEVELS, sorted(sizes, reverse=True))), dict(zip(LEVELS, dec)), tokens),
    st.lists(st.integers(1, 50 * MB), min_size=4, max_size=4),
    st.lists(st.floats(0, 0.5), min_size=4, max_size=4),
    st.integers(1, 4096),
)
situation = dict(
    remaining=st.lists(cost_st, min_size=1, max_size=6),
    bw=st.floats(1e4, 1e10),
    slo=st.floats(0.01, 30),
    elapsed=st.floats(0, 10),
    busy=st.floats(0, 1),
    prefill=st.floats(1e-6, 1e-2),
    n=st.integers(1, 8),
    safety=st.floats(0.5, 1.0),
)


@settings(max_examples=300, deadline=None)
@given(**situation)
def test_never_picks_a_predicted_miss_when_an_option_fits(remaining, bw, slo, elapsed, busy, prefill, n, safety):
    d = choose(remaining, options=LEVELS, elapsed_s=elapsed, slo_s=slo, bandwidth=bw, prefill_s_per_token=prefill,
               n_requests=n, busy_s=busy, safety=safety)  # fmt: skip
    finish = {o: predict_finish(remaining, o, elapsed_s=elapsed, bandwidth=bw, prefill_s_per_token=prefill,
                                n_requests=n, busy_s=busy) for o in RANK}  # fmt: skip
    assert d.predicted_finish_s == finish[d.option]
    if any(f <= slo for f in finish.values()):
        assert finish[d.option] <= slo  # never a predicted miss when something meets the SLO
    budget = elapsed + safety * max(slo - elapsed, 0)
    fits = [o for o in RANK if finish[o] <= budget]
    if fits:  # the best-quality option that fits the budget, unless text fits and finishes sooner (it is lossless)
        best = min(fits, key=RANK.__getitem__)
        assert d.feasible and d.option == (TEXT if finish[TEXT] < finish[best] else best)
    else:
        assert not d.feasible and finish[d.option] == min(finish.values())


@settings(max_examples=200, deadline=None)
@given(**situation, drop=st.floats(0.01, 1.0))
def test_a_slower_link_never_picks_a_finer_level(remaining, bw, slo, elapsed, busy, prefill, n, safety, drop):
    kw = dict(options=LEVELS, elapsed_s=elapsed, slo_s=slo, prefill_s_per_token=prefill, n_requests=n, busy_s=busy, safety=safety)
    fast, slow = choose(remaining, bandwidth=bw, **kw), choose(remaining, bandwidth=bw * drop, **kw)
    if slow.feasible and TEXT not in (fast.option, slow.option):
        assert slow.option >= fast.option
    if fast.option == TEXT and fast.feasible:  # text does not depend on the link: it still fits, so a level
        assert slow.feasible  # replaces it only where that level finishes sooner
        if slow.option != TEXT:
            assert slow.predicted_finish_s <= fast.predicted_finish_s


# ------------------------------------------------------------------ the controller on traces (simulated)
def simulate(cs, controller, estimator, link, n_requests=1):
    """The timeline of ``stream_chunks`` on a fake clock: fetch i+1 is planned and starts when chunk i
    has arrived (or, for text, when its prefill starts), decodes and prefills take what the costs say."""
    main = 0.0  # the caller's thread is free from here
    decision = controller.decide(cs, elapsed_s=0.0, bandwidth=estimator.estimate(), n_requests=n_requests)
    fetch_start, options = 0.0, []
    for i, c in enumerate(cs):
        opt = decision.option
        options.append(opt)
        t = main
        if opt != TEXT:
            nbytes = n_requests * c.sizes[opt]
            arrived = link.finish(fetch_start, nbytes)
            estimator.update(nbytes, arrived - fetch_start)
            t = max(main, arrived)
        busy = n_requests * (c.tokens * controller.prefill_s_per_token if opt == TEXT else c.decode_s[opt])
        if i + 1 < len(cs):
            decision = controller.decide(cs[i + 1 :], elapsed_s=t, bandwidth=estimator.estimate(), n_requests=n_requests, busy_s=busy)
            fetch_start = t
        main = t + busy
    return main, options


def seven_b_chunks(n=10):
    """7B-like chunks of 1536 tokens: 60..25 MB per level, 20 ms decode."""
    return [ChunkCost(dict(zip(LEVELS, (60 * MB, 45 * MB, 35 * MB, 25 * MB))), dict.fromkeys(LEVELS, 0.02), 1536)] * n


SYNTHETIC = [  # Gbit/s per 0.1 s slice
    [5.0, 4.0, 6.0, 3.5, 5.5, 4.5, 6.5, 3.8],
    [3.0, 2.5, 2.0, 2.2, 2.8, 2.4, 2.1, 2.6],
    [8.0, 1.5, 6.0, 2.0, 7.0, 1.8, 5.0, 2.2],
    [2.0] * 8,
]


@pytest.mark.parametrize("estimator", ["harmonic", "last"])
@pytest.mark.parametrize("trace", SYNTHETIC)
def test_meets_a_feasible_slo_on_fluctuating_traces(trace, estimator):
    cs = seven_b_chunks()
    link = TraceLink(trace, slice_s=0.1)
    coarsest = sum(c.sizes[3] for c in cs) / (min(trace) * 1e9 / 8) + 0.02  # the coarsest level at the worst rate
    slo = 1.3 * coarsest
    controller = Controller(LEVELS, slo_s=slo, prefill_s_per_token=1e-3)  # text: 15 s, never attractive
    finish, options = simulate(cs, controller, make_estimator(estimator), link)
    assert finish <= slo, options
    assert options[0] == 2 and TEXT not in options
    assert sum(options) < 3 * len(options)  # it used the slack: not the coarsest level throughout
    # the best level throughout (no SLO, no text: only level 0 is as fine as the floor) misses it
    best_finish, best = simulate(cs, Controller(LEVELS, allow_text=False), make_estimator(estimator), link)
    assert best == [0] * len(cs) and best_finish > finish


@pytest.mark.skipif(not TRACES.exists(), reason="shared bandwidth traces not present")
def test_real_traces_meet_a_slo_that_text_meets():
    """On the real traces, with an SLO that recomputing everything meets, the plan meets it too."""
    cs = seven_b_chunks()
    prefill = 1e-4  # 10K tokens/s: text takes 1.54 s
    text_s = sum(c.tokens for c in cs) * prefill
    for trace in load_traces():
        controller = Controller(LEVELS, slo_s=text_s, prefill_s_per_token=prefill)
        finish, options = simulate(cs, controller, make_estimator("harmonic"), TraceLink(trace, slice_s=0.1))
        assert finish <= text_s, (trace, options)
        assert any(o != TEXT for o in options)


def test_link_drop_degrades_to_lower_levels_then_text():
    cs = seven_b_chunks(20)
    # 10 Gbit/s, then 2, then 0.5: the best level first, a coarser one as the drop shows, then text
    link = TraceLink([10.0] * 3 + [2.0] * 3 + [0.5] * 100, slice_s=0.1)
    # text: 0.18 s per chunk, slower than level 3 at 2 Gbit/s (0.1 s), faster than any level at 0.5 (>= 0.4 s);
    # once text is in use, a text chunk's prefill hides the next chunk's fetch, so the two alternate
    controller = Controller(LEVELS, slo_s=2.0, prefill_s_per_token=1.2e-4)
    finish, options = simulate(cs, controller, make_estimator("harmonic"), link)
    first_use = list(dict.fromkeys(options[1:]))  # after the medium first chunk
    assert [RANK[o] for o in first_use] == sorted(RANK[o] for o in first_use)  # quality only goes down
    assert first_use[0] == 0 and first_use[-1] == TEXT and len(first_use) >= 3  # a coarser level before text
    # the chunk in flight when the link collapses was planned at 2 Gbit/s: the SLO is not always
    # reachable, but the plan is far ahead of staying at the best level
    best_finish, _ = simulate(cs, Controller(LEVELS, allow_text=False), make_estimator("harmonic"), link)
    assert finish < best_finish / 2


# ------------------------------------------------------------------ the pipelined driver
@dataclass(frozen=True)
class Scripted(Controller):
    """A controller that plays a fixed list of options (for driver tests)."""

    script: tuple = ()

    def decide(self, remaining, **kw):
        return Decision(self.script[len(self.script) - len(remaining)], None, None, True)


class FakeLink:
    """Fetches on a fake clock: each one advances it by what ``link`` says. Decode and prefill are free."""

    def __init__(self, link, size_of):
        self.link, self.size_of, self.now, self.calls = link, size_of, 0.0, []

    def clock(self):
        return self.now

    def fetch(self, chunk, level):
        self.calls.append((chunk, level))
        nbytes = self.size_of(chunk, level)
        self.now = self.link.finish(self.now, nbytes)
        return bytes([level]) * nbytes


def test_driver_trace_records_estimates_and_throughput():
    cs = costs(4, tokens=10)
    fake = FakeLink(TraceLink([8 * 8e-3, 4 * 8e-3], slice_s=1000.0), lambda c, lv: cs[c].sizes[lv])  # 8 MB/s
    res = stream_chunks(range(4), cs, fetch=fake.fetch, decode=lambda blob, c, lv: (c, blob[0]), on_text=lambda c: (c, TEXT),
                        controller=Controller(LEVELS, slo_s=60.0, prefill_s_per_token=1.0), estimator=HarmonicMeanEstimator(), clock=fake.clock)  # fmt: skip
    assert res.parts == [(0, 2), (1, 0), (2, 0), (3, 0)]  # medium first, then the best level fits
    r0, r1 = res.trace[:2]
    assert r0.option == 2 and r0.estimate_bps is None and r0.predicted_finish_s is None
    assert r0.bytes == 2 * MB and r0.fetch_s == pytest.approx(0.25) and r0.throughput_bps == pytest.approx(8 * MB)
    assert r1.estimate_bps == pytest.approx(8 * MB) and r1.predicted_finish_s == pytest.approx(0.25 + 3 * 0.5 + 0.01)
    assert res.plan.options == [2, 0, 0, 0] and res.plan.slo_met and res.seconds == pytest.approx(fake.now)
    d = res.plan.as_dict()
    assert d["chunks"][1]["option"] == 0 and d["chunks"][1]["throughput_bps"] == pytest.approx(8 * MB)


def test_driver_degrades_on_a_link_drop_then_sends_text():
    cs = costs(8, tokens=10)
    # 80 MB/s for 0.1 s, then 80 KB/s
    fake = FakeLink(TraceLink([0.64] + [0.00064] * 10_000, slice_s=0.1), lambda c, lv: cs[c].sizes[lv])
    texts = []
    res = stream_chunks(range(8), cs, fetch=fake.fetch, decode=lambda blob, c, lv: lv,
                        on_text=lambda c: texts.append(c) or TEXT,
                        controller=Controller(LEVELS, slo_s=2.0, prefill_s_per_token=1e-3),
                        estimator=LastSampleEstimator(), clock=fake.clock)  # fmt: skip
    options = res.plan.options
    assert options[-1] == TEXT and texts == [i for i, o in enumerate(options) if o == TEXT]
    first_use = list(dict.fromkeys(options[1:]))  # after the medium first chunk
    assert [RANK[o] for o in first_use] == sorted(RANK[o] for o in first_use)
    assert [c for c, _ in fake.calls] == [i for i, o in enumerate(options) if o != TEXT]  # text chunks are not fetched


@pytest.mark.parametrize("serial", [False, True])
def test_only_the_first_fetch_is_sampled_where_fetching_shares_the_cpu(serial):
    cs = costs(4, tokens=10)
    fake = FakeLink(TraceLink([8 * 8e-3], slice_s=1000.0), lambda c, lv: cs[c].sizes[lv])
    samples = []

    class Recording(HarmonicMeanEstimator):
        def update(self, nbytes, seconds):
            samples.append(nbytes)
            super().update(nbytes, seconds)

    res = stream_chunks(range(4), cs, fetch=fake.fetch, decode=lambda blob, c, lv: c, on_text=lambda c: c,
                        controller=Controller(LEVELS, slo_s=60.0, prefill_s_per_token=1.0, serial=serial), estimator=Recording(),
                        clock=fake.clock)  # fmt: skip
    fetched = [r.bytes for r in res.trace]
    assert len(fetched) == 4 and samples == (fetched[:1] if serial else fetched)
    assert all(r.throughput_bps == pytest.approx(8 * MB) for r in res.trace)  # every fetch is still recorded


def test_costs_can_be_read_live():
    seen = []

    def cost_of(chunk):
        seen.append(chunk)
        return costs(1)[0]

    res = stream_chunks(["a", "b", "c"], cost_of, fetch=lambda c, lv: b"x", decode=lambda b, c, lv: c, on_text=lambda c: c,
                        controller=Controller(LEVELS), estimator=HarmonicMeanEstimator())  # fmt: skip
    assert res.parts == ["a", "b", "c"] and seen.count("c") == 3  # one look per decision (and per busy estimate)


def test_fetch_of_the_next_chunk_overlaps_decode_and_prefill():
    """Decode of chunk i waits for fetch i+1 to start: a sequential driver would never get there."""
    started = {i: threading.Event() for i in range(4)}
    threads, overlapped = {}, []

    def fetch(chunk, level):
        threads.setdefault("fetch", threading.current_thread())
        started[chunk].set()
        time.sleep(0.01)
        return b"blob"

    def work(chunk):
        threads.setdefault("decode", threading.current_thread())
        if chunk + 1 in (1, 3):  # the next chunk is fetched (chunk 2 goes as text)
            overlapped.append(started[chunk + 1].wait(timeout=10))
        return chunk

    script = Scripted(LEVELS, script=(0, 1, TEXT, 0))  # chunk 2 is prefilled: fetch 3 overlaps it
    res = stream_chunks(range(4), costs(4), fetch=fetch, decode=lambda b, c, lv: work(c), on_text=work, controller=script,
                        estimator=HarmonicMeanEstimator())  # fmt: skip
    assert res.parts == [0, 1, 2, 3] and res.plan.options[2] == TEXT
    assert overlapped == [True, True] and not started[2].is_set()
    assert threads["decode"] is threading.current_thread() and threads["fetch"] is not threads["decode"]


def test_without_overlap_every_fetch_runs_on_the_calling_thread_in_stream_order():
    """``overlap=False`` (a store whose fetch costs nothing): no fetch thread; the same parts, options and failures."""
    calls = []

    def fetch(chunk, level):
        calls.append(("fetch", chunk, threading.current_thread()))
        if chunk == 3:
            raise OSError("store died")
        return b"blob"

    def decode(blob, chunk, level):
        calls.append(("decode", chunk, threading.current_thread()))
        return chunk

    kw = dict(fetch=fetch, decode=decode, on_text=lambda c: c, estimator=HarmonicMeanEstimator())
    res = stream_chunks(range(3), costs(3), controller=Scripted(LEVELS, script=(0, 1, 0)), overlap=False, **kw)
    assert res.parts == [0, 1, 2] and res.plan.options == [0, 1, 0]
    assert {t for *_, t in calls} == {threading.current_thread()}
    assert [c[:2] for c in calls] == [("fetch", 0), ("fetch", 1), ("decode", 0), ("fetch", 2), ("decode", 1), ("decode", 2)]
    with pytest.raises(StreamFailure) as err:
        stream_chunks(range(4), costs(4), controller=Scripted(LEVELS, script=(0, 0, 0, 0)), overlap=False, **kw)
    assert err.value.index == 3 and err.value.partial.parts == [0, 1, 2]


def test_failures_keep_the_decoded_prefix():
    def fetch(chunk, level):
        if chunk == 2:
            raise OSError("store died")
        return b"ok"

    fetching = Controller(LEVELS, allow_text=False)  # tiny fake blobs measure a slow link: keep every chunk fetched
    kw = dict(decode=lambda b, c, lv: c, on_text=lambda c: c, controller=fetching, estimator=HarmonicMeanEstimator())
    with pytest.raises(StreamFailure) as err:
        stream_chunks([0, 1, 2, 3], costs(4), fetch=fetch, **kw)
    assert err.value.index == 2 and err.value.chunk == 2 and isinstance(err.value.cause, OSError)
    assert err.value.partial.parts == [0, 1] and len(err.value.partial.trace) == 2

    def bad_decode(blob, chunk, level):
        if chunk == "b":
            raise ValueError("corrupt")
        return chunk

    with pytest.raises(StreamFailure) as err:
        stream_chunks(["a", "b", "c"], costs(3), fetch=lambda c, lv: b"ok", **{**kw, "decode": bad_decode})
    assert err.value.index == 1 and err.value.partial.parts == ["a"]


def test_empty_stream():
    res = stream_chunks([], [], fetch=None, decode=None, on_text=None, controller=Controller(LEVELS), estimator=HarmonicMeanEstimator())
    assert res.parts == [] and res.trace == ()


def test_a_level_a_chunk_lacks_is_never_chosen():
    """Chunks list only what is stored for them (the manifest): a missing level is infeasible, not a KeyError."""
    full = costs(1)[0]
    only_coarse = ChunkCost({3: 1 * MB}, {3: 0.01}, 1536)
    d = choose([only_coarse, full], options=LEVELS, elapsed_s=0.0, slo_s=None, bandwidth=100 * MB, prefill_s_per_token=1e-3, floor=3)
    assert d.option == 3
    d = choose([only_coarse, full], options=LEVELS, elapsed_s=0.0, slo_s=None, bandwidth=100 * MB, prefill_s_per_token=1e-3)
    assert d.option == TEXT  # no deadline, and nothing as fine as level 0 stored: recompute rather than degrade
    d = choose([full, only_coarse], options=LEVELS, elapsed_s=0.0, slo_s=10.0, bandwidth=100 * MB, prefill_s_per_token=1e-3)
    assert d.option == 3  # every other level would have to be sent for the second chunk too
    assert predict_finish([full, only_coarse], 0, elapsed_s=0.0, bandwidth=MB, prefill_s_per_token=1e-3) == float("inf")
    nothing = ChunkCost({}, {}, 1536)
    assert choose([nothing], options=LEVELS, elapsed_s=0.0, slo_s=1.0, bandwidth=MB, prefill_s_per_token=1e-3).option == TEXT
    with pytest.raises(ValueError, match="text is not allowed"):
        choose([nothing], options=LEVELS, elapsed_s=0.0, slo_s=1.0, bandwidth=MB, prefill_s_per_token=1e-3, allow_text=False)


def raw_and_levels(n, raw_mb=8.0, raw_decode=0.005, level_decode=0.05):
    """Chunks stored raw (``raw_mb`` MB, nearly free to decode) and at levels 0-3 ((4 - L) MB, ``level_decode`` s)."""
    sizes = {RAW: int(raw_mb * MB), **{lv: (4 - lv) * MB for lv in LEVELS}}
    decode = {RAW: raw_decode, **{lv: level_decode for lv in LEVELS}}
    return [ChunkCost(sizes, decode, 1536) for _ in range(n)]


def test_option_ranks_put_exact_forms_first():
    assert sorted([3, RAW, 0, LOSSLESS, 1], key=rank) == [LOSSLESS, RAW, 0, 1, 3]
    with pytest.raises(ValueError, match="not a stored option"):
        rank(TEXT)
    assert Controller([2, RAW, 0]).options == (RAW, 0, 2)


def test_no_slo_picks_the_fastest_option_at_least_as_fine_as_the_floor():
    kw = dict(options=[RAW, *LEVELS], elapsed_s=0.0, slo_s=None, prefill_s_per_token=1e-2, floor=1)  # text: 15 s a chunk
    fast = choose(raw_and_levels(5), bandwidth=10_000 * MB, **kw)  # a memory store: raw arrives before a level decodes
    assert fast.option == RAW
    slow = choose(raw_and_levels(5), bandwidth=10 * MB, **kw)  # a slow link: the coarsest level allowed (1)
    assert slow.option == 1
    assert choose(raw_and_levels(5), bandwidth=10 * MB, **{**kw, "floor": RAW}).option == RAW  # nothing coarser allowed
    # with a cheap prefill (1.5 s a chunk), computing a chunk while the 10 MB/s link brings the others wins
    assert choose(raw_and_levels(5), bandwidth=10 * MB, **{**kw, "floor": RAW, "prefill_s_per_token": 1e-3}).option == TEXT
    # predictions are of the whole stream: raw everywhere takes 5 * 8 MB / 10 GB/s + 5 ms decode
    assert fast.predicted_finish_s == pytest.approx(5 * 8 * MB / (10_000 * MB) + 5 * 0.005, rel=0.2)


def test_no_slo_near_tie_goes_to_fewer_bytes_on_the_link():
    """Raw predicted 7 % sooner than level 1 at the estimated bandwidth, but not at 85 % of it: the plan is scored
    at ``safety`` times the estimate, so the choice does not hang on the estimate being exact."""
    kw = dict(options=[RAW, *LEVELS], elapsed_s=0.0, slo_s=None, prefill_s_per_token=1.0, floor=1, bandwidth=125 * MB)
    chunk = raw_and_levels(1)  # raw: 8 MB + 5 ms; level 1: 3 MB + 50 ms
    assert choose(chunk, safety=1.0, **kw).option == RAW
    assert choose(chunk, **kw).option == 1
    assert choose(chunk, **{**kw, "bandwidth": 250 * MB}).option == RAW  # clearly faster: still raw


def test_no_slo_mixes_raw_and_levels_when_both_stages_can_work():
    """Link and decoder both busy: raw chunks (heavy on the link) between levels (heavy on the decoder)
    finish sooner than either alone, and the controller's greedy plan finds the mix."""
    cs = raw_and_levels(8, raw_mb=8.0, raw_decode=0.002, level_decode=0.15)
    kw = dict(options=[RAW, *LEVELS], slo_s=None, prefill_s_per_token=1.0, floor=1)
    bw = 60 * MB  # raw: 0.133 s on the link; level 1: 0.05 s on the link, 0.15 s decoding
    picks, link, compute = [], 0.0, 0.0
    for i in range(len(cs)):
        d = choose(cs[i:], elapsed_s=link, bandwidth=bw, busy_s=max(compute - link, 0.0), **kw)
        picks.append(d.option)
        link += cs[i].sizes[d.option] / bw
        compute = max(compute, link) + cs[i].decode_s[d.option]
    only_raw = predict_finish(cs, RAW, elapsed_s=0.0, bandwidth=bw, prefill_s_per_token=1.0)
    only_one = predict_finish(cs, 1, elapsed_s=0.0, bandwidth=bw, prefill_s_per_token=1.0)
    assert RAW in picks and 1 in picks, picks
    assert compute < 0.85 * min(only_raw, only_one), (picks, compute, only_raw, only_one)


# ------------------------------------------------------------------ batches
def test_batch_shares_fetches_and_decodes():
    fetches, decodes = [], []
    requests = [["a", "b", "c"], ["a", "b", "d"], ["a"], ["e"]]
    cs = dict.fromkeys("abcde", costs(1)[0])

    def fetch(chunk, level):
        fetches.append(chunk)
        return chunk.encode()

    def decode(blob, chunk, level):
        decodes.append(chunk)
        return object()

    res = stream_batch(requests, cs, fetch=fetch, decode=decode, on_text=lambda c: None, controller=Controller(LEVELS, allow_text=False),
                       estimator=HarmonicMeanEstimator())  # fmt: skip
    assert sorted(fetches) == sorted(decodes) == ["a", "b", "c", "d", "e"]  # once each
    assert [len(p) for p in res.parts] == [3, 3, 1, 1]
    assert res.parts[0][0] is res.parts[1][0] is res.parts[2][0]  # the same decoded part for every request
    assert res.parts[0][2] is not res.parts[1][2]
    assert res.plan.n_requests == 4 and [r.chunk for r in res.plan.records] == ["a", "b", "c", "d", "e"]


def test_batch_plans_with_the_bytes_of_every_request():
    """Alone, a request's 2 chunks fit at level 0; with 3 more requests' distinct chunks, a coarser level."""
    est = HarmonicMeanEstimator()
    est.update(10 * MB, 1.0)  # 10 MB/s: 2 chunks at level 0 take 0.8 s
    kw = dict(fetch=lambda c, lv: b"x", decode=lambda b, c, lv: lv, on_text=lambda c: TEXT,
              controller=Controller(LEVELS, slo_s=1.0, prefill_s_per_token=1.0, safety=1.0), clock=lambda: 0.0)  # fmt: skip
    cs = dict.fromkeys(range(8), costs(1, decode_s=0.0)[0])
    alone = stream_batch([[0, 1]], cs, estimator=est, **kw)
    assert alone.plan.options[0] == 0
    batch = stream_batch([[0, 1], [2, 3], [4, 5], [6, 7]], cs, estimator=est, **kw)
    assert batch.plan.options[0] == 3  # 8 chunks in 1 s at 10 MB/s: 1 MB each, the coarsest level
    shared = stream_batch([[0, 1]] * 4, cs, estimator=est, **kw)
    assert shared.plan.options[0] == 0  # the same chunks four times: nothing more to send


def test_unique_in_order():
    assert unique_in_order([["a", "b", "c"], ["a", "b", "d"], ["a"]]) == ["a", "b", "c", "d"]
    assert unique_in_order([]) == []


def test_a_serial_plan_does_not_count_on_fetching_beside_decoding():
    """A local store: a 35 MB raw chunk fetched in 35 ms and copied in 8 ms, a 10 MB level chunk decoded in 55 ms."""
    mb = 1e6
    cs = [ChunkCost({"raw": 35 * mb, 1: 10 * mb}, {"raw": 0.008, 1: 0.055}, 1536) for _ in range(2)]
    overlapped = Controller(("raw", 1), prefill_s_per_token=1.0, floor=1, safety=1.0)
    serial = Controller(("raw", 1), prefill_s_per_token=1.0, floor=1, safety=1.0, serial=True)
    # overlapped: a level first, the raw chunk arriving while it decodes (75 ms against 86 ms for raw twice)
    assert overlapped.decide(cs, elapsed_s=0.0, bandwidth=1000 * mb).option == 1
    assert serial.decide(cs, elapsed_s=0.0, bandwidth=1000 * mb).option == "raw"  # 86 ms against 108 ms
    assert predict_finish(cs, "raw", elapsed_s=0.0, bandwidth=1000 * mb, prefill_s_per_token=1.0, serial=True) == pytest.approx(0.086)
    assert predict_finish(cs, "raw", elapsed_s=0.0, bandwidth=1000 * mb, prefill_s_per_token=1.0) == pytest.approx(0.078)


def test_a_local_store_plans_its_first_chunk_before_any_fetch_is_measured():
    """No estimate yet: a remote store starts at the floor; a local one plans at LOCAL_BANDWIDTH_PRIOR, so raw bytes
    it can read in a few ms go first instead of a level that takes 55 ms to decode."""
    mb = 1e6
    cs = [ChunkCost({"raw": 35 * mb, 1: 10 * mb}, {"raw": 0.008, 1: 0.055}, 1536) for _ in range(2)]
    remote = Controller(("raw", 1), prefill_s_per_token=1.0, floor=1)
    local = Controller(("raw", 1), prefill_s_per_token=1.0, floor=1, serial=True)
    assert remote.decide(cs, elapsed_s=0.0, bandwidth=None).option == 1
    first = local.decide(cs, elapsed_s=0.0, bandwidth=None)
    assert first.option == "raw" and first.predicted_finish_s is not None
    assert local.decide(cs, elapsed_s=0.0, bandwidth=10 * mb).option == 1  # a measured slow disk still gets the level


class Gone(LookupError):
    """A form the store no longer holds (the reader's ``BlobMissing``)."""


@pytest.mark.parametrize("overlap", [True, False])
def test_a_missing_form_is_replaced_by_the_next_one_in_the_same_stream(overlap):
    evicted = {(1, RAW), (3, RAW), (3, 1)}  # chunk 1 lost its raw form, chunk 3 both of its forms
    asked = []

    def fetch(chunk, option):
        asked.append((chunk, option))
        if (chunk, option) in evicted:
            raise Gone(f"{chunk} as {option}")
        return b"x" * 1000

    class LocalStore(HarmonicMeanEstimator):
        """1 GB/s whatever a 1000-byte fetch measures: on a busy machine one took long enough for 8 MB of raw
        bytes to look slower than level 1's decode, and the plan (not the replacement under test) changed."""

        def estimate(self) -> float:
            return 1e9

    stored = ChunkCost({RAW: 8 * MB, 1: 2 * MB}, {RAW: 0.001, 1: 0.05}, 1536)
    kw = dict(decode=lambda b, c, o: (c, o), on_text=lambda c: (c, TEXT), estimator=LocalStore(), overlap=overlap,
              controller=Controller([RAW, 1], floor=1, serial=True))  # fmt: skip
    res = stream_chunks([0, 1, 2], [stored] * 3, fetch=fetch, missing=(Gone,), **kw)
    assert res.parts == [(0, RAW), (1, 1), (2, RAW)] and [r.option for r in res.trace] == [RAW, 1, RAW]
    assert asked == [(0, RAW), (1, RAW), (1, 1), (2, RAW)]  # the lost form asked once, the next one at once
    with pytest.raises(StreamFailure) as err:  # no stored form left: a plain miss from there, as before
        stream_chunks([0, 1, 2, 3, 4], [stored] * 5, fetch=fetch, missing=(Gone,), **kw)
    assert err.value.index == 3 and isinstance(err.value.cause, Gone) and len(err.value.partial.parts) == 3
    only_coarse = ChunkCost({RAW: 8 * MB, 3: MB}, {RAW: 0.001, 3: 0.05}, 1536)
    with pytest.raises(StreamFailure):  # a form coarser than the floor does not stand in for a lost one
        stream_chunks([3], [only_coarse], fetch=lambda c, o: fetch(1, o), missing=(Gone,), **kw)
    with pytest.raises(StreamFailure) as err:  # without ``missing`` it stops the stream, as any failure
        stream_chunks([0, 1], [stored] * 2, fetch=fetch, **kw)
    assert err.value.index == 1 and isinstance(err.value.cause, Gone)
