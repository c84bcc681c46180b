"""The scheduler's rules, on a tiny model: requests join and leave between steps, each answers as it would alone
(greedy and seeded sampling, stop strings), a cancelled or failing request leaves the others unchanged, a shared
prefix is read in place, the KV memory bound queues or refuses, background work gets turns under load."""

from __future__ import annotations

import threading
import time

import pytest

from cachegen_core.engine import KVEngine
from cachegen_core import EngineBusy, TooLarge
from cachegen_core.engine.serving.request import Job, State
from cachegen_core.engine.serving.turns import Turns
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from cachegen_core.keys.chunks import blob_key

CHUNK = 32


def _engine(model, tok, **kw) -> KVEngine:
    kw = {"store": MemoryStore(), "chunk_tokens": CHUNK, "partial_step": 8, "level": "lossless", "background": False, **kw}
    return KVEngine(model, tok, **kw)


class Tokens:
    """A streamer counting tokens; ``after(n)`` is set once ``n`` tokens were put; ``hold`` blocks each put while set."""

    def __init__(self, n: int = 1) -> None:
        self.count, self.after, self.n, self.ended = 0, threading.Event(), n, False
        self.hold = threading.Event()

    def put(self, value) -> None:
        if self.count or value.dim() == 1:  # the first put is the prompt (2-D)
            self.count += value.dim() == 1
        while self.hold.is_set():
            time.sleep(0.01)
        if self.count >= self.n:
            self.after.set()

    def end(self) -> None:
        self.ended = True
        self.after.set()


def _alone(model, tok, prompt: str, **gen) -> str:
    return _engine(model, tok).generate(prompt, **gen)[0]


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  handed to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_request_joining_others_that_decode_answers_as_alone_and_so_do_they(tiny_llama, tiny_tokenizer):
    eng = _engine(tiny_llama, tiny_tokenizer)
    long, short = words(1, 90), words(2, 40)
    first = Tokens(3)
    t, out = _in_thread(lambda: eng.generate(long, max_new_tokens=40, streamer=first))
    assert first.after.wait(30)  # the first request is decoding
    second = eng.generate(short, max_new_tokens=12)
    t.join()
    assert out["value"][0] == _alone(tiny_llama, tiny_tokenizer, long, max_new_tokens=40)
    assert second[0] == _alone(tiny_llama, tiny_tokenizer, short, max_new_tokens=12)
    assert eng.scheduler.batched_steps > 0  # they shared steps
    assert second[1].ttft_s > 0 and out["value"][1].finish_reason == "length"


def test_a_long_prompt_joining_is_computed_in_pieces_beside_the_decoding_requests(tiny_llama, tiny_tokenizer, monkeypatch):
    eng = _engine(tiny_llama, tiny_tokenizer)
    eng.scheduler.decode_s = 1e-3
    eng.scheduler.prefill_seconds = lambda tokens, position: 1e-4 * tokens  # a piece: 10 tokens a step
    pieces: list[int] = []
    forward = eng.scheduler._forward
    monkeypatch.setattr(eng.scheduler, "_forward", lambda d, p: (pieces.extend(n for _, n in p if d), forward(d, p))[1])
    first = Tokens(2)
    t, out = _in_thread(lambda: eng.generate(words(3, 30), max_new_tokens=60, streamer=first))
    assert first.after.wait(30)
    joined = eng.generate(words(4, 120), max_new_tokens=4)
    t.join()
    assert pieces and max(pieces) < 120  # the joining prompt was cut while the first request decoded
    assert joined[0] == _alone(tiny_llama, tiny_tokenizer, words(4, 120), max_new_tokens=4)


def test_requests_joining_together_share_one_decode_steps_worth_of_prompt_tokens(tiny_llama, tiny_tokenizer):
    s = _engine(tiny_llama, tiny_tokenizer).scheduler
    s.prefill_seconds = lambda tokens, position: 1e-3 * tokens  # 1 ms a prompt token
    joining = [Job(list(range(100)), None, 0) for _ in range(5)]  # type: ignore[arg-type]
    for j in joining:
        j.pending = len(j.ids)
    assert s._pieces(0, joining) == [(joining[0], 100), (joining[1], 100), (joining[2], 100), (joining[3], 100), (joining[4], 100)]
    s.decode_s = 0.040  # a decode step: 40 prompt tokens' time, in all, whoever joins
    assert s._pieces(3, joining) == [(joining[0], 40)]
    joining[0].pending = 25  # the rest of the first one, then the next in line
    assert s._pieces(3, joining) == [(joining[0], 25), (joining[1], 16)]  # no piece under MIN_PIECE tokens
    s.decode_s = 0.0  # no decode step timed yet: PROBE tokens
    assert s._pieces(3, joining[1:]) == [(joining[1], 64)]
    s._decode_by = {1: 0.030, 8: 0.050}  # decode steps timed by how many decoded: the budget is theirs
    assert s._pieces(8, joining[1:]) == [(joining[1], 50)] and s.step_s(5) == 0.030 and s.step_s(9) == 0.050
    joining[1].pending = 60  # a piece leaves no remainder under MIN_PIECE tokens for a step of its own
    assert s._pieces(8, joining[1:2]) == [(joining[1], 60)]
    long, question = Job(list(range(5000)), None, 0), Job(list(range(20)), None, 0)  # type: ignore[arg-type]
    long.pending, question.pending = 5000, 20
    assert s._pieces(0, [long]) == [(long, 1000)]  # nothing decoding: about MAX_STEP_S (1 s) of a long prompt
    assert s._pieces(0, [long, question]) == [(question, 20)]  # a question arriving after it goes first, alone
    assert s._pieces(8, [long, question]) == [(question, 20), (long, 30)]


