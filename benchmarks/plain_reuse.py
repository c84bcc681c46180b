"""A plain-text prompt's next questions (``CacheGenLLM`` after a ``PromptTemplate``): what each reuses.

    python -m benchmarks.plain_reuse [--quick] [--data F] [--contexts 500 1113 ...] [--store disk] [--out F]

One context per length in ``--contexts`` (tokens of LongChat transcript ``--transcript``, held out by default), asked the questions in
turn through ``PromptTemplate | CacheGenLLM`` with the engine's defaults (1536-token chunks, partial chunks
every 64 tokens, level 2), the store flushed between questions. Such a prompt has no message boundaries: its
next question starts wherever the context ends, often inside the last 64 tokens its first question's partial
chunk stored (issue 54: then none of that chunk was reused).

One JSON line per question: ``context_tokens``, ``question`` (0 first), ``prompt_tokens``, ``agree_tokens``
(the most leading tokens it shares with an earlier prompt of the context), ``cached_tokens``,
``recomputed_tokens``, ``ttft_s``, and on the first question ``tail_tokens`` (where its stored partial chunk
ends), ``tail_level_bytes`` (that chunk at the engine's level) and ``pointer_bytes`` (the pointers to it:
``keys/pointers.py``; 0 before they existed); on the last, ``store_bytes`` and ``store_pointer_bytes`` (every
context is asked on an empty store).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.common import HELD_OUT, Rows, fresh_store, parser, setup_threads, transcripts

TEMPLATE = "Answer from the conversation below.\n\n{context}\n\nQuestion: {question}\nAnswer:"
QUESTIONS = [
    "What was the first topic we discussed?",
    "Which topics were about science or technology?",
    "Summarise the second topic in one sentence.",
]
CONTEXTS = [500 + 613 * i for i in range(10)]  # 613 = 64 x 9 + 37: the prompts end at every other place of a 64-token step


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="3 contexts, 2 questions each")
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS, metavar="T", help="context lengths in tokens")
    ap.add_argument("--questions", type=int, default=2, help=f"questions per context (at most {len(QUESTIONS)})")
    ap.add_argument("--store", default="disk", help="memory, disk or redis")
    ap.add_argument("--transcript", type=int, default=HELD_OUT, help="the transcript the contexts are cut from (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    if args.quick:
        args.contexts, args.questions = args.contexts[:3], 2
    setup_threads()
    with Rows("plain_reuse", args.out, argv) as rows:
        run(args, rows)


def agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two prompts share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(args: argparse.Namespace, rows: Rows) -> None:
    from langchain_core.prompts import PromptTemplate  # noqa: PLC0415

    from cachegen_core.keys.chunks import blob_key  # noqa: PLC0415
    from cachegen_core.stores import MemoryStore  # noqa: PLC0415
    from cachegen_core.stores.admin import stats  # noqa: PLC0415
    from langchain_cachegen import CacheGenLLM  # noqa: PLC0415

    template = PromptTemplate.from_template(TEMPLATE)
    llm = CacheGenLLM.from_model_id(args.model, store=MemoryStore(), generation_kwargs={"max_new_tokens": args.max_new_tokens})
    engine, tok = llm.engine, llm.engine.tokenizer
    ids = tok(transcripts(args.data, args.transcript, 1)[0], add_special_tokens=False)["input_ids"]
    for n in args.contexts:
        if n > len(ids):
            print(f"# transcript {args.transcript} has {len(ids)} tokens: context of {n} skipped", file=sys.stderr)
            continue
        context, earlier = tok.decode(ids[:n]), []
        with fresh_store(args.store) as store:  # each context on an empty store: the contexts share their first tokens
            engine.store = store
            for q, question in enumerate(QUESTIONS[: args.questions]):
                prompt = template.format(context=context, question=question)
                info: dict[str, Any] = llm.generate([prompt]).generations[0][0].generation_info or {}
                engine.flush()
                mine = engine.tokenize(prompt)
                row = {"context_tokens": n, "question": q, "prompt_tokens": info["prompt_tokens"],
                       "agree_tokens": max((agree(mine, e) for e in earlier), default=0), "cached_tokens": info["cached_tokens"],
                       "recomputed_tokens": info["recomputed_tokens"], "ttft_s": round(info["ttft_s"], 4)}  # fmt: skip
                if q == 0 and (partials := engine._partials(mine)(len(mine) - len(mine) % engine.chunk_tokens)):
                    tail = partials[-1]
                    row["tail_tokens"] = tail.end
                    row["tail_level_bytes"] = len(store.get(blob_key(tail.key, engine.level)) or b"")
                    row["pointer_bytes"] = sum(len(store.get(f"{c.key}-P") or b"") for c in partials[:-1])
                if q == args.questions - 1:
                    s = stats(store, headers=False)
                    row["store_bytes"], row["store_pointer_bytes"] = s["bytes"], s.get("pointer_bytes", 0)
                rows.emit(row)
                earlier.append(mine)


if __name__ == "__main__":
    main()
