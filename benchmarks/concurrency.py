"""Concurrent warm requests on one engine: requests per minute with 1, 4 and 8 threads, nothing lost or mixed up.

    python -m benchmarks.concurrency [--quick] [--store disk|memory|redis] [--concurrency 1 4 8]
                                     [--contexts N] [--context-tokens T] [--requests R] [--data F] [--out F]

The contexts (LongChat transcripts cut to T tokens, each followed by a question) are
stored first (one cold request each); then, for each concurrency c, R warm requests are
answered by c threads calling ``engine.generate`` on one engine. One JSON line per c:
``requests_per_min``, ``speedup`` (against c = 1 in the same run), first-token and total
latency, ``fetch_decode_s`` (summed over requests), ``model_s`` (time the model lock was
held: the model computes one call at a time), ``lock_wait_s`` (time threads waited for
it), ``overlap`` = (fetch_decode_s + model_s) / wall: above 1 when one request's fetch and
decode ran while another's model call computed; and ``mismatches``: answers that differ
from the sequential run's for the same prompt (must be 0), ``errors``, ``load_avg``. A first line
gives the run's settings (model, store, contexts, level, threads).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import Rows, fresh_store, parser, setup_threads, transcripts

QUESTION = " USER: What was the first topic we discussed? ASSISTANT:"


class TimedLock:
    """A lock that adds up how long it was held and how long acquirers waited (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = threading.Lock()
        self.held_s = self.wait_s = 0.0
        self._since = 0.0

    def __enter__(self) -> TimedLock:
        t = time.perf_counter()
        self._lock.acquire()
        self._since = time.perf_counter()
        with self._stats:
            self.wait_s += self._since - t
        return self

    def __exit__(self, *exc: object) -> None:
        held = time.perf_counter() - self._since
        self._lock.release()
        with self._stats:
            self.held_s += held

    def acquire(self, *args: Any, **kwargs: Any) -> bool:  # the threading.Lock interface, for code that calls it
        return self._lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self._lock.release()


def instrument(engine: Any) -> TimedLock | None:
    """Replace the engine's model lock by a ``TimedLock`` (None when the engine has no such lock)."""
    if not hasattr(engine, "_lock"):
        return None
    engine._lock = TimedLock()
    return engine._lock


def answer_all(engine: Any, prompts: Sequence[Any], order: Sequence[int], threads: int, **gen: Any) -> list[tuple[int, str, Any]]:
    """Answer ``prompts[i]`` for every i of ``order`` with ``threads`` threads; (i, text, info) in completion order."""
    work: queue.Queue[int] = queue.Queue()
    for i in order:
        work.put(i)
    out: list[tuple[int, str, Any]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                i = work.get_nowait()
            except queue.Empty:
                return
            try:
                text, info = engine.generate(prompts[i], **gen)
            except BaseException as e:  # reported by the caller: a lost request is a failure
                with lock:
                    failures.append(e)
                continue
            with lock:
                out.append((i, text, info))

    pool = [threading.Thread(target=worker, name=f"request-{n}") for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if failures:
        raise RuntimeError(f"{len(failures)} request(s) failed: {failures[0]!r}") from failures[0]
    return out


def measure(engine: Any, prompts: Sequence[Any], reference: Sequence[str], threads: int, requests: int, **gen: Any) -> dict[str, Any]:
    """One concurrency level: ``requests`` warm requests over ``threads`` threads, checked against ``reference``."""
    timed = instrument(engine)
    order = [r % len(prompts) for r in range(requests)]
    t0 = time.perf_counter()
    done = answer_all(engine, prompts, order, threads, **gen)
    wall = time.perf_counter() - t0
    infos = [info for _, _, info in done]
    fetch_decode = sum(i.fetch_s + i.decode_s for i in infos)
    model_s = timed.held_s if timed else None
    return {
        "concurrency": threads,
        "requests": len(done),
        "lost": requests - len(done),
        "wall_s": round(wall, 3),
        "requests_per_min": round(60 * len(done) / wall, 2),
        "ttft_p50_s": round(statistics.median(i.ttft_s for i in infos), 4),
        "total_p50_s": round(statistics.median(i.total_s for i in infos), 4),
        "total_max_s": round(max(i.total_s for i in infos), 4),
        "fetch_decode_s": round(fetch_decode, 3),
        "model_s": None if model_s is None else round(model_s, 3),
        "lock_wait_s": None if timed is None else round(timed.wait_s, 3),
        "overlap": None if model_s is None else round((fetch_decode + model_s) / wall, 3),
        "cached_tokens_mean": round(statistics.mean(i.cached_tokens for i in infos), 1),
        "mismatches": sum(text != reference[i] for i, text, _ in done),
        "errors": sum(len(i.errors) for i in infos),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def warm_up(engine: Any, prompts: Sequence[Any], **gen: Any) -> list[str]:
    """Store every prompt's chunks (one cold request each, stored before returning), then the sequential warm answers."""
    for p in prompts:
        engine.generate(p, **gen)
    engine.flush()
    return [engine.generate(p, **gen)[0] for p in prompts]


def run(engine: Any, prompts: Sequence[Any], levels: Sequence[int], requests: int, out: Rows | None = None, **gen: Any) -> list[dict[str, Any]]:
    """Warm the store, then one row per concurrency level (``speedup`` against the first level), emitted to ``out``."""
    out = out or Rows("concurrency")
    reference = warm_up(engine, prompts, **gen)
    rows = []
    for c in levels:
        row = measure(engine, prompts, reference, c, requests, **gen)
        row["speedup"] = round(row["requests_per_min"] / rows[0]["requests_per_min"], 3) if rows else 1.0
        out.emit(row)
        rows.append(row)
    return rows


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="2 contexts of 1536 tokens, 8 requests per level")
    ap.add_argument("--store", default="disk", choices=["disk", "memory", "redis"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--contexts", type=int, default=4)
    ap.add_argument("--context-tokens", type=int, default=4608)
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    ap.add_argument("--requests", type=int, default=16, help="warm requests per concurrency level")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--level", type=int, default=None, help="level fetched (default: the codec's)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from contextlib import ExitStack  # noqa: PLC0415

    args = arguments().parse_args(argv)
    if args.quick:
        args.contexts, args.context_tokens, args.requests, args.new_tokens = 2, 1536, 8, 8

    from cachegen_core.engine import KVEngine  # noqa: PLC0415

    cores = setup_threads()
    texts = transcripts(args.data)
    with ExitStack() as stack:
        out = stack.enter_context(Rows("concurrency", args.out, argv))
        store = stack.enter_context(fresh_store(args.store))
        t = time.perf_counter()
        engine = KVEngine.from_pretrained(args.model, store=store, chunk_tokens=args.chunk_tokens, level=args.level,
                                          background=False, progress=False)  # fmt: skip
        print(f"# loaded {args.model} in {time.perf_counter() - t:.1f} s; {cores} torch threads", file=sys.stderr)
        question = list(engine.tokenizer(QUESTION, add_special_tokens=False)["input_ids"])
        prompts = []
        for text in texts:
            ids = engine.tokenize(text)
            if len(ids) >= args.context_tokens:
                prompts.append(ids[: args.context_tokens] + question)
            if len(prompts) == args.contexts:
                break
        out.emit({"model": args.model, "store": args.store, "contexts": len(prompts), "context_tokens": args.context_tokens,
                  "chunk_tokens": args.chunk_tokens, "level": engine.level, "new_tokens": args.new_tokens,
                  "torch_threads": cores, "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]})  # fmt: skip
        run(engine, prompts, args.concurrency, args.requests, out, max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
