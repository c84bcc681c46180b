"""Context reuse on the RAG workload: N transcripts as contexts, each asked 3 questions, cold then warm.

    python -m benchmarks.reuse [--quick] [--stores memory disk redis] [--contexts N] [--context-tokens T] [--out F]

One JSON line per (store, run) with ``store``, ``run`` (``cold``: empty store, new
chunks stored in the background; ``warm``: the same requests again), ``requests``,
``hit_rate`` (cached / prompt tokens), ``ttft_p50_s``, ``ttft_p95_s``,
``bytes_per_context`` (every level stored), and ``miss_overhead_rel``: cold-run TTFT
of each context's first request against the plain model (no CacheGen) on the same
prompt, minus one: the price of a miss, which stays off the critical path because
chunks are stored by a background worker.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Iterator

import numpy as np

from benchmarks.common import HELD_OUT, Rows, fresh_store, load, parser, setup_threads, transcripts

QUESTIONS = [
    "What was the first topic we discussed?",
    "Which topics were about science or technology?",
    "Summarise the second topic in one sentence.",
]


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)), 4)


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="1 context of 3072 tokens, memory and disk stores")
    ap.add_argument("--stores", nargs="+", default=["memory", "disk", "redis"])
    ap.add_argument("--contexts", type=int, default=3)
    ap.add_argument("--context-tokens", type=int, default=4608)
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    with Rows("reuse", args.out, argv) as rows:
        run(args, rows)


def run(args: argparse.Namespace, rows: Rows) -> None:
    if args.quick:
        args.contexts, args.context_tokens, args.stores = 1, 3072, [s for s in args.stores if s != "redis"] or ["memory"]
    setup_threads()

    from langchain_core.messages import HumanMessage, SystemMessage  # noqa: PLC0415

    from cachegen_core.engine import GenerationInfo, KVEngine  # noqa: PLC0415
    from langchain_cachegen.chat_models import render_prompt  # noqa: PLC0415

    model, tok = load(args.model)
    texts = transcripts(args.data, HELD_OUT, args.contexts)
    contexts = [tok.decode(tok(t, add_special_tokens=False)["input_ids"][: args.context_tokens]) for t in texts]
    prompts = [[render_prompt(tok, [SystemMessage(c), HumanMessage(q)]) for q in QUESTIONS] for c in contexts]
    gen = {"max_new_tokens": args.max_new_tokens}

    plain_engine = KVEngine(model, tok, store=_NullStore(), chunk_tokens=args.chunk_tokens, background=False)
    plain = []
    for ps in prompts:
        info = GenerationInfo()
        plain_engine._generate_ids(ps[0], None, 0, time.perf_counter(), info, gen)
        plain.append(info.ttft_s)
    print(f"# plain model TTFT per context: {[round(t, 2) for t in plain]}", file=sys.stderr)

    for kind in args.stores:
        with fresh_store(kind) as store:
            engine = KVEngine.from_pretrained(model, tokenizer=tok, store=store, chunk_tokens=args.chunk_tokens)
            for run in ("cold", "warm"):
                ttfts, cached, total, first = [], 0, 0, []
                for ps in prompts:
                    for qi, ids in enumerate(ps):
                        _, info = engine.generate(ids, **gen)
                        ttfts.append(info.ttft_s)
                        cached += info.cached_tokens
                        total += info.prompt_tokens
                        if qi == 0:
                            first.append(info.ttft_s)
                engine.flush()
                stored = sum(len(store.get(k) or b"") for k in store.keys())
                rows.emit({
                    "store": kind, "run": run, "requests": len(ttfts), "hit_rate": round(cached / total, 4),
                    "ttft_p50_s": pct(ttfts, 50), "ttft_p95_s": pct(ttfts, 95),
                    "bytes_per_context": int(stored / len(prompts)),
                    "miss_overhead_rel": round(statistics.median(f / p for f, p in zip(first, plain)) - 1, 4) if run == "cold" else None,
                    "plain_ttft_p50_s": round(statistics.median(plain), 4), "context_tokens": args.context_tokens,
                    "coder": engine.codec.coder.name, "profile": engine.codec.profile_id,
                })  # fmt: skip


class _NullStore:
    """A store that holds nothing: the plain-model baseline never hits."""

    namespace = ""

    def get(self, key: str) -> None:
        return None

    def contains(self, key: str) -> bool:
        return False

    def put_many(self, items: Any) -> None:
        pass

    def keys(self, prefix: str = "") -> Iterator[str]:
        return iter(())


if __name__ == "__main__":
    main()
