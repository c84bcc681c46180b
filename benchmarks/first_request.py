"""A new model's first requests while its profile is fitted in the background, against the same without the fit.

    python -m benchmarks.first_request [--model llama-shaped:layers=4] [--dtype float32] [--device cpu|cuda]
        [--context 1536] [--requests 4] [--idle 12] [--gap 1] [--paired 0] [--data F] [--out F]

A model with no profile (a shaped random-init one by default) gets two engines on one memory store, as
``KVEngine.from_pretrained`` builds them: first ``auto_profile=False`` (no fit), which answers the context once, cold,
storing its chunks; then ``auto_profile=True``, whose fitter starts ``start_after_s`` (10 s) after the engine is
built or once it has answered. Each engine then answers ``--requests`` warm requests on the stored context, a new
question each, ``--gap`` seconds apart (the fit goes on between them); the fitting engine's first comes ``--idle``
seconds after it was built, so that its fit is running. Rows: one per engine and request (``ttft_s``,
``fitting``: whether the fit was still running when the request ended); a summary per engine: the first request's
TTFT over the median of the next ones (the target: at most 1.5), and the fitting engine's first over the other's.
The two engines' requests run minutes apart, so on a shared box their ratio carries its drift; ``--paired N`` then
times N more pairs of the fitting engine's requests, taking turns: one arriving while the fit runs, one after the
fit has paused already (the benchmark holds the request gate until it has): what the fit costs a request, the op
it was running when the request came and its hand-over, in one run.
On a 2-core CPU use ``--dtype float32``: bfloat16 matrix products run there at about 0.1 GFLOP/s.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import torch

from benchmarks.common import HELD_OUT, Rows, load, parser, setup_threads, transcripts

QUESTIONS = ["What is the first topic we discussed?", "Who spoke first?", "What did we agree on?",
             "What was the last topic?", "Which topic took longest?", "What was left open?"]  # fmt: skip


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, device=True, quick_help="a 2-layer shaped model, 2 requests")
    ap.set_defaults(model="llama-shaped:layers=4")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--context", type=int, default=1536, help="context tokens")
    ap.add_argument("--requests", type=int, default=4, help="warm requests per engine")
    ap.add_argument("--idle", type=float, default=12.0, help="seconds from the fitting engine's build to its first request")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between requests")
    ap.add_argument("--paired", type=int, default=0, help="pairs of the fitting engine's requests: arriving with the fit "
                    "running, and with it paused beforehand")  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    if args.quick:
        args.model, args.requests, args.context = "llama-shaped:layers=2,hidden=1024,intermediate=2816,heads=8", 2, 1536
    with Rows("first_request", args.out, argv) as out:
        run(args, out)


def requests(engine: Any, context: str, n: int, gap: float, name: str, out: Rows, paused: bool = False) -> list[float]:
    """``n`` warm requests on ``context``, ``gap`` seconds apart; their TTFTs. ``paused``: each after the fit has
    paused (the request gate held until it has)."""
    fitter = engine.profile_fitter
    ttfts = []
    for i in range(n):
        with engine.writer.busy() if paused else contextlib.nullcontext():
            if paused and not fitter.done.is_set():
                fitter.yielding.paused.wait(60)
            _, info = engine.generate(f"{context}\nUSER: {QUESTIONS[i % len(QUESTIONS)]} ASSISTANT:", max_new_tokens=1)
        fitting = fitter is not None and not fitter.done.is_set()
        out.emit({"engine": name, "request": i, "ttft_s": round(info.ttft_s, 4), "cached_tokens": info.cached_tokens,
                  "options": list(info.levels), "fitting": fitting, "errors": info.errors})  # fmt: skip
        ttfts.append(info.ttft_s)
        time.sleep(gap)
    return ttfts


def run(args: argparse.Namespace, out: Rows) -> None:
    from cachegen_core.engine import KVEngine  # noqa: PLC0415
    from cachegen_core.stores import MemoryStore  # noqa: PLC0415

    setup_threads()
    model, tok = load(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    text = transcripts(args.data, HELD_OUT, 1)[0]
    context = tok.decode(tok(text)["input_ids"][: args.context], skip_special_tokens=True)
    store = MemoryStore()
    plain = KVEngine.from_pretrained(model, tokenizer=tok, store=store, auto_profile=False)
    plain.generate(context, max_new_tokens=1)  # cold: the context's chunks stored
    plain.flush()
    ttft = {"no fit": requests(plain, context, args.requests, args.gap, "no fit", out)}
    plain.close()
    fitting = KVEngine.from_pretrained(model, tokenizer=tok, store=store)
    if fitting.profile_fitter is None:
        raise SystemExit(f"{args.model} has a profile already: nothing is fitted")
    time.sleep(args.idle)
    ttft["fit"] = requests(fitting, context, args.requests, args.gap, "fit", out)
    fitter = fitting.profile_fitter
    pairs: dict[str, list[float]] = {"fit running": [], "fit paused": []}
    for i in range(args.paired):
        for name in ("fit running", "fit paused") if i % 2 == 0 else ("fit paused", "fit running"):
            pairs[name] += requests(fitting, context, 1, args.gap, name, out, paused=name == "fit paused")
    pauses = fitter.yielding.pauses if hasattr(fitter, "yielding") else None
    fitting.close(timeout=0)
    for name, ts in ttft.items():
        nxt = statistics.median(ts[1:]) if len(ts) > 1 else ts[0]
        out.emit({"summary": name, "first_ttft_s": round(ts[0], 4), "next_ttft_s": round(nxt, 4),
                  "first_over_next": round(ts[0] / nxt, 3), "model": args.model, "dtype": args.dtype,
                  "context_tokens": args.context, **({"fit_pauses": pauses} if name == "fit" else {})})  # fmt: skip
    if args.paired:
        running, still = (statistics.median(pairs[k]) for k in ("fit running", "fit paused"))
        out.emit({"summary": "fit running over fit paused", "ratio": round(running / still, 3), "pairs": args.paired,
                  "running_ttft_s": round(running, 4), "paused_ttft_s": round(still, 4)})  # fmt: skip
    out.emit(
        {
            "summary": "fit over no fit",
            "first": round(ttft["fit"][0] / ttft["no fit"][0], 3),
            "next": round(statistics.median(ttft["fit"][1:] or ttft["fit"]) / statistics.median(ttft["no fit"][1:] or ttft["no fit"]), 3),
        }
    )


if __name__ == "__main__":
    main()
