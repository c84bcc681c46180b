"""What a store's budget buys: hit rate and time to first token of five ways to fill it, at budgets of 5-100 %
of the working set's fp16 bytes, over three traces (issue 31). A benchmark a cache operator would run.

    python -m benchmarks.store_budget [--quick] [--data F] [--out F.jsonl] [--plot F.png]

Policies (every one a real ``DiskCacheStore``, the default store):

- ``fp16-only``: the 16-bit form alone, least recently used evicted first (diskcache's LRU): plain fp16 KV;
- ``today``: the raw form and the default level in one eviction order, oldest stored first (the store before tiers);
- ``today-lru``: the same, least recently used first (what tiers add beyond LRU);
- ``tiered``: the default store: the raw form and the default level in two tiers, raw forms evicted first (in the
  room the levels leave; ``--raw-share`` keeps a share of the budget for them, default none);
- ``tiered-reserve``: the same with 20 % of the budget kept for raw forms;
- ``levels-only``: the default level alone (``store_options=[level]``).

Traces: ``zipf``, ``--contexts`` distinct contexts of 3-8K tokens (``--lengths``) requested in Zipf(1.0) order; ``chat``,
``--chats`` conversations growing by ``--growth`` tokens a turn, interleaved; ``rag``, questions over 4 of
``--docs`` 1K-token documents (Zipf popularity, any order: document caches and the blend).

What is measured, on this machine, with the real model and engine, its codec the one ``from_pretrained`` gives (the
model's profile; before 2026-11-28 none) (``measure``): on ``--measure``
contexts of the data (3-8K tokens, a question after them), the engine's TTFT with the first k stored
units reused (complete 1536-token chunks, then the partial chunk), less their fetch and decode:
the prefill; each unit's fetch + decode on a disk store in the raw form and at the default level (as the engine
records them in warm requests of engines that store only that form: the median of ``--reps``, after a
warm-up request); each form's blob bytes; a disk store's read of an absent key (the cost of a lost form); a
RAG prompt's TTFT with every document cached (blend) and with none. These are fitted:
prefill T(a, n) = g + alpha (n - a) + beta (n^2 - a^2) / 2 seconds (a tokens reused of n), stream seconds
proportional to tokens, bytes linear in them, every fit non-negative and in relative errors (the ``costs`` row gives
every point and the fits' errors). The model's attention is the engine's (``benchmarks.common.load``).

What is replayed (``budget_traces``): each trace's requests on a fresh store per policy and budget,
doing on it what the engine does (look up, stream the fastest stored form, store what was computed);
the store holds values of the real blobs' sizes divided by ``--scale`` under a size limit of the budget
divided by ``--scale`` (its real tiers and eviction decide what stays). A request's TTFT is the fitted
stream time of what it found + the fitted prefill of the rest, every miss's recompute counted.

JSON lines: a ``meta`` row, a ``costs`` row, one row per trace, policy and budget (``policy``,
``budget_fraction``, ``hit_rate`` (requests reusing anything), ``token_hit_rate``, ``mean_ttft_s``,
``p50_ttft_s``, ``p95_ttft_s``, ``bytes_held``, ...), and a ``targets`` row per trace.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.budget_traces import CHUNK, LEVEL, RAW, Costs, Replay, chat_trace, rag_trace, summarise, zipf_trace
from benchmarks.common import Rows, parser, read_jsonl, setup_threads
from benchmarks.plotting import Panels, line_panels
from cachegen_core.streaming.fits import fit_nonnegative

QUESTION = "\nUSER: What is the first topic we discussed? ASSISTANT:"
BUDGETS = [0.05, 0.1, 0.25, 0.5, 0.75, 1.0]
DOC_TOKENS, PER_QUESTION = 1024, 4
POLICIES: dict[str, dict[str, Any]] = {
    "fp16-only": {"forms": (RAW,), "raw_share": None, "eviction_policy": "least-recently-used"},
    "today": {"forms": (RAW, LEVEL), "raw_share": None},
    "today-lru": {"forms": (RAW, LEVEL), "raw_share": None, "eviction_policy": "least-recently-used"},
    "tiered": {"forms": (RAW, LEVEL)},  # the store's default tiers: raw forms in the room the levels leave
    "tiered-reserve": {"forms": (RAW, LEVEL), "raw_share": 0.2},  # ... with 20 % of the budget kept for them
    "levels-only": {"forms": (LEVEL,)},
}


# ---------------------------------------------------------------------------- measuring
def _units(eng: Any, ids: list[int], context: int) -> list[Any]:
    """The units a prompt of ``context`` tokens (and a short question) stores: its complete chunks, then its partial chunk."""
    from cachegen_core.keys.chunks import partial_chunks  # noqa: PLC0415

    units = eng.chunks(ids)
    full = context // CHUNK * CHUNK
    if context > full:
        cands = partial_chunks(ids, full, chunk_tokens=CHUNK, step=eng.partial_step, fingerprint=eng.fingerprint,
                               codec_id=eng.codec.codec_id, profile_id=eng.codec.profile_id or "")  # fmt: skip
        units = units + [c for c in cands if c.end == context]
    return units


def measure(model: Any, tok: Any, contexts: list[list[int]], question: list[int], docs: list[list[int]], reps: int,
            tmp: Path) -> tuple[Costs, dict[str, Any]]:  # fmt: skip
    """What the module doc lists, measured with the engine on this machine; the fitted :class:`Costs` and the points."""
    from benchmarks.rag_reuse import build  # noqa: PLC0415
    from cachegen_core.engine import KVEngine  # noqa: PLC0415
    from cachegen_core.stores import DiskCacheStore, MemoryStore  # noqa: PLC0415

    prefill: list[tuple[int, int, float]] = []
    stream: dict[Any, list[tuple[int, float]]] = {RAW: [], LEVEL: []}
    size: dict[Any, list[tuple[int, int]]] = {RAW: [], LEVEL: []}
    # the codec a user's engine codes with (``from_pretrained``): the model's profile, else steps weighted by its
    # measured sensitivity (no background fit: it would share the cores with what is timed)
    user = KVEngine.from_pretrained(model, tokenizer=tok, store=MemoryStore(), background=False)
    if getattr(user, "profile_fitter", None) is not None:
        user.profile_fitter.stop()
    codec_id, profile_id, weighted = user.codec.codec_id, user.codec.profile_id, user.codec.step_weights is not None
    print(f"# codec {codec_id}, profile {profile_id or 'none'}, step weights {weighted}", file=sys.stderr)
    # text off: each engine streams its one form (on a tiny model the controller may rightly prefer recomputing)
    pinned = {
        f: KVEngine(model, tok, user.codec, MemoryStore(), level=f, store_options=[f], background=False, blend=None, allow_text=False)
        for f in (RAW, LEVEL)
    }
    for n, ids in enumerate(contexts):
        prompt = ids + question
        eng = pinned[RAW]
        eng.store = full = MemoryStore()
        eng.generate(prompt, max_new_tokens=1)  # stores every unit's raw form
        units = _units(eng, prompt, len(ids))
        for k in range(len(units) + 1):  # the first k units stored: the engine streams them, prefills the rest
            eng.store = MemoryStore()
            eng.store.put_many([(key, full.get(key)) for u in units[:k] for key in full.keys(u.key)])
            _, info = eng.generate(prompt, max_new_tokens=1)
            assert info.cached_tokens == (units[k - 1].end if k else 0), (k, info.cached_tokens)
            prefill.append((info.cached_tokens, len(prompt), info.ttft_s - info.fetch_s - info.decode_s))
        for form, eng in pinned.items():
            eng.store = DiskCacheStore(tmp / f"measure-{n}-{form}", size_limit=1 << 40)
            eng.generate(prompt, max_new_tokens=1)  # stores every unit in this form alone
            for u in units:
                size[form].append((u.num_tokens, len(eng.store.get(f"{u.key}-L{form}"))))
            eng.generate(prompt, max_new_tokens=1)  # warm-up: the engine learns this form's costs
            runs = [eng.generate(prompt, max_new_tokens=1)[1] for _ in range(reps)]
            for info in runs:
                assert info.cached_tokens == units[-1].end and all(r["option"] == form for r in info.stream), info.stream
            for i, u in enumerate(units):  # the engine's own fetch and decode seconds of each unit, their median
                stream[form].append((u.num_tokens, statistics.median(r.stream[i]["fetch_s"] + r.stream[i]["decode_s"] for r in runs)))
            eng.store.close()
        print(f"# measured context {n + 1}/{len(contexts)}: {len(prompt)} tokens", file=sys.stderr)
    probe_store = DiskCacheStore(tmp / "probe")
    probe_store.put("x" * 64 + "-M", b"m")
    t = time.perf_counter()
    for i in range(200):
        probe_store.get(f"{i:064x}-Lraw")
    probe_s = (time.perf_counter() - t) / 200
    rag = _measure_rag(model, tok, docs, reps, tmp, build, KVEngine, DiskCacheStore)
    (g, alpha, beta), perr = fit_nonnegative([[1, n - a, (n * n - a * a) / 2] for a, n, _ in prefill], [s for *_, s in prefill])
    fits = {f: fit_nonnegative([[x] for x, _ in pts], [y for _, y in pts]) for f, pts in stream.items()}  # seconds per token
    sizes = {f: fit_nonnegative([[1, x] for x, _ in pts], [y for _, y in pts]) for f, pts in size.items()}
    costs = Costs((g, alpha, beta), {f: (0.0, c[0]) for f, (c, _) in fits.items()}, {f: tuple(c) for f, (c, _) in sizes.items()},
                  probe_s, rag, fp16_bytes_per_token=round(sizes[RAW][0][1]))  # fmt: skip
    points = {"codec": codec_id, "profile": profile_id, "step_weights": weighted,
              "prefill": prefill, "stream": {str(f): p for f, p in stream.items()}, "bytes": {str(f): p for f, p in size.items()},
              "probe_s": probe_s, "rag_miss_hit_s": rag, "prefill_fit": [g, alpha, beta], "prefill_fit_error": round(perr, 4),
              "stream_fit": {str(f): c for f, (c, _) in fits.items()}, "stream_fit_error": {str(f): round(e, 4) for f, (_, e) in fits.items()},
              "bytes_fit": {str(f): c for f, (c, _) in sizes.items()}}  # fmt: skip
    return costs, points


def _measure_rag(model: Any, tok: Any, docs: list[list[int]], reps: int, tmp: Path, build: Any, engine: Any, disk: Any) -> tuple[float, float]:
    """A RAG prompt's TTFT with no document stored, and with every one stored (raw), less their stream."""
    prompt = build(tok, docs)
    cold = engine(model, tok, store=disk(tmp / "rag-cold"), level="raw", store_options=["raw"], background=False)
    miss = cold.generate(prompt.ids, max_new_tokens=1)[1].ttft_s
    # text off: the hit reads every stored document (on a tiny model the controller may rightly prefer recomputing)
    warm = engine(model, tok, store=disk(tmp / "rag"), level="raw", store_options=["raw"], background=False, allow_text=False)
    warm.store_documents(docs)
    runs = []
    for _ in range(1 + reps):
        shuffled = build(tok, random.Random(len(runs)).sample(docs, len(docs)))
        info = warm.generate(shuffled, max_new_tokens=1)[1]
        assert info.documents_reused == len(docs), info
        runs.append(info.ttft_s - info.fetch_s - info.decode_s)
    return miss, sorted(runs)[len(runs) // 2]


def costs_from_row(row: dict[str, Any]) -> Costs:
    """The :class:`Costs` a ``costs`` row of an earlier run recorded (``--costs``)."""
    form = lambda k: int(k) if k.isdigit() else k  # noqa: E731
    return Costs(tuple(row["prefill_fit"]), {form(f): (0.0, c[0]) for f, c in row["stream_fit"].items()},  # type: ignore[arg-type]
                 {form(f): tuple(c) for f, c in row["bytes_fit"].items()}, row["probe_s"], tuple(row["rag_miss_hit_s"]),  # type: ignore[arg-type]
                 fp16_bytes_per_token=round(row["bytes_fit"][RAW][1]))  # fmt: skip


# ---------------------------------------------------------------------------- replaying
def replay(trace: Any, policy: str, fraction: float, costs: Costs, scale: float, tmp: Path, raw_share: float | None) -> dict[str, Any]:
    """One trace on a fresh store of ``policy`` and ``fraction`` of the trace's working set: its row."""
    from cachegen_core.stores import DiskCacheStore  # noqa: PLC0415

    spec = dict(POLICIES[policy])
    forms = spec.pop("forms")
    if policy == "tiered" and raw_share is not None:
        spec["raw_share"] = raw_share
    budget = fraction * trace.working_set_tokens * costs.fp16_bytes_per_token
    d = tmp / f"replay-{trace.name}-{policy}-{fraction}"
    store = DiskCacheStore(d, size_limit=max(1, round(budget / scale)), **spec)
    r = Replay(store, forms, costs, scale)
    held = []
    for i, req in enumerate(trace.requests):
        r.run(req)
        if i % 20 == 19:
            held.append(r.held()[0])
    total, raw = r.held()
    store.close()
    shutil.rmtree(d, ignore_errors=True)
    return {"trace": trace.name, "policy": policy, "raw_share": store.raw_share, "budget_fraction": fraction,
            "budget_bytes": round(budget), **summarise(r.tally, len(trace.requests)), "bytes_held": total,
            "raw_bytes_held": raw, "bytes_held_mean": round(statistics.fmean(held)) if held else total}  # fmt: skip


def targets(rows: list[dict[str, Any]], trace: str) -> dict[str, Any]:
    """Issue 31's targets on one trace: at 25 %, tiered against fp16-only; at 100 %, tiered against today's store."""
    by = {(r["policy"], r["budget_fraction"]): r for r in rows if r.get("trace") == trace}
    out: dict[str, Any] = {"kind": "targets", "trace": trace}
    if ("tiered", 0.25) in by and ("fp16-only", 0.25) in by:
        t, f = by[("tiered", 0.25)], by[("fp16-only", 0.25)]
        out["at_25_ttft_fp16_over_tiered"] = round(f["mean_ttft_s"] / t["mean_ttft_s"], 2)
        for name in ("hit_rate", "token_hit_rate"):  # None: fp16-only reused nothing
            out[f"at_25_{name}_tiered_over_fp16"] = round(t[name] / f[name], 2) if f[name] else None
    if ("tiered", 1.0) in by and ("today", 1.0) in by:
        out["at_100_ttft_today_over_tiered"] = round(by[("today", 1.0)]["mean_ttft_s"] / by[("tiered", 1.0)]["mean_ttft_s"], 3)
    return out


#: The policies in a plot's legend.
LABELS = {"fp16-only": "fp16 only", "today": "raw + level, oldest out", "today-lru": "raw + level, LRU",
          "tiered": "tiered (default)", "tiered-reserve": "tiered, 20 % for raw", "levels-only": "level only"}  # fmt: skip


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Mean TTFT against the budget (log TTFT), a panel per trace, a curve per policy, the default (tiered) bold."""
    panels: Panels = {}
    for r in rows:
        if r.get("policy") in POLICIES and "trace" in r:
            series = panels.setdefault(f"{r['trace']} trace", {label: [] for label in LABELS.values()})
            series[LABELS[r["policy"]]].append((100 * r["budget_fraction"], r["mean_ttft_s"]))
    line_panels(panels, path, xlabel="budget (% of the fp16 bytes)", ylabel="mean TTFT (s, log)", bold=LABELS["tiered"])


# ---------------------------------------------------------------------------- main
def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="fewer contexts, requests and measurements (under 15 minutes on 2 cores)")
    ap.add_argument("--measure", type=int, default=6, help="contexts the costs are measured on")
    ap.add_argument("--contexts", type=int, default=40, help="distinct contexts of the zipf trace")
    ap.add_argument("--lengths", type=int, nargs=2, default=[3072, 7936], metavar=("MIN", "MAX"),
                    help="tokens of the measured and the zipf trace's contexts (the reference model reads 8,192 positions: "
                         "the longest context and the question after it fit, docs/models.md)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=400, help="requests of the zipf and rag traces")
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--growth", type=int, default=448, help="tokens a chat's prompt grows by each turn (a multiple of 64)")
    ap.add_argument("--docs", type=int, default=40, help="documents of the rag trace")
    ap.add_argument("--budgets", type=float, nargs="+", default=BUDGETS)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--raw-share", type=float, default=None, help="the tiered policy's raw_share (default: the store's)")
    ap.add_argument("--reps", type=int, default=3, help="warm requests per measured context and form (their median)")
    ap.add_argument("--scale", type=float, default=32.0, help="the replayed store holds blobs and a budget this many times smaller")
    ap.add_argument("--tmp", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None, help="where the stores live")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--costs", default=None, metavar="F", help="take the costs row of an earlier run's output instead of measuring")
    ap.add_argument("--measure-only", action="store_true", help="measure the costs and stop (replay them later with --costs)")
    ap.add_argument("--plot", default=None, help="mean TTFT against budget, one panel per trace (PNG)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    if args.quick:
        args.measure, args.contexts, args.requests, args.chats, args.turns, args.docs, args.reps = 3, 16, 160, 4, 8, 20, 2
    setup_threads()
    with Rows("store_budget", args.out, argv) as out:
        run(args, out)


def run(args: argparse.Namespace, out: Rows) -> None:
    """Measure (or replay) the costs, then replay every trace under every policy and budget."""
    from benchmarks.common import load  # noqa: PLC0415

    model, tok = load(args.model)
    texts = read_jsonl(args.data, "prompt")
    question = tok(QUESTION, add_special_tokens=False)["input_ids"]
    assert len(question) < 64, "the question must fit in one partial-chunk step"
    lo, hi = args.lengths
    lengths = np.linspace(lo, hi, args.measure).astype(int) // 64 * 64 if args.measure > 1 else [(lo + hi) // 128 * 64]
    all_ids = [tok(t)["input_ids"] for t in texts]
    contexts = [ids[:n] for ids, n in zip((i for i in all_ids if len(i) >= hi), lengths)]
    if len(contexts) < len(lengths) and not args.costs:
        sys.exit(f"only {len(contexts)} transcripts of {hi} tokens in {args.data}")
    from benchmarks.rag_reuse import document_pool  # noqa: PLC0415

    docs = [d for d, _ in document_pool(tok, texts, DOC_TOKENS, 0, PER_QUESTION)]
    with tempfile.TemporaryDirectory(prefix="store-budget-", dir=args.tmp) as tmp:
        if args.costs:
            row = next(r for r in read_jsonl(args.costs) if r.get("kind") == "costs")
            costs = costs_from_row(row)
            out.emit({**row, "from": args.costs})
        else:
            t = time.perf_counter()
            costs, points = measure(model, tok, contexts, question, docs, args.reps, Path(tmp))
            out.emit({"kind": "costs", "seconds": round(time.perf_counter() - t, 1), **points})
        if args.measure_only:
            return
        rng = random.Random(args.seed)
        prompt_extra = len(build_rag_extra(tok))
        traces = [
            zipf_trace([rng.randrange(lo, hi + 1, 64) for _ in range(args.contexts)], args.requests, len(question), args.seed),
            chat_trace(args.chats, args.turns, 1024, args.growth, len(question), args.seed),
            rag_trace(args.docs, DOC_TOKENS, PER_QUESTION, args.requests, prompt_extra, args.seed),
        ]
        rows = []
        for trace in traces:
            for policy in args.policies:
                for fraction in args.budgets:
                    row = replay(trace, policy, fraction, costs, args.scale, Path(tmp), args.raw_share)
                    rows.append(row)
                    out.emit(row)
            out.emit(targets(rows, trace.name))
    if args.plot:
        plot(rows, args.plot)


def build_rag_extra(tok: Any) -> list[int]:
    """The tokens of a RAG prompt besides its documents: instruction, separators, question."""
    from benchmarks.rag_reuse import INSTRUCTION, QUESTION as RAG_QUESTION, SEPARATOR  # noqa: PLC0415

    return tok(INSTRUCTION + SEPARATOR * (PER_QUESTION - 1) + RAG_QUESTION, add_special_tokens=False)["input_ids"]


if __name__ == "__main__":
    main()
