"""A new engine's first seconds (issue 46): a new model's first request against its next ones, and a request
asked a few seconds after a cold answer, whether it finds the chunks that answer stored.

    python -m benchmarks.fresh_engine [--model llama-7b-shaped --device cuda] [--contexts 7680 30720] [--after-s 2]

``first-request`` row: ``KVEngine.from_pretrained`` on a model with no profile anywhere (a shaped model: none is
shipped; a fresh memory store), so its profile is fitted in the background beside the requests, then
``--requests`` cold requests on distinct held-out contexts of the first ``--contexts`` length: ``first_ttft_s``, the
next ones' median ``next_ttft_s`` and their ratio (issue 30's target: within 1.5x).

``after-cold`` rows, per context length: an engine as ``from_pretrained`` builds it (its profile fit off: it would
share the device) answers a cold request, then the same prompt is asked ``--after-s`` seconds after that answer
returned: the chunks found (``cached_tokens``, the form of each, ``options``), its TTFT against the cold one, the
chunks its writer still had queued then.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.common import HELD_OUT, Rows, is_shaped, load, long_transcripts, parser, setup_threads

QUESTION = "\nUSER: What is the first topic we discussed? ASSISTANT:"


def _prompt(tok: Any, text: str, tokens: int) -> list[int]:
    return tok(text, add_special_tokens=True)["input_ids"][:tokens] + tok(QUESTION, add_special_tokens=False)["input_ids"]


def first_request(args: argparse.Namespace, model: Any, tok: Any, tokens: int) -> dict[str, Any]:
    from cachegen_core.engine import KVEngine  # noqa: PLC0415
    from cachegen_core.stores import MemoryStore  # noqa: PLC0415

    prompts = [_prompt(tok, t, tokens) for t in long_transcripts(args.data, HELD_OUT, args.requests, tok, tokens)]
    t = time.perf_counter()
    engine = KVEngine.from_pretrained(model, tokenizer=tok, store=MemoryStore(), chunk_tokens=args.chunk_tokens)
    built_s = time.perf_counter() - t
    ttfts = [engine.generate(ids, max_new_tokens=1)[1].ttft_s for ids in prompts]
    fitting = engine.profile_fitter is not None and not engine.profile_fitter.done.is_set()
    row = {"policy": "first-request", "context_tokens": tokens, "engine_build_s": round(built_s, 3), "ttft_s": [round(x, 4) for x in ttfts],
           "first_ttft_s": round(ttfts[0], 4), "next_ttft_s": round(statistics.median(ttfts[1:]), 4) if len(ttfts) > 1 else None,
           "fit_running_after": fitting, "fitting": engine.profile_fitter is not None}  # fmt: skip
    if row["next_ttft_s"]:
        row["first_over_next"] = round(ttfts[0] / row["next_ttft_s"], 3)
    engine.close(timeout=0)
    return row


def after_cold(args: argparse.Namespace, model: Any, tok: Any, tokens: int) -> dict[str, Any]:
    from cachegen_core.engine import KVEngine  # noqa: PLC0415
    from cachegen_core.stores import MemoryStore  # noqa: PLC0415

    ids = _prompt(tok, long_transcripts(args.data, HELD_OUT + args.requests, 1, tok, tokens)[0], tokens)
    engine = KVEngine.from_pretrained(model, tokenizer=tok, store=MemoryStore(), chunk_tokens=args.chunk_tokens, auto_profile=False)
    engine.generate(ids[: args.chunk_tokens + 1], max_new_tokens=1)  # first-call costs paid (kernels, buffers), off the row
    _, cold = engine.generate(ids, max_new_tokens=1)
    answered = time.perf_counter()
    time.sleep(max(0.0, args.after_s - (time.perf_counter() - answered)))
    queued = engine.writer.stats.get("queued", 0)
    _, warm = engine.generate(ids, max_new_tokens=1)
    row = {"policy": "after-cold", "context_tokens": tokens, "after_s": args.after_s, "cold_ttft_s": round(cold.ttft_s, 4),
           "cold_total_s": round(cold.total_s, 4), "chunks_queued": cold.chunks_queued, "writer_queued_then": queued,
           "ttft_s": round(warm.ttft_s, 4), "cached_tokens": warm.cached_tokens, "options": list(warm.levels),
           "bytes": warm.bytes_fetched, "fetch_s": round(warm.fetch_s, 4), "decode_s": round(warm.decode_s, 4),
           "cold_over_warm": round(cold.ttft_s / warm.ttft_s, 3) if warm.ttft_s else None}  # fmt: skip
    engine.close(timeout=0)
    return row


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, device=True, quick_help="a 3K context, 3 requests")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="the model's dtype (default: as saved)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[7680], help="context tokens of the after-cold rows (the first: of every row)")
    ap.add_argument("--requests", type=int, default=4, help="cold requests after the engine is built (first-request row)")
    ap.add_argument("--after-s", type=float, default=2.0, help="seconds between a cold answer and the same prompt again")
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    ap.add_argument("--skip", nargs="*", default=[], choices=["first-request", "after-cold"], help="rows not to measure")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    if args.quick:
        args.contexts, args.requests = [3072], 3
    setup_threads()
    model, tok = load(args.model, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    extra = {"model": args.model, "device": str(model.device), "random_init": is_shaped(args.model)}
    with Rows("fresh_engine", args.out, argv) as out:
        if "after-cold" not in args.skip:
            for tokens in args.contexts:
                out.emit({**after_cold(args, model, tok, tokens), **extra})
        if "first-request" not in args.skip:  # last: the fit it starts goes on in the background
            out.emit({**first_request(args, model, tok, args.contexts[0]), **extra})


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # the profile fit may still run in its thread: not into the interpreter's shutdown
