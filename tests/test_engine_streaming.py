"""The engine under an SLO: a slow store pushes chunks to text, batches share fetches."""

import time

import pytest

from cachegen_core.engine import KVEngine
from cachegen_core.engine.costs.cost import PROBE_EVERY, CostModel
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.stores.redis import RedisStore
from cachegen_core.streaming import TEXT, HarmonicMeanEstimator
from cachegen_core.testing import words
from tests.test_engine import plain_greedy

CHUNK = 64


class SlowCountingStore(MemoryStore):
    """A memory store whose reads take ``delay_s`` and are counted."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.gets: list[str] = []

    def get(self, key):
        self.gets.append(key)
        time.sleep(self.delay_s)
        return super().get(key)


class LocalLink(HarmonicMeanEstimator):
    """A memory store's link at 1 GB/s once measured and no fixed cost, whatever a fetch's wall time: a fetch timed during
    a CPU stall can make raw bytes (4x level 1's) look slower than level 1 for every later stream, relaxed decode
    estimates or not."""

    def estimate(self) -> float | None:
        return None if not self.samples else 1e9

    def fixed_s(self) -> float:
        return 0.0


def engine(model, tok, store, **kw):
    """Every level stored, no raw form: the controller's choice among levels and text is what these tests follow."""
    kw.setdefault("level", 0)
    return KVEngine(model, tok, store=store, chunk_tokens=CHUNK, store_options=[0, 1, 2, 3], background=False, **kw)


def test_no_slo_fetches_the_fastest_option_at_least_as_fine_as_the_level(tiny_llama, tiny_tokenizer):
    store = SlowCountingStore()
    e = engine(tiny_llama, tiny_tokenizer, store, allow_text=False)
    prompt = words(2, 3 * CHUNK + 5)
    e.generate(prompt, max_new_tokens=3)
    _, info = e.generate(prompt, max_new_tokens=3)
    assert info.levels == [0, 0, 0] and [s["option"] for s in info.stream] == [0, 0, 0]  # nothing else is as fine
    e2 = engine(tiny_llama, tiny_tokenizer, store, level=2, allow_text=False)
    _, info = e2.generate(prompt, max_new_tokens=3)
    assert set(info.levels) <= {0, 1, 2}  # never coarser than the level asked for


def test_slow_store_under_a_tight_slo_falls_back_to_text_and_stays_correct(tiny_llama, tiny_tokenizer):
    # a read of 2 s: text wins however slowly a loaded CPU prefills (at 0.5 s, 3 ms a token on a 2-core EPYC
    # at load 15 made the coarsest level predicted faster, neither meeting the SLO)
    store = SlowCountingStore(delay_s=2.0)
    e = engine(tiny_llama, tiny_tokenizer, store, slo_s=0.3)
    prompt = words(2, 3 * CHUNK + 5)
    e.generate(prompt, max_new_tokens=6)
    e.generate(prompt, max_new_tokens=6)  # the first chunk (medium level) measures the slow link
    store.gets.clear()
    text, info = e.generate(prompt, max_new_tokens=6)
    assert info.levels == [TEXT, TEXT, TEXT] and info.text_chunks == 3 and not store.gets
    assert info.cached_tokens == 3 * CHUNK  # prefilled chunk by chunk on the controller's word
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 6)


def test_without_a_deadline_chunks_recomputed_at_the_end_are_prefilled_with_the_prompt_in_one_pass(tiny_llama, tiny_tokenizer):
    """Text chunks that end the stream are left to the generation, which prefills them and the rest of the prompt
    in one forward pass (chunk by chunk, a small model's prompt took 2 cores 5.2 s against 2.2 s); they are in the
    store already, so nothing is stored again, and they count as reused, as under a deadline."""
    store = SlowCountingStore(delay_s=2.0)  # text wins
    e = engine(tiny_llama, tiny_tokenizer, store)
    prompt = words(2, 3 * CHUNK + 5)
    e.generate(prompt, max_new_tokens=6)
    e.generate(prompt, max_new_tokens=6)  # measures the slow link
    prefills = []
    e._prefill = lambda *a: prefills.append(a)  # the stream's own text prefill: not called
    store.gets.clear()
    text, info = e.generate(prompt, max_new_tokens=6)
    assert info.levels == [TEXT, TEXT, TEXT] and info.text_chunks == 3 and not store.gets and not prefills
    assert info.cached_tokens == 3 * CHUNK and info.recomputed_tokens == 5 and info.chunks_queued == 0
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 6)


