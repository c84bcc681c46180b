"""Many users at once on one engine: requests a minute, output tokens a second and first-token times against users,
the answers checked against each request alone, beside what plain transformers' batching allows here (the ceiling).

    python -m benchmarks.concurrency [--quick] [--users 1 2 4 8 16] [--new-tokens 16 64] [--modes threads asyncio]
        [--workloads shared own own-short mixed] [--arrivals together staggered] [--store memory|disk|redis] [--context-tokens N]
        [--requests-per-user N] [--baseline-requests N] [--no-ceiling] [--plot F.png] [--data F] [--model M] [--device D] [--out F]

Workloads (LongChat transcripts cut to a number of tokens, each prompt followed by a question of its user):

- ``shared``: every user asks about one stored 4,608-token context (a RAG service's documents after its prompt);
- ``own``: each user on a stored 4,608-token context of its own; ``own-short``: of 1,536 tokens;
- ``mixed``: as ``own-short``, but a quarter of the requests are on contexts never stored (cold).

For each workload and number of new tokens the contexts are stored first (one cold request each, written before
the run), then every prompt is answered alone, one after another (the sequential run: the reference answers, greedy).
The engine stores one form (``--form``: the 16-bit raw form a warm request takes on a local store by default, or a
level) and never recomputes a stored chunk as text: every run reads the same KV (which form the controller takes
follows timings), so an answer differs only by batching. Each timed run starts once what the runs before it stored
is written and the background probes their streams asked for have run.
Then, for each mode (U threads calling ``KVEngine.generate``; U asyncio tasks awaiting ``CacheGenLLM.agenerate``) and
number of users U, each user sends ``--requests-per-user`` requests one after another (a cold one in ``mixed`` is
on a context that was never stored); the one user of U = 1 sends at least ``--baseline-requests`` (the prompts of as
many users as that takes, one after another): every speedup divides by its rate, so it must not rest on two requests.
The users start together (``--arrivals together``: with answers of one length they stay in step, each request arriving
with U - 1 others, their questions' prefills queued behind each other's), or ``staggered``: user u starts u / U of a
lone request's time (the 1-user run's median latency) after the first, as a service's users arrive at their own times.
One row per (workload, new tokens, mode, arrivals, users): ``start_gap_s`` (0 together), ``requests_per_min``,
``tokens_per_s``, ``speedup`` (over 1 user of the same mode), ``ttft_p50_s``/``ttft_p95_s`` (the first token as
the user waits for it, queueing included) and total latency, ``mismatches`` (answers unlike the sequential run's),
``near_ties`` (of them, those whose first differing token followed a gap under ``NEAR_TIE`` between the sequential
run's top two logits), ``errors``, ``lost``, and ``ceiling``: U decode steps of plain transformers on the workload's
KV at once over one (``benchmarks/ceiling.py``; after the workload's timed runs, not between them), ``of_ceiling`` = speedup / ceiling. Last, a ``join`` row: 8 users
decoding on their own short contexts while a cold prompt of ``--join`` tokens arrives: their decode step alone, the
steps that also computed a piece of its prompt, and the most one of those held their next token up, in decode steps.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import Rows, fresh_store, load, parser, setup_threads, transcripts
from cachegen_core import openmp

#: The largest gap between the top two logits (the sequential run's) at a differing token that counts as a near-tie.
NEAR_TIE = 0.05
#: Context tokens of each workload, whether its users share one context, and the share of cold requests.
WORKLOADS = {"shared": (4608, True, 0.0), "own": (4608, False, 0.0), "own-short": (1536, False, 0.0), "mixed": (1536, False, 0.25)}


@dataclass(frozen=True)
class Prompts:
    """A workload's prompts (text): ``warm[u][r]`` the r-th request of user u, ``cold`` the requests never stored."""

    warm: list[list[str]]
    cold: set[str]


