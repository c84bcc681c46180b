"""A read's fixed cost modelled apart from the bandwidth: fitted from reads of different sizes, paid once per read in
the plans, so small reads do not make a local store look slow and a big raw form look slower than a level."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachegen_core.streaming import RAW, TEXT, ChunkCost, Controller, HarmonicMeanEstimator, LastSampleEstimator, make_estimator
from cachegen_core.streaming import predict_finish, stream_chunks
from cachegen_core.streaming.estimators import MAX_BANDWIDTH, read_fixed_s
from cachegen_core.streaming.fits import fit_read_fixed

MB = 1_000_000
#: A 135M model's 1,536-token chunk on a 2-core box: raw 35 MB copied in 5 ms, level 2 6.5 MB decoded in 150 ms.
RAW_BYTES, LEVEL_BYTES, RAW_S, LEVEL_S = 35 * MB, 6_500_000, 0.005, 0.150


def read_s(nbytes: int, fixed: float, bandwidth: float) -> float:
    return fixed + nbytes / bandwidth


def local_chunks(n: int = 2) -> list[ChunkCost]:
    return [ChunkCost({RAW: RAW_BYTES, 2: LEVEL_BYTES}, {RAW: RAW_S, 2: LEVEL_S}, 1536)] * n


def fed(reads: list[tuple[int, float]], *, fixed_cost: bool) -> HarmonicMeanEstimator:
    e = HarmonicMeanEstimator(fixed_cost=fixed_cost)
    for n, s in reads:
        e.update(n, s)
    return e


# ------------------------------------------------------------------ the fit
def test_the_fit_recovers_a_fixed_cost_and_the_bandwidth_from_reads_of_several_sizes():
    reads = [(n, read_s(n, 2e-3, 5e9)) for n in (100_000, LEVEL_BYTES, RAW_BYTES, 1_500_000)]
    assert fit_read_fixed(reads) == pytest.approx(2e-3, rel=1e-6)
    e = fed(reads, fixed_cost=True)
    assert e.fixed_s() == pytest.approx(2e-3, rel=1e-6)
    assert e.estimate() == pytest.approx(5e9, rel=1e-6)
    naive = fed(reads, fixed_cost=False)  # the same reads read as bandwidth: the small ones make it look 20x slower
    assert naive.fixed_s() == 0.0 and naive.estimate() < 5e9 / 4


def test_reads_of_one_size_cannot_tell_a_fixed_cost_from_bandwidth():
    reads = [(LEVEL_BYTES, read_s(LEVEL_BYTES, 2e-3, 5e9))] * 5 + [(int(LEVEL_BYTES * 1.5), 4e-3)]
    assert fit_read_fixed(reads) == 0.0  # sizes span 1.5x: the bandwidth alone, which predicts reads of that size right
    assert fit_read_fixed(reads[:1]) == 0.0 and fit_read_fixed([]) == 0.0
    e = fed(reads, fixed_cost=True)
    assert e.fixed_s() == 0.0 and e.estimate() == pytest.approx(fed(reads, fixed_cost=False).estimate())


def test_reads_that_do_not_grow_with_their_bytes_are_all_fixed_cost():
    """A memory store handing back an object it holds: 20 us for 100 KB and for 35 MB. The rate is above anything
    measurable (capped, not infinite: estimates reach the requests' records)."""
    e = fed([(100_000, 2e-5), (RAW_BYTES, 2e-5), (LEVEL_BYTES, 2e-5)], fixed_cost=True)
    assert e.fixed_s() == pytest.approx(2e-5) and e.estimate() == MAX_BANDWIDTH


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10**9), st.floats(1e-6, 10.0)), min_size=1, max_size=20))
def test_the_fixed_cost_is_never_more_than_the_fastest_read_took(reads):
    fixed = fit_read_fixed(reads)
    assert 0.0 <= fixed <= min(s for _, s in reads)
    e = fed(reads, fixed_cost=True)
    assert 0 < e.estimate() <= MAX_BANDWIDTH


def test_the_last_sample_estimator_takes_the_fixed_cost_off_its_last_read():
    reads = [(n, read_s(n, 1e-3, 2e9)) for n in (RAW_BYTES, 100_000)]
    last = LastSampleEstimator(fixed_cost=True)
    for r in reads:
        last.update(*r)
    assert last.estimate() == pytest.approx(2e9, rel=1e-6) and last.last == pytest.approx(100_000 / reads[1][1])
    plain = make_estimator("last")
    for r in reads:
        plain.update(*r)
    assert plain.fixed_s() == 0.0 and plain.estimate() == pytest.approx(100_000 / reads[1][1])  # the paper's: 91 MB/s


def test_an_estimator_without_a_fixed_cost_reads_as_zero():
    class Bandwidth:
        def update(self, nbytes: int, seconds: float) -> None: ...

        def estimate(self) -> float | None:
            return 1e9

    assert read_fixed_s(Bandwidth()) == 0.0
    assert read_fixed_s(make_estimator("harmonic", fixed_cost=True)) == 0.0  # nothing measured yet