def test_deferred_text_runs_followed_by_a_streamed_chunk_are_prefilled_in_one_pass_each():
    from cachegen_core.engine.chunks.runs import prefill_text_runs
    from cachegen_core.keys.chunks import Chunk

    run = [Chunk(index=i, start=10 * i, end=10 * (i + 1), key=f"k{i}") for i in range(6)]
    ids, calls = list(range(60)), []
    prompt = (ids, run, "buffer")
    held = {"k2", "k5"}
    trailing = prefill_text_runs(run, {"k0", "k1", "k3", "k4"}, held, prompt, lambda t, b, at: calls.append((t, at)))
    assert calls == [(ids[0:20], 0), (ids[30:50], 30)] and trailing == [] and held == {f"k{i}" for i in range(6)}
    calls.clear()
    held = {"k1"}
    trailing = prefill_text_runs(run, {"k0", "k2", "k3"}, held, prompt, lambda t, b, at: calls.append((t, at)))
    assert calls == [(ids[0:10], 0)] and [c.key for c in trailing] == ["k2", "k3"]  # k4 not streamed: the run ends
    assert held == {"k0", "k1"}


def test_slo_first_chunk_uses_the_medium_level(tiny_llama, tiny_tokenizer):
    # no text: under load a slow first decode can make recomputing predicted faster, which is right but not this test
    e = engine(tiny_llama, tiny_tokenizer, SlowCountingStore(), slo_s=60.0, allow_text=False)
    prompt = words(3, 2 * CHUNK + 1)
    e.generate(prompt, max_new_tokens=2)
    _, info = e.generate(prompt, max_new_tokens=2)
    assert info.stream[0]["option"] == e.stream_options[len(e.stream_options) // 2]
    assert info.stream[1]["option"] == 0  # a fast link: the best level fits


def test_batch_shares_fetched_chunks(tiny_llama, tiny_tokenizer):
    store = SlowCountingStore()
    # text off: the fetches are counted, and with the link measured slow (a fetch timed in a stall) chunks went as text
    e = engine(tiny_llama, tiny_tokenizer, store, allow_text=False)
    shared = words(4, 2 * CHUNK)
    prompts = [shared + " " + words(5 + i, CHUNK + 3) for i in range(3)]
    for p in prompts:
        e.generate(p, max_new_tokens=2)
    store.gets.clear()
    results = e.generate_many(prompts, max_new_tokens=4)
    assert [info.cached_tokens for _, info in results] == [3 * CHUNK] * 3
    # 2 shared chunks + 1 own chunk per prompt, each fetched once
    assert len(store.gets) == 2 + 3 and len(set(store.gets)) == 5
    for p, (text, _) in zip(prompts, results):
        assert text == e.generate(p, max_new_tokens=4)[0]


def test_prefill_prior_is_replaced_by_the_first_measurement_and_then_fitted_by_position(tiny_llama, tiny_tokenizer):
    e = engine(tiny_llama, tiny_tokenizer, MemoryStore(), allow_text=False)  # the cached chunks read, never recomputed beside the tail
    prior = e.cost_model.prefill_seconds(CHUNK, 0)
    assert not e.cost_model.prefill_measured
    measured = []
    observe = e.cost_model.observe_prefill
    e.cost_model.observe_prefill = lambda *a: measured.append(a) or observe(*a)  # what was timed, whatever the CPU's load
    prompt = words(4, 3 * CHUNK)
    n = len(e.tokenize(prompt))
    e.generate(prompt, max_new_tokens=1)  # a miss: the whole prompt is prefilled and timed, from position 0
    assert e.cost_model.prefill_measured and len(measured) == 1 and measured[0][:2] == (n, 0)
    assert e.cost_model.prefill_fit.seconds(n, 0) == pytest.approx(measured[0][2])  # the prior scaled to it, not a blend
    assert e.cost_model.prefill_seconds(CHUNK, 0) != prior
    _, info = e.generate(prompt + " and more words after it", max_new_tokens=1)  # the question after the cached chunks
    tokens, position, _ = measured[-1]  # the generation's pass: the prompt after what its buffer held, timed there
    assert len(measured) == 2 and position > 0 and tokens + position == info.prompt_tokens
    e.cost_model.observe_prefill(CHUNK, 10 * CHUNK, 1.0)  # a chunk late in a prompt: dearer than at the start
    assert e.cost_model.prefill_seconds(CHUNK, 10 * CHUNK) > e.cost_model.prefill_seconds(CHUNK, 0)


def test_levels_decode_straight_into_the_prompts_buffer(tiny_llama, tiny_tokenizer, monkeypatch):
    e = engine(tiny_llama, tiny_tokenizer, MemoryStore(), allow_text=False)
    e.reader.prober = None  # no probe decodes the other levels after the request: the decodes counted are the stream's
    prompt = words(5, 2 * CHUNK + 5)
    want, _ = e.generate(prompt, max_new_tokens=4)
    outs = []
    decode = e.codec.decode

    def spy(blob, *args, out=None, **kwargs):
        outs.append(out)
        return decode(blob, *args, out=out, **kwargs)

    monkeypatch.setattr(e.codec, "decode", spy)
    got, info = e.generate(prompt, max_new_tokens=4)
    assert info.levels == [0, 0] and len(outs) == 2  # both chunks streamed as a level
    assert all(o is not None and o.num_tokens == CHUNK for o in outs)  # slices of the request's buffer: no copy
    assert outs[1].keys.data_ptr() - outs[0].keys.data_ptr() == CHUNK * outs[0].keys.stride(2) * outs[0].keys.element_size()
    assert got == want == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 4)