def question(u: int, r: int) -> str:
    return f"\n\nUSER: In one sentence, what did we say about topic number {u + 1}, point {r + 1}? ASSISTANT:"


def workload_prompts(tok: Any, texts: list[str], name: str, users: int, per_user: int, run: int = 0) -> Prompts:
    """Each user's prompts of workload ``name`` (see the module doc), contexts decoded from their first tokens; the cold
    ones start with a mark of ``run`` (a context no earlier run stored)."""
    tokens, shared, cold_share = WORKLOADS[name]
    contexts = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            contexts.append(tok.decode(ids[:tokens]))
    need = 1 if shared else users
    if not contexts:
        raise ValueError(f"no transcript has {tokens} tokens")
    contexts = [contexts[k % len(contexts)] + ("" if k < len(contexts) else f" ({k})") for k in range(max(need, len(contexts)))]
    prompts, cold, n_cold = [], set(), round(cold_share * users * per_user)
    for u in range(users):
        mine = []
        for r in range(per_user):
            prompt = (contexts[0] if shared else contexts[u]) + question(u, r)
            if u * per_user + r < n_cold:  # every fourth request: a context nobody stored
                prompt = f"Session {run}.{u}.{r}. " + prompt
                cold.add(prompt)
            mine.append(prompt)
        prompts.append(mine)
    return Prompts(prompts, cold)


