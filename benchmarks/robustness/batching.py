"""Faults under load: many users batched on one engine while the store dies and comes back, a forged blob waits among
the stored chunks, and one request fails inside the batched step."""

from __future__ import annotations

import random
import threading
from typing import Any

from benchmarks.robustness.bench import HANG_S, NEW_TOKENS, Bench, Tally, counting_warnings, prompt
from benchmarks.robustness.blobs import corruptions, plant
from benchmarks.robustness.plumbing import HookedStore, redis_server
from cachegen_core.stores import RedisStore


class _Breaks:
    """A stopping criterion that raises once a request has generated a few tokens: a request failing in the step."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens

    def __call__(self, ids: Any, scores: Any) -> Any:
        if ids.shape[1] > self.prompt_tokens + 2:
            raise RuntimeError("a request's own criterion failed")
        return ids.new_zeros(1, dtype=bool)


def scenario_batched_faults(bench: Bench, users: int = 16) -> dict[str, Any]:
    """``users`` threads each ask two prompts at once on one engine and a real redis-server: the answers of a run
    without faults first; then the same run with the server killed after a few reads and restarted (empty) 0.5 s
    later, a forged blob planted in one prompt's stored chunks, and one more request whose own stopping criterion
    raises inside the batched step. Every answer must equal the no-fault run's or the plain model's (recomputed);
    none is lost; only the failing request fails."""
    tally = Tally(f"batched faults, {users} users")
    texts = [prompt(400 + i) for i in range(users)]
    with redis_server() as server, counting_warnings() as w:
        store = RedisStore(server.url, socket_timeout=1.0)
        eng = bench.engine(store)
        for t in texts:
            eng.generate(t, max_new_tokens=NEW_TOKENS)  # stored: the runs below are warm
        calm = _run(eng, texts)
        reads, restarted = [0], threading.Event()

        def kill_after_reads(key: str, value: bytes | None) -> None:
            reads[0] += 1
            if reads[0] == 4 * users:  # about half-way through the streams
                server.stop(kill=True)
                threading.Timer(0.5, lambda: (server.start(), restarted.set())).start()

        _, forge = corruptions(eng, random.Random(0))[-1]
        plant(eng, texts[1], forge, [1])  # a well-formed forgery of this model and codec, shape changed
        eng.store = HookedStore(store, on_get=kill_after_reads)
        failing = bench.tokenizer(texts[0])["input_ids"]
        stormy = _run(eng, texts, extra=(texts[0], {"stopping_criteria": [_Breaks(len(failing))]}))
        restarted.wait(HANG_S)
        eng.store = store
        for (t, text, _, error), (_, before, _, _) in zip(stormy[: len(texts)], calm):
            tally.requests += 1
            if error is not None:
                tally.crashes += 1
                tally.errors.append(f"{type(error).__name__}: {error}"[:200])
            elif text == before or text == bench.plain(t):
                tally.answered += 1
            else:
                tally.errors.append(f"wrong text: {text!r} (no faults: {before!r}, plain: {bench.plain(t)!r})")
        failed = stormy[-1][3]
        tally.extra.update(
            killed_after_reads=4 * users,
            recomputed=sum(1 for _, _, info, _ in stormy[: len(texts)] if info is not None and info.errors),
            failing_request_failed=failed is not None and "criterion failed" in str(failed),
            batched_steps=eng.scheduler.batched_steps,
        )
        tally.crashes += failed is None  # the failing request had to fail
    return tally.row(w)


def _run(eng: Any, texts: list[str], extra: tuple[str, dict[str, Any]] | None = None) -> list[tuple[str, str, Any, Any]]:
    """Every text (and ``extra``: a text and its generation settings) asked at once from threads; (text, answer, info,
    error) in order."""
    jobs = [(t, {}) for t in texts] + ([extra] if extra else [])
    out: list[Any] = [None] * len(jobs)

    def ask(i: int) -> None:
        text, gen = jobs[i]
        try:
            answer, info = eng.generate(text, max_new_tokens=NEW_TOKENS, **gen)
            out[i] = (text, answer, info, None)
        except Exception as e:  # noqa: BLE001  counted by the caller
            out[i] = (text, None, None, e)

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    return [o if o is not None else (jobs[i][0], None, None, TimeoutError("hung")) for i, o in enumerate(out)]