def test_pieces_shrink_when_they_take_longer_than_the_prefill_cost_predicts(tiny_llama, tiny_tokenizer):
    s = _engine(tiny_llama, tiny_tokenizer).scheduler
    s.prefill_seconds = lambda tokens, position: 1e-4 * tokens  # predicted: 0.1 ms a prompt token
    s.decode_s = 0.008
    job, decoding = Job(list(range(10_000)), None, 0), Job([1], None, 0)  # type: ignore[arg-type]
    job.pending, job.state, decoding.state = len(job.ids), State.PREFILLING, State.DECODING
    assert s._pieces(1, [job]) == [(job, 80)]
    # each step: a decode step, then its pieces at 0.3 ms a token (three times the prediction)
    s._forward = lambda d, p: time.sleep(s.decode_s + 3e-4 * sum(n for _, n in p))  # type: ignore[method-assign]
    for _ in range(12):
        s._step([decoding, job])
    assert 2.5 < s.piece_scale < 4.5  # learnt from the steps (a sleep only overshoots)
    assert 16 <= s._pieces(1, [job])[0][1] <= 32  # a decode step's worth at the measured cost
    s.piece_scale = 1.0
    s._forward = lambda d, p: None  # type: ignore[method-assign]  # a step quicker than a decode step: ratio floored
    s._step([decoding, job])
    assert s.piece_scale == pytest.approx(1.0 + 0.3 * (0.1 - 1.0))


def test_cancelling_one_request_leaves_the_others_answers_unchanged(tiny_llama, tiny_tokenizer):
    eng = _engine(tiny_llama, tiny_tokenizer)
    prompts = [words(10 + i, 50 + 7 * i) for i in range(3)]
    cancel, late = threading.Event(), Tokens(2)
    threads = [_in_thread(lambda p=p: eng.generate(p, max_new_tokens=20)) for p in prompts[:2]]
    victim = _in_thread(lambda: eng.generate(prompts[2], max_new_tokens=200, streamer=late, cancel=cancel))
    assert late.after.wait(30)
    cancel.set()
    for t, _ in [*threads, victim]:
        t.join()
    text, info = victim[1]["value"]
    assert info.finish_reason == "cancelled" and 2 <= info.new_tokens < 200
    for p, (_, out) in zip(prompts, threads):
        assert out["value"][0] == _alone(tiny_llama, tiny_tokenizer, p, max_new_tokens=20)


def test_seeded_sampling_and_stop_strings_are_per_request(tiny_llama, tiny_tokenizer):
    eng = _engine(tiny_llama, tiny_tokenizer)
    sampled = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    alone = _alone(tiny_llama, tiny_tokenizer, words(20, 60), **sampled)
    stop_alone = _alone(tiny_llama, tiny_tokenizer, words(21, 45), max_new_tokens=30)
    stop = stop_alone.split()[3]  # a word it writes
    results = [_in_thread(lambda: eng.generate(words(20, 60), **sampled)),
               _in_thread(lambda: eng.generate(words(21, 45), max_new_tokens=30, stop=[stop])),
               _in_thread(lambda: eng.generate(words(22, 70), max_new_tokens=25))]  # fmt: skip
    for t, _ in results:
        t.join()
    assert results[0][1]["value"][0] == alone
    text, info = results[1][1]["value"]
    assert info.stop_sequence == stop and text.startswith(stop_alone[: stop_alone.index(stop)]) and stop in text
    assert _alone(tiny_llama, tiny_tokenizer, words(20, 60), **{**sampled, "seed": 8}) != alone


