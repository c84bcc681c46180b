"""The controller measures instead of assuming: with costs injected on a fake clock, its choice reaches the truly
fastest option per chunk from the second warm request on, whatever its priors (issue 46, part 1).

A world of true costs (a local store: fetching and decoding take turns on the same cores; a chunk's prefill grows with
its position) is streamed by the real driver, controller, estimator and ``CostModel``; what the engine measures
(decodes, prefills, the question after a cached prompt) and the probes the cost model asks for after each stream
(``CostModel.after_stream``: an option offered but not used, measured off the request's path) are fed from the same
true costs. Priors 100x too optimistic and 100x too pessimistic for each of raw, level and text.
"""

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from cachegen_core.engine.costs.cost import CostModel
from cachegen_core.streaming import RAW, TEXT, Controller, HarmonicMeanEstimator, stream_chunks
from cachegen_core.streaming.fits import PrefillFit, fit_nonnegative, fit_prefill

T, N, QUESTION = 1536, 8, 32  # tokens a chunk, chunks a prompt, the question's tokens
ELEMENTS = 2 * 32 * 8 * 128  # a 7B model's KV elements a token
SIZES = {RAW: 2 * ELEMENTS * T, 1: ELEMENTS * T // 4, 3: ELEMENTS * T // 8}  # bytes of a chunk per stored form


class Blob:
    """A fetched blob's length, without its bytes."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@dataclass(frozen=True)
class World:
    """True costs: fetch at ``bandwidth`` bytes/s, ``decode`` seconds a chunk per form, prefill ``prefill`` (with its
    per-call overhead ``g`` once per pass)."""

    bandwidth: float
    decode: dict
    prefill: PrefillFit

    def chunk_s(self, option, i: int) -> float:
        if option == TEXT:
            return self.prefill.seconds(T, i * T, overhead=False)
        return SIZES[option] / self.bandwidth + self.decode[option]

    def fastest(self) -> list:
        return [min([RAW, 1, 3, TEXT], key=lambda o: self.chunk_s(o, i)) for i in range(N)]


WORLDS = {
    # an H200 and a 7B model: raw forms copied at PCIe speed beat recomputing late chunks and early ones
    "raw": World(20e9, {RAW: 0.006, 1: 0.05, 3: 0.04}, PrefillFit(a=2.5e-5, b=1e-9, g=0.02)),
    # a CPU: raw copies slow, the level's decode fast enough, prefill slow
    "level": World(5e9, {RAW: 0.3, 1: 0.03, 3: 0.06}, PrefillFit(a=2e-4, b=2e-9, g=0.01)),
    # a tiny model: recomputing beats any fetch
    "text": World(2e9, {RAW: 0.2, 1: 0.1, 3: 0.1}, PrefillFit(a=1e-6, b=1e-11, g=0.001)),
    # attention-heavy: the first chunk recomputed, the rest (later in the prompt, dearer to recompute) copied
    "by position": World(20e9, {RAW: 0.0035, 1: 0.05, 3: 0.04}, PrefillFit(a=1e-6, b=5e-9, g=0.001)),
}
TRUE_PRIORS = {"raw": 2 * ELEMENTS / 7e9, "level": ELEMENTS / 1e9, "text": 1e-4}  # s a token, roughly any device's


def test_each_world_has_a_clear_winner_per_chunk():
    """Every chunk's fastest option beats the next by 25 % at least: the test measures convergence, not tie-breaking."""
    for name, w in WORLDS.items():
        for i in range(N):
            a, b = sorted(w.chunk_s(o, i) for o in [RAW, 1, 3, TEXT])[:2]
            assert b > 1.25 * a, (name, i)
    assert WORLDS["by position"].fastest() == [TEXT] + [RAW] * (N - 1)
    assert {WORLDS[k].fastest()[0] for k in ("raw", "level", "text")} == {RAW, 1, TEXT}


def simulate(world: World, model: CostModel, requests: int) -> list[list]:
    """A cold request, then ``requests`` warm ones of the same prompt; each warm request's choices."""
    now = [0.0]
    estimator = HarmonicMeanEstimator()
    n = N * T + QUESTION
    model.observe_prefill(n, 0, world.prefill.seconds(n, 0))  # the cold request's prefill, timed

    def fetch(i, option):
        now[0] += SIZES[option] / world.bandwidth
        return Blob(SIZES[option])

    def decode(blob, i, option):
        now[0] += world.decode[option]
        model.observe_decode(option, len(blob), world.decode[option], T)

    def on_text(i):
        s = world.prefill.seconds(T, i * T, overhead=False)
        now[0] += s
        model.observe_prefill(T, i * T, s)

    choices = []
    for _ in range(requests):
        controller = Controller((RAW, 1, 3), prefill_s_per_token=model.prefill_s_per_token, floor=3, serial=True)
        res = stream_chunks(range(N), lambda i: model.chunk_cost(T, SIZES, i * T), fetch=fetch, decode=decode,
                            on_text=on_text, controller=controller, estimator=estimator, clock=lambda: now[0], overlap=False)  # fmt: skip
        choices.append(res.plan.options)
        model.observe_prefill(QUESTION, N * T, world.prefill.seconds(QUESTION, N * T))  # the question, after the cache
        for option in model.after_stream(SIZES, set(res.plan.options), text=True):  # probes, off the request's path
            if option == TEXT:
                model.observe_prefill(T, 0, world.prefill.seconds(T, 0))
            else:
                estimator.update(SIZES[option], SIZES[option] / world.bandwidth)
                model.observe_decode(option, SIZES[option], world.decode[option], T, probe=True)
    return choices


@pytest.mark.parametrize("world", list(WORLDS))
@pytest.mark.parametrize("raw,level,text", list(itertools.product([0.01, 1.0, 100.0], repeat=3)))
def test_the_choice_converges_to_the_truly_fastest_option_whatever_the_priors(world, raw, level, text):
    """Priors off by 100x either way, for each form: from the second warm request on every chunk goes in the form that
    is truly fastest for it (the first plans on the priors; what it did not use is probed after it)."""
    model = CostModel(ELEMENTS, prefill_prior_s_per_token=text * TRUE_PRIORS["text"], symbols_per_s=1 / (level * TRUE_PRIORS["level"]),
                      copy_bytes_per_s=2 * ELEMENTS / (raw * TRUE_PRIORS["raw"]), reference_tokens=T)  # fmt: skip
    choices = simulate(WORLDS[world], model, requests=6)
    want = WORLDS[world].fastest()
    assert choices[1:] == [want] * 5, choices


def test_a_level_never_chosen_is_probed_now_and_then_and_a_slow_measurement_is_forgotten():
    m = CostModel(1000, reference_tokens=64, probe_every=4)
    assert m.after_stream([RAW, 1], [RAW]) == [1]  # never measured: due at once
    assert m.after_stream([RAW, 1], [RAW]) == [1]  # asked for, still not measured (the probe failed): again
    m.observe_decode(1, 500, 0.5, 10, probe=True)
    assert [m.after_stream([RAW, 1], [RAW]) for _ in range(4)] == [[], [], [], [1]]  # measured: every 4 streams
    m.observe_decode(RAW, 2000, 0.5, 10, probe=True, stored=False)  # a synthetic chunk's copy (the build's probe)
    assert m.after_stream([RAW, 1], [1]) == [RAW]  # raw: never measured on a stored chunk, offered and unused
    m.observe_decode(RAW, 2000, 1.0, 10)  # measured slow under contention: 0.1 s a token
    m.observe_decode(RAW, 2000, 0.01, 10, probe=True)  # a probe measures it beside nothing: replaces the estimate
    assert m.decode_s_per_token[RAW] == pytest.approx(0.001)
    m.observe_decode(RAW, 2000, 0.02, 10, probe=True)  # a slower probe blends in
    assert m.decode_s_per_token[RAW] == pytest.approx(0.7 * 0.001 + 0.3 * 0.002)
    assert m.after_stream([RAW], [], text=True) == [TEXT]  # no prefill of a chunk's size timed yet
    m.observe_prefill(8, 100, 0.01)  # a question: says little of a chunk's cost (left out of the fit)
    assert not m.prefill_measured
    assert all(TEXT not in m.after_stream([RAW], [RAW], text=True) for _ in range(3))  # asked for once per 4 streams
    assert m.after_stream([RAW], [RAW], text=True) == [TEXT]
    m.observe_prefill(64, 0, 0.05)
    assert TEXT not in m.after_stream([RAW], [RAW], text=True) + m.after_stream([RAW], [RAW], text=True)


def test_the_prefill_fit_recovers_its_terms_from_as_many_shapes_as_it_has():
    truth = PrefillFit(a=3e-5, b=2e-9, g=0.015)
    cold, chunk, question = (12_000, 0), (1536, 6_000), (30, 12_000)
    pts = [(t, p, truth.seconds(t, p)) for t, p in (cold, chunk, question)]
    fit = fit_prefill(pts, PrefillFit(1.0))
    assert (fit.a, fit.b, fit.g) == pytest.approx((truth.a, truth.b, truth.g), rel=1e-6)
    two = fit_prefill([(t, p, truth.seconds(t, p, overhead=False)) for t, p in (cold, question)], PrefillFit(1.0))
    assert (two.a, two.b, two.g) == pytest.approx((truth.a, truth.b, 0.0), rel=1e-6)  # no overhead measured
    prior = PrefillFit(1e-3, 1e-3 * 1e-4)
    one = fit_prefill([(2000, 0, 0.5), (2000, 0, 0.7)], prior)  # one shape: the prior's, scaled to the points
    assert one.b / one.a == pytest.approx(1e-4) and 0.5 < one.seconds(2000, 0) < 0.7
    assert fit_prefill([], prior) is prior
    assert CostModel(prefill_prior_s_per_token=1e-3).prefill_seconds(100, 10_000) == pytest.approx(0.1)  # no attention prior


def test_the_nonnegative_fit_is_relative_and_never_negative():
    """(``benchmarks.store_budget`` fits its costs with it too.) Exact points give their coefficients back; points a
    plain least-squares fit answers with a negative per-token cost (a slow short prefill beside fast long ones) get the
    best fit with none below zero."""
    truth = [0.2, 2e-3, 1e-6]
    pts = [(a, n) for n in (3000, 5600, 8200) for a in (0, 1536, n - 64)]
    cols = [[1, n - a, (n * n - a * a) / 2] for a, n in pts]
    coef, err = fit_nonnegative(cols, [sum(c * x for c, x in zip(truth, row)) for row in cols])
    assert coef == pytest.approx(truth, rel=1e-6) and err < 1e-9
    noisy = [[1, x] for x in (100, 200, 4000, 8000)]
    ys = [3.0, 0.5, 1.0, 1.2]
    coef, err = fit_nonnegative(noisy, ys)
    assert min(coef) >= 0 and err > 0
    assert min(np.linalg.lstsq(np.array(noisy, dtype=float), ys, rcond=None)[0]) < 0  # what a plain fit gives