def test_an_option_measured_slow_once_is_probed_off_the_requests_path_and_tried_again(tiny_llama, tiny_tokenizer):
    """One slow measurement (a raw copy beside another engine's work) must not rule an option out for good: the options
    a stream offered but did not use are measured after it (a probe: one chunk fetched and decoded, here after the
    request, ``background=False``), and a probe faster than the estimate replaces it."""
    e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, store_options=["raw", 1], level=1,
                 allow_text=False, background=False)  # fmt: skip
    assert "raw" in e.cost_model.decode_s_per_token and e.prober.measured == 1  # the build's probe: a synthetic raw chunk
    e.estimator = LocalLink()  # the decode estimates decide here, not the wall time of the memory store's fetches
    prompt = words(6, 2 * CHUNK + 5)
    e.generate(prompt, max_new_tokens=1)
    costs = e.cost_model.decode_s_per_token
    costs["raw"] = poisoned = 10 * e.cost_model.decode_seconds(1, 1, 0) + 1.0
    _, info = e.generate(prompt, max_new_tokens=1)
    assert info.levels == [1, 1]  # raw looks 10x slower than level 1
    for _ in range(PROBE_EVERY):  # probed on a stored chunk after this stream (the build's was synthetic), else later
        if costs["raw"] < poisoned / 100:
            break
        assert e.generate(prompt, max_new_tokens=1)[1].levels == [1, 1]
    assert costs["raw"] < poisoned / 100  # the probe's measurement replaced the estimate
    # what the plan reads of level 1 fixed: on a tiny model a level's decode and a raw copy both cost a call's overhead,
    # and which one a loaded CPU times faster is chance; a real chunk's level decode costs 30x its raw copy (and 0.1 ms
    # a token here, so that the raw form's extra bytes, 14 us at LocalLink's 1 GB/s, never decide)
    costs[1] = 30 * costs["raw"] + 1e-4
    observe = e.cost_model.observe_decode
    e.cost_model.observe_decode = lambda option, *a, **kw: option == 1 or observe(option, *a, **kw)
    _, info = e.generate(prompt, max_new_tokens=1)
    assert info.levels[0] == "raw"  # a local store: raw bytes first (copies cost the CPU less than decoding)


def test_an_engine_that_never_recomputed_a_chunk_times_one_off_the_requests_path(tiny_llama, tiny_tokenizer):
    """Text priced far too high, and no prefill of a chunk's size ever timed (another engine stored the prompt): the
    stream never recomputes, so the probe after it prefills a chunk's worth of tokens, timed, and text's price falls."""
    from cachegen_core.streaming.fits import PrefillFit

    store, prompt = MemoryStore(), words(7, 2 * CHUNK + 5)
    engine(tiny_llama, tiny_tokenizer, store).generate(prompt, max_new_tokens=1)  # stored by another engine
    e = engine(tiny_llama, tiny_tokenizer, store)
    e.cost_model.prior_prefill = PrefillFit(10.0)  # 10 s a token
    measured = []
    observe = e.cost_model.observe_prefill
    e.cost_model.observe_prefill = lambda *a: measured.append(a) or observe(*a)
    _, info = e.generate(prompt, max_new_tokens=1)
    assert TEXT not in info.levels and e.prober.measured >= 1
    assert (CHUNK, 0) in [m[:2] for m in measured]  # the probe: a chunk from the prompt's start
    assert e.cost_model.prefill_seconds(CHUNK, 0) < 1.0


def test_probes_run_in_the_background_beside_no_request(tiny_llama, tiny_tokenizer):
    """The engine as shipped (``background=True``): the probes run in their own thread once the request has answered,
    the synthetic raw copy at build, a stored chunk per form the stream did not use, a chunk's prefill."""
    from cachegen_core.streaming.fits import PrefillFit

    store, prompt = MemoryStore(), words(8, 2 * CHUNK + 5)
    engine(tiny_llama, tiny_tokenizer, store).generate(prompt, max_new_tokens=1)  # stored by another engine
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=[0, 1, 2, 3], level=3)
    e.cost_model.prior_prefill = PrefillFit(10.0)  # text never chosen: its probe runs
    _, info = e.generate(prompt, max_new_tokens=1)
    assert e.prober.join(120)
    used = set(info.levels)
    assert e.prober.dropped == 0 and e.prober.measured == len({0, 1, 2, 3} - used) + 1  # + the chunk's prefill
    assert set(e.cost_model.measured_at) == {0, 1, 2, 3} and e.cost_model.prefill_seconds(CHUNK, 0) < 1.0
    e.close()


