"""A request asked a few seconds after a cold answer (issue 46): does it find the chunks that answer stored?

    python -m benchmarks.after_cold [--model llama-7b-shaped --device cuda] [--contexts 7680 30720] [--after-s 2]

One row per context length: an engine as ``from_pretrained`` builds it (its profile fit off: it would share the
device) answers a cold request, then the same prompt is asked ``--after-s`` seconds after that answer returned: the
chunks found (``cached_tokens``, the form of each, ``options``), its TTFT against the cold one, the chunks its writer
still had queued then. A new model's first requests beside its profile fit: ``benchmarks.first_request``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks.common import HELD_OUT, Rows, is_shaped, load, long_transcripts, parser, setup_threads

QUESTION = "\nUSER: What is the first topic we discussed? ASSISTANT:"


def _prompt(tok: Any, text: str, tokens: int) -> list[int]:
    return tok(text, add_special_tokens=True)["input_ids"][:tokens] + tok(QUESTION, add_special_tokens=False)["input_ids"]


def after_cold(args: argparse.Namespace, model: Any, tok: Any, tokens: int) -> dict[str, Any]:
    from cachegen_core.engine import KVEngine  # noqa: PLC0415
    from cachegen_core.stores import MemoryStore  # noqa: PLC0415

    ids = _prompt(tok, long_transcripts(args.data, HELD_OUT, 1, tok, tokens)[0], tokens)
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
    ap.add_argument("--contexts", type=int, nargs="+", default=[7680], help="context tokens, a row each")
    ap.add_argument("--after-s", type=float, default=2.0, help="seconds between a cold answer and the same prompt again")
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    if args.quick:
        args.contexts = [3072]
    setup_threads()
    model, tok = load(args.model, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    extra = {"model": args.model, "device": str(model.device), "random_init": is_shaped(args.model)}
    with Rows("after_cold", args.out, argv) as out:
        for tokens in args.contexts:
            out.emit({**after_cold(args, model, tok, tokens), **extra})


if __name__ == "__main__":
    main()