def near_tie(model: Any, tok: Any, prompt: str, reference: str, answer: str) -> float | None:
    """The gap between the top two logits of the sequential run where ``answer`` first leaves ``reference``."""
    ref, got = tok(reference, add_special_tokens=False)["input_ids"], tok(answer, add_special_tokens=False)["input_ids"]
    at = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    ids = tok(prompt)["input_ids"] + ref[:at]
    with torch.no_grad():
        top = model(torch.tensor([ids], device=model.device)).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def run_threads(engine: Any, users: list[list[str]], gen: dict[str, Any], gap: float = 0.0) -> tuple[list[tuple[str, str, Any]], list[BaseException]]:
    """Each user a thread sending its prompts one after another, user u from ``u * gap`` seconds on; (prompt, text,
    info) per answer, and the failures."""
    out, failures, lock = [], [], threading.Lock()
    t0 = time.perf_counter()

    def user(u: int, prompts: list[str]) -> None:
        time.sleep(max(0.0, t0 + u * gap - time.perf_counter()))
        for p in prompts:
            try:
                text, info = engine.generate(p, **gen)
            except BaseException as e:  # noqa: BLE001  counted: a lost request is a failure
                with lock:
                    failures.append(e)
                continue
            with lock:
                out.append((p, text, info))

    pool = [threading.Thread(target=user, args=(u, mine)) for u, mine in enumerate(users)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return out, failures


def run_asyncio(llm: Any, users: list[list[str]], new_tokens: int, gap: float = 0.0) -> tuple[list[tuple[str, str, Any]], list[BaseException]]:
    """Each user an asyncio task awaiting ``llm.agenerate`` for its prompts one after another, user u from ``u * gap``
    seconds on."""
    from cachegen_core.engine import GenerationInfo  # noqa: PLC0415

    out, failures = [], []

    async def user(u: int, prompts: list[str]) -> None:
        await asyncio.sleep(u * gap)
        for p in prompts:
            try:
                result = await llm.agenerate([p], max_tokens=new_tokens)
            except BaseException as e:  # noqa: BLE001
                failures.append(e)
                continue
            g = result.generations[0][0]
            info = GenerationInfo(**{k: v for k, v in g.generation_info.items() if k in GenerationInfo.__dataclass_fields__})
            out.append((p, g.text, info))

    async def main() -> None:
        await asyncio.gather(*(user(u, mine) for u, mine in enumerate(users)))

    asyncio.run(main())
    return out, failures


def row(answers: list[tuple[str, str, Any]], failures: list[BaseException], wall: float, sent: int, reference: dict[str, str],
        model: Any, tok: Any) -> dict[str, Any]:  # fmt: skip
    """One row's figures from the answers of a run (see the module doc)."""
    infos = [info for _, _, info in answers]
    ttft, total = sorted(i.ttft_s for i in infos), sorted(i.total_s for i in infos)
    wrong = [(p, text) for p, text, _ in answers if p in reference and text != reference[p]]
    gaps = [near_tie(model, tok, p, reference[p], text) for p, text in wrong]

    def pct(xs: list[float], q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else float("nan")

    return {
        "requests": len(answers), "lost": sent - len(answers) - len(failures), "failed": len(failures), "wall_s": round(wall, 3),
        "requests_per_min": round(60 * len(answers) / wall, 2), "tokens_per_s": round(sum(i.new_tokens for i in infos) / wall, 2),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95), "total_p50_s": pct(total, 0.5), "total_p95_s": pct(total, 0.95),
        "mismatches": len(wrong), "near_ties": sum(g is not None and g < NEAR_TIE for g in gaps), "mismatch_gaps": [round(g, 4) for g in gaps if g is not None],
        "errors": sum(len(i.errors) for i in infos), "shared_tokens_mean": round(statistics.mean(i.shared_tokens for i in infos), 1) if infos else 0,
        "cached_tokens_mean": round(statistics.mean(i.cached_tokens for i in infos), 1) if infos else 0,
    }  # fmt: skip


def workload(engine: Any, model: Any, tok: Any, texts: list[str], name: str, args: Any, out: Rows, ceilings: dict) -> None:
    """Every row of one workload (see the module doc)."""
    from benchmarks.ceiling import ceiling  # noqa: PLC0415
    from langchain_cachegen import CacheGenLLM  # noqa: PLC0415

    tokens, shared, _ = WORKLOADS[name]
    runs = 0
    for new in args.new_tokens:
        gen = {"max_new_tokens": new, "min_new_tokens": new}  # every answer its full length
        llm = CacheGenLLM(engine=engine, generation_kwargs=gen)
        alone = baseline_users(args)
        every = workload_prompts(tok, texts, name, max(*args.users, alone), args.requests_per_user)
        warm = sorted({p for mine in every.warm for p in mine if p not in every.cold})
        for p in warm:
            engine.generate(p, max_new_tokens=1)  # stored before the run (the prompt's KV: what is generated is not stored)
        engine.flush()
        reference = {p: engine.generate(p, **gen)[0] for p in warm}  # the sequential run
        engine.flush()
        engine.prober.join(120)
        timed = []
        for mode in args.modes:
            base: dict[str, Any] | None = None
            for arrivals, users in [(a, u) for a in args.arrivals for u in args.users if a == args.arrivals[0] or u > 1]:
                runs += 1
                run = workload_prompts(tok, texts, name, alone if users == 1 else users, args.requests_per_user, run=runs)
                if users == 1:
                    run = Prompts([[p for mine in run.warm for p in mine]], run.cold)
                gap = base["total_p50_s"] / users if arrivals == "staggered" and base else 0.0
                sent = sum(map(len, run.warm))
                t = time.perf_counter()
                answers, failures = run_threads(engine, run.warm, gen, gap) if mode == "threads" else run_asyncio(llm, run.warm, new, gap)
                wall = time.perf_counter() - t
                engine.flush()  # what the run stored is written before the next one is timed
                engine.prober.join(120)  # and the background probes its streams asked for are done (as warm_path)
                r = {"workload": name, "context_tokens": tokens, "new_tokens": new, "mode": mode, "arrivals": arrivals,
                     "start_gap_s": round(gap, 4), "users": users, "cold_requests": sum(p in run.cold for mine in run.warm for p in mine)}  # fmt: skip
                r.update(row(answers, failures, wall, sent, reference, model, tok))
                base = base or r
                r["speedup"] = round(r["requests_per_min"] / base["requests_per_min"], 3)
                openmp.release()  # the near-tie checks ran torch here: this thread's OpenMP team would slow the next run
                timed.append(r)
        for r in timed:  # the ceilings after every timed run: plain transformers' big caches between them slowed the next
            if args.ceiling and name != "mixed":
                seen = ceilings.setdefault((tokens, shared), {})
                if r["users"] not in seen:
                    seen[r["users"]] = ceiling(model, r["users"], tokens + 24, shared)[0] if r["users"] > 1 else 1.0
                r["ceiling"], r["of_ceiling"] = round(seen[r["users"]], 3), round(r["speedup"] / seen[r["users"]], 3)
            out.emit(r)
        openmp.release()


def baseline_users(args: Any) -> int:
    """The users whose prompts the 1-user run sends one after another: at least ``--baseline-requests`` requests."""
    return max(1, -(-args.baseline_requests // args.requests_per_user))


def join_row(engine: Any, tok: Any, texts: list[str], users: int, cold_tokens: int, new: int) -> dict[str, Any]:
    """``users`` requests decoding on their own short contexts, then a cold one of ``cold_tokens`` tokens joining: how
    long their steps took while its prompt was computed beside them, in decode steps (the scheduler's trace)."""
    gen = {"max_new_tokens": new, "min_new_tokens": new}
    run = workload_prompts(tok, texts, "own-short", users, 1)
    mine = [mine[0] for mine in run.warm]
    for p in mine:
        engine.generate(p, max_new_tokens=1)
    engine.flush()
    ids = tok(" ".join(texts), add_special_tokens=False)["input_ids"]
    cold = "A new session. " + tok.decode(ids[:cold_tokens]) + question(users, 0)
    threads = [threading.Thread(target=engine.generate, args=(p,), kwargs=gen) for p in mine]
    for t in threads:
        t.start()
    while not any(d == users and n == 0 for _, _, d, n in list(engine.scheduler.trace)[-3:]):
        time.sleep(0.01)
    time.sleep(0.5)  # a few steps of theirs alone
    t0 = time.perf_counter()
    _, info = engine.generate(cold, max_new_tokens=4)
    first = t0 + info.ttft_s
    for t in threads:
        t.join()
    trace = list(engine.scheduler.trace)
    alone = [s for start, s, d, n in trace if d == users and n == 0 and start < t0]
    joined = [s for start, s, d, n in trace if d >= users and n > 0 and t0 <= start <= first]
    step = statistics.median(alone[-20:]) if alone else float("nan")
    return {"join": "cold request beside decoding ones", "users": users, "cold_prompt_tokens": info.prompt_tokens, "cold_ttft_s": round(info.ttft_s, 3),
            "decode_step_s": round(step, 4), "steps_with_pieces": len(joined), "max_step_s": round(max(joined, default=0.0), 4),
            "max_delay_steps": round(max(joined, default=step) / step - 1, 2) if alone else None}  # fmt: skip


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Requests a minute against users, per workload (users starting together), and TTFT p95 (users starting together,
    and staggered where measured: 1 user's is the same row), threads, the most new tokens."""
    from benchmarks.plotting import line_panels  # noqa: PLC0415

    rows = [r for r in rows if "workload" in r and r["mode"] == "threads"]
    new = max(r["new_tokens"] for r in rows)
    rows = [r for r in rows if r["new_tokens"] == new]

    def series(arrivals: str, key: str) -> dict[str, list[tuple[int, float]]]:
        return {w: [(r["users"], r[key]) for r in rows if r["workload"] == w and (r["users"] == 1 or r.get("arrivals", "together") == arrivals)]
                for w in WORKLOADS}  # fmt: skip

    ttft = {"TTFT p95 (s), starting together": series("together", "ttft_p95_s")}
    if any(r.get("arrivals") == "staggered" for r in rows):
        ttft["TTFT p95 (s), arriving apart"] = series("staggered", "ttft_p95_s")
    stem = path[:-4] if path.endswith(".png") else path
    line_panels({"requests a minute": series("together", "requests_per_min")}, f"{stem}.png", xlabel="users", ylabel="requests a minute", xlog=True)
    line_panels(ttft, f"{stem}-ttft.png", xlabel="users", ylabel="seconds", xlog=True)


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, device=True, quick_help="1, 2, 4 users, 8 new tokens, shared and mixed, threads")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--modes", nargs="+", default=["threads", "asyncio"], choices=["threads", "asyncio"])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--arrivals", nargs="+", default=["together"], choices=["together", "staggered"],
                    help="users start together, or staggered: a lone request's time over U apart (rows of both)")  # fmt: skip
    ap.add_argument("--store", default="memory", choices=["memory", "disk", "redis"])
    ap.add_argument("--form", default="raw", type=lambda v: v if v in ("raw", "lossless") else int(v),
                    help="the one form stored and read: raw (default) or a level")  # fmt: skip
    ap.add_argument("--requests-per-user", type=int, default=2)
    ap.add_argument("--baseline-requests", type=int, default=6, metavar="N", help="the 1-user run sends at least N requests")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="skip plain transformers' steps")
    ap.add_argument("--context-scale", type=float, default=1.0, help="scale every workload's context tokens (tests)")
    ap.add_argument("--context-tokens", type=int, default=None, metavar="N", help="every workload's context N tokens (the GPU rows: 8K)")
    ap.add_argument("--join", type=int, default=4096, metavar="TOKENS", help="then a cold prompt of TOKENS joining 8 decoding (0: not)")
    ap.add_argument("--plot", default=None, metavar="F.png")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = arguments()
    args = ap.parse_args(argv)
    if "staggered" in args.arrivals and args.users[0] != 1:
        ap.error("--arrivals staggered: --users must start with 1 (a lone request's time sets the users' gap)")
    if args.quick:
        args.users, args.new_tokens, args.modes, args.workloads, args.join = [1, 2, 4], [8], ["threads"], ["shared", "mixed"], 512
    if args.context_scale != 1.0:
        for k, (n, s, c) in list(WORKLOADS.items()):
            WORKLOADS[k] = (max(16, int(n * args.context_scale)), s, c)
    if args.context_tokens is not None:
        if args.context_tokens < 16:
            ap.error("--context-tokens: at least 16")
        for k, (_, s, c) in list(WORKLOADS.items()):
            WORKLOADS[k] = (args.context_tokens, s, c)

    from cachegen_core.engine import KVEngine  # noqa: PLC0415

    setup_threads()
    texts = transcripts(args.data)
    model, tok = load(args.model, device=args.device)
    with ExitStack() as stack:
        out = stack.enter_context(Rows("concurrency", args.out, argv))
        store = stack.enter_context(fresh_store(args.store))
        # one stored form, never text: every run reads the same KV, so an answer differs from the sequential run's only
        # by batching (which form the controller takes follows timings, and their KV differ); --form raw: the form a
        # warm request takes on a local store (warm_path), a level: one the decoder must decode
        engine = KVEngine.from_pretrained(model, tokenizer=tok, store=store, background=True, progress=False, allow_text=False,
                                          level=args.form, store_options=[args.form])  # fmt: skip
        out.emit({"model": args.model, "device": args.device, "store": args.store, "form": args.form, "torch_threads": torch.get_num_threads(),
                  "kv_memory": engine.memory.limit, "requests_per_user": args.requests_per_user,
                  "baseline_requests": baseline_users(args) * args.requests_per_user})  # fmt: skip
        ceilings: dict = {}
        for name in args.workloads:
            workload(engine, model, tok, texts, name, args, out, ceilings)
        if args.join:
            out.emit(join_row(engine, tok, texts, 8 if not args.quick else 2, args.join, 64 if not args.quick else 16))
        if args.plot:
            plot(out.rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