class FixedCostReads(HarmonicMeanEstimator):
    """A store whose every read costs 20 ms plus its bytes at 1 GB/s, whatever a fetch's wall time (a tiny model's chunk:
    25 KB raw, 10 KB at level 1, almost all of a read's time its fixed cost)."""

    def update(self, nbytes: int, seconds: float) -> None:
        super().update(nbytes, 0.02 + nbytes / 1e9)


def test_on_a_store_with_a_fixed_cost_per_read_raw_is_not_priced_as_a_slow_link(tiny_llama, tiny_tokenizer):
    """Read as bandwidth, 25 KB in 20 ms is 1.2 MB/s, and the raw form's 15 KB more than level 1 look like 14 ms: more
    than level 1's decode costs over the raw copy (6.3 ms, fixed here). With the fixed cost fitted apart (the engine's
    estimator on a local store, once it has read two sizes) they cost 15 us, and the raw form is taken."""
    chosen = {}
    for fixed_cost in (False, True):
        e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, store_options=["raw", 1], level=1,
                     allow_text=False, background=False)  # fmt: skip
        prompt = words(12, 2 * CHUNK + 5)
        e.generate(prompt, max_new_tokens=1)
        e.estimator = FixedCostReads(fixed_cost=fixed_cost)
        e.cost_model.decode_s_per_token.update({"raw": 1e-6, 1: 1e-4})  # what the plan reads of decoding, fixed
        e.cost_model.observe_decode = lambda *a, **kw: None
        chosen[fixed_cost] = [e.generate(prompt, max_new_tokens=1)[1].levels for _ in range(3)]
        e.close()
    # the first chunk at the prior (1 GB/s): raw; its read, 25 KB in 20 ms, sets the estimate for the rest
    assert chosen[False] == [["raw", 1], [1, 1], [1, 1]]  # the fixed cost read as bandwidth: the level, stream after stream
    assert chosen[True] == [["raw", 1], [1, "raw"], ["raw", "raw"]]  # a level's read too (two sizes): the fixed cost apart


def test_without_probes_a_slow_measurement_would_rule_raw_out():
    """The same poisoned estimate, no probe: nothing brings it back (what the probes are for)."""
    m = CostModel(1000)
    m.observe_decode("raw", 2000, 100.0, 10)
    for _ in range(50):
        m.after_stream(["raw", 1], [1])
    assert m.decode_s_per_token["raw"] == 10.0


def test_a_store_that_shares_its_objects_is_read_on_the_requests_thread_others_beside_it(tiny_llama, tiny_tokenizer):
    """A memory store's get costs nothing: no fetch thread (a thread's start and hand-offs were its only fetch time)."""
    import threading

    class Recording(MemoryStore):
        def __init__(self, shares: bool) -> None:
            super().__init__()
            self.shares_values, self.threads = shares, set()

        def get(self, key):
            self.threads.add(threading.current_thread())
            return super().get(key)

    prompt = words(3, 3 * CHUNK + 5)
    for shares in (True, False):
        store = Recording(shares)
        e = engine(tiny_llama, tiny_tokenizer, store, allow_text=False)
        e.generate(prompt, max_new_tokens=1)
        store.threads.clear()
        _, info = e.generate(prompt, max_new_tokens=1)
        assert info.cached_tokens == 3 * CHUNK and store.threads
        assert (store.threads == {threading.current_thread()}) is shares


def test_a_redis_server_on_this_host_is_planned_like_a_local_store(tiny_llama, tiny_tokenizer, redis_server):
    """A loopback server's fetches take the decoder's cores: a fetch timed beside a decode measures that contention,
    so only a stream's first fetch updates the link estimate, as on a local store (and plans do not count on
    overlap); a server on another host (``same_host=False``) has every fetch measured."""
    prompt = words(6, 3 * CHUNK + 5)
    samples = {}
    for same_host in (None, False):
        store = RedisStore(redis_server.url, namespace=f"same-host-{same_host}:", same_host=same_host)
        e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=[1], level=1,
                     allow_text=False, background=False)  # fmt: skip
        want, _ = e.generate(prompt, max_new_tokens=3)
        got, info = e.generate(prompt, max_new_tokens=3)
        assert info.levels == [1, 1, 1] and got == want == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 3)
        samples[same_host] = len(e.estimator.samples)
        assert e.estimator.fixed_cost is (same_host is None)  # a read's fixed cost fitted on this host only: estimators.py
        e.close()
    assert samples == {None: 1, False: 3}