# ------------------------------------------------------------------ the plan
def test_predict_finish_pays_the_fixed_cost_once_per_read():
    two = [ChunkCost({0: 10}, {0: 0.5}, 7)] * 2
    kw = dict(elapsed_s=1.0, bandwidth=10.0, prefill_s_per_token=0.1)
    # reads of 0.25 + 1 s: arrivals at 2.25 and 3.5; decodes end at 2.75 and 4.0
    assert predict_finish(two, 0, fixed_s=0.25, **kw) == pytest.approx(4.0)
    assert predict_finish(two, 0, fixed_s=0.25, n_requests=2, **kw) == pytest.approx(1.0 + 2 * 2.5 + 2 * 0.5)
    assert predict_finish(two, TEXT, fixed_s=0.25, **kw) == pytest.approx(1.0 + 2 * 7 * 0.1)  # text reads nothing


def test_on_a_local_store_with_a_fixed_cost_raw_wins_where_a_naive_bandwidth_estimate_picks_a_level():
    """Reads of 2 ms each plus 10 GB/s, measured on small blobs (a partial chunk's level, 100 KB) and a level: read as
    bandwidth, 100 KB in 2 ms is 50 MB/s, and 28.5 MB more for the raw form looks like 0.6 s against the level's
    150 ms decode. With the fixed cost apart, the raw form's extra bytes cost 3 ms."""
    reads = [(n, read_s(n, 2e-3, 10e9)) for n in (100_000, 100_000, LEVEL_BYTES)]
    controller = Controller((RAW, 2), floor=2, serial=True, allow_text=False)
    naive, fitted = fed(reads, fixed_cost=False), fed(reads, fixed_cost=True)
    assert controller.decide(local_chunks(), elapsed_s=0.0, bandwidth=naive.estimate()).option == 2
    decision = controller.decide(local_chunks(), elapsed_s=0.0, bandwidth=fitted.estimate(), fixed_s=fitted.fixed_s())
    assert decision.option == RAW
    # two chunks, each read (2 ms + 3.5 ms) then copied (5 ms), in turns, at 0.85 of the bandwidth
    assert decision.predicted_finish_s == pytest.approx(2 * (2e-3 + RAW_BYTES / (0.85 * 10e9) + RAW_S), rel=1e-3)


def test_on_a_slow_link_a_level_still_wins_with_the_fixed_cost_apart():
    """0.1 Gbit/s and a 1 ms round trip: the fit finds both, and 28.5 MB more cost the raw form 2.3 s."""
    reads = [(n, read_s(n, 1e-3, 12.5e6)) for n in (LEVEL_BYTES, 1_500_000, RAW_BYTES)]
    e = fed(reads, fixed_cost=True)
    assert e.fixed_s() == pytest.approx(1e-3, rel=1e-6) and e.estimate() == pytest.approx(12.5e6, rel=1e-6)
    for serial in (False, True):
        decision = Controller((RAW, 2), floor=2, serial=serial).decide(local_chunks(), elapsed_s=0.0, bandwidth=e.estimate(),
                                                                       fixed_s=e.fixed_s())  # fmt: skip
        assert decision.option == 2


def test_tiny_chunks_compare_raw_and_level_by_bytes_and_decode_and_text_by_the_reads_fixed_cost():
    """A tiny model's 64-token chunk: raw 16 KB, its level 4 KB, 100 us a read. Read as bandwidth (4 KB in 100 us:
    40 MB/s) the raw form's 12 KB more look like 300 us, more than the level's decode costs over the copy (200 us);
    with the fixed cost apart they cost 1.2 us. And a chunk whose read alone costs more than recomputing it goes as text."""
    tiny = [ChunkCost({RAW: 16_384, 1: 4_096}, {RAW: 20e-6, 1: 220e-6}, 64)] * 3
    reads = [(n, read_s(n, 1e-4, 10e9)) for n in (4_096, 4_096, 16_384)]
    controller = Controller((RAW, 1), floor=1, serial=True, prefill_s_per_token=1e-3)
    naive, fitted = fed(reads[:2], fixed_cost=False), fed(reads, fixed_cost=True)
    assert controller.decide(tiny, elapsed_s=0.0, bandwidth=naive.estimate()).option == 1
    assert controller.decide(tiny, elapsed_s=0.0, bandwidth=fitted.estimate(), fixed_s=fitted.fixed_s()).option == RAW
    cheap_text = Controller((RAW, 1), floor=1, serial=True, prefill_s_per_token=1e-6)  # 64 us a chunk
    assert cheap_text.decide(tiny, elapsed_s=0.0, bandwidth=fitted.estimate()).option == RAW  # the read taken as free
    assert cheap_text.decide(tiny, elapsed_s=0.0, bandwidth=fitted.estimate(), fixed_s=fitted.fixed_s()).option == TEXT


def test_the_driver_plans_with_the_estimators_fixed_cost():
    """``stream_chunks`` hands the controller its estimator's fixed cost at every decision, as fitted then."""
    seen = []
    e = fed([(n, read_s(n, 3e-3, 1e9)) for n in (MB, 4 * MB)], fixed_cost=True)

    class Spy(Controller):
        def decide(self, remaining, **kw):
            seen.append((kw["fixed_s"], e.fixed_s()))
            return super().decide(remaining, **kw)

    stream_chunks(range(3), local_chunks(3), fetch=lambda c, o: b"x" * 1000, decode=lambda b, c, o: c, on_text=lambda c: c,
                  controller=Spy((RAW, 2), floor=2, allow_text=False), estimator=e)  # fmt: skip
    assert len(seen) == 3 and seen[0][0] == pytest.approx(3e-3, rel=1e-6)
    assert all(given == fitted for given, fitted in seen)  # refitted after each measured read (1 KB ones here)