def test_a_request_failing_in_its_step_fails_alone(tiny_llama, tiny_tokenizer):
    eng = _engine(tiny_llama, tiny_tokenizer)

    def broken(ids, scores):
        if ids.shape[1] > 70:
            raise RuntimeError("a criterion that breaks")
        return ids.new_zeros(1, dtype=bool)

    good = _in_thread(lambda: eng.generate(words(30, 50), max_new_tokens=25))
    bad = _in_thread(lambda: eng.generate(words(31, 60), max_new_tokens=25, stopping_criteria=[broken]))
    for t, _ in (good, bad):
        t.join()
    assert "criterion that breaks" in str(bad[1]["error"])
    assert good[1]["value"][0] == _alone(tiny_llama, tiny_tokenizer, words(30, 50), max_new_tokens=25)
    assert eng.generate(words(31, 60), max_new_tokens=3)[1].finish_reason == "length"  # the engine serves on


def test_requests_starting_with_a_running_requests_prefix_read_it_in_place(tiny_llama, tiny_tokenizer):
    eng = _engine(tiny_llama, tiny_tokenizer)
    context = words(40, 100)
    first, stop = Tokens(2), threading.Event()
    t, out = _in_thread(lambda: eng.generate(context + " w9", max_new_tokens=3000, min_new_tokens=3000, streamer=first, cancel=stop))
    assert first.after.wait(30)  # it decodes until the others are done
    others = [_in_thread(lambda q=q: eng.generate(context + " " + words(50 + q, 6), max_new_tokens=8)) for q in range(3)]
    for th, _ in others:
        th.join()
    stop.set()
    t.join()
    for q, (_, o) in enumerate(others):
        text, info = o["value"]
        assert text == _alone(tiny_llama, tiny_tokenizer, context + " " + words(50 + q, 6), max_new_tokens=8)
        assert info.shared_tokens == 96 and info.cached_tokens >= 96 and info.levels == []  # read in place, not streamed
    assert eng.prefixes.shared == 3 and len(eng.prefixes) == 0 and eng.memory.used == 0  # all let go


def test_the_kv_memory_bound_queues_requests_refuses_past_the_queue_and_never_holds_more(tiny_llama, tiny_tokenizer):
    one = _engine(tiny_llama, tiny_tokenizer).bytes_per_token
    eng = _engine(tiny_llama, tiny_tokenizer, kv_memory=one * 150, kv_queue=1)
    held = Tokens(1)
    held.hold.set()  # the first request stops in its first token, holding ~100 tokens of KV
    t, out = _in_thread(lambda: eng.generate(words(60, 80), max_new_tokens=20, streamer=held))
    while eng.memory.used == 0:
        time.sleep(0.01)
    waiting = _in_thread(lambda: eng.generate(words(61, 80), max_new_tokens=5))
    while eng.memory.waiting == 0:
        time.sleep(0.01)
    with pytest.raises(EngineBusy, match="kv_queue"):
        eng.generate(words(62, 80), max_new_tokens=5)
    with pytest.raises(TooLarge, match="kv_memory"):
        eng.generate(words(63, 200), max_new_tokens=5)
    held.hold.clear()
    for th, _ in ((t, out), waiting):
        th.join()
    assert waiting[1]["value"][0] == _alone(tiny_llama, tiny_tokenizer, words(61, 80), max_new_tokens=5)
    assert eng.memory.peak <= eng.memory.limit and eng.memory.used == 0


def test_background_work_gets_turns_while_requests_run_without_pause():
    turns = Turns(share=0.5, slice_s=0.01)
    ran = []

    def background():
        while len(ran) < 3:
            with turns.turn(timeout=5) as ok:
                assert ok
                ran.append(turns.granted.is_set())

    with turns.busy():  # a request runs throughout
        t = threading.Thread(target=background)
        t.start()
        for _ in range(200):
            time.sleep(0.005)  # a step
            turns.lend(0.005)
            if len(ran) == 3:
                break
        t.join(5)
    assert ran == [True, True, True] and turns.lent_s > 0


def test_a_chunks_levels_are_stored_while_requests_decode_without_pause(tiny_llama, tiny_tokenizer):
    store = MemoryStore()
    eng = _engine(tiny_llama, tiny_tokenizer, store=store, store_options=["raw", 1], level=1, background=True)
    prompt = words(70, 70)
    eng.generate(prompt, max_new_tokens=2)  # two chunks: raw forms now, levels in the background
    chunk = eng.chunks(prompt)[0]
    busy, cancel = Tokens(1), threading.Event()
    t, out = _in_thread(lambda: eng.generate(words(71, 40), max_new_tokens=1500, min_new_tokens=1500, streamer=busy, cancel=cancel))
    assert busy.after.wait(30)
    deadline = time.monotonic() + 60
    while store.get(blob_key(chunk.key, 1)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    stored, still_running = store.get(blob_key(chunk.key, 1)) is not None, not busy.ended
    cancel.set()
    t.join()
    assert stored and still_running  # the level was written while the long request was still decoding
    assert out["value"][1].finish_reason == "cancelled"
