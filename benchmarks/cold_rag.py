"""A cold RAG answer: a chain's first question on documents nobody indexed, against plain generation of the same prompt.

    python -m benchmarks.cold_rag [--quick] [--docs 4] [--doc-tokens 1200] [--new-tokens 8] [--repeats 3] [--data F] [--model M]

A ``format_documents`` prompt (``--docs`` LongChat transcript pieces of ``--doc-tokens`` tokens, a system line
before them, a question after) is answered by ``CacheGenLLM`` on an empty store (each time a fresh one: the
documents' caches are stored after the answer, in the background), and the same text without the markers by
the model's own greedy ``generate`` (what ``HuggingFacePipeline`` does). Rows per repeat: ``cold_total_s``,
``cold_ttft_s``, ``plain_total_s`` and their ``ratio`` (cold over plain); then a summary row with the median
ratio. Then the next question on the same documents in another order (``warm_ttft_s``, ``documents_reused``):
what storing them after the answer bought.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.common import HELD_OUT, Rows, load, parser, setup_threads, transcripts

SYSTEM = "Answer the question from these conversations.\n\n"


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="2 documents of 300 tokens, 2 repeats")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=1200)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    if args.quick:
        args.docs, args.doc_tokens, args.repeats = 2, 300, 2

    from cachegen_core.engine import KVEngine  # noqa: PLC0415
    from cachegen_core.stores import MemoryStore  # noqa: PLC0415
    from langchain_cachegen import CacheGenLLM  # noqa: PLC0415
    from langchain_cachegen.documents import format_documents, strip_markers  # noqa: PLC0415

    setup_threads()
    model, tok = load(args.model)
    texts = transcripts(args.data, HELD_OUT) or transcripts(args.data)
    docs = [tok.decode(tok(t, add_special_tokens=False)["input_ids"][: args.doc_tokens]) for t in texts[: args.docs]]
    question = "\n\nQuestion: what was the first topic of the first conversation? Answer:"
    prompt = SYSTEM + format_documents(docs) + question
    gen = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
    plain_ids = torch.tensor([tok(strip_markers(prompt))["input_ids"]])
    ratios = []
    with Rows("cold_rag", args.out, argv) as out:
        out.emit({"model": args.model, "docs": args.docs, "doc_tokens": args.doc_tokens, "prompt_tokens": plain_ids.shape[1],
                  "new_tokens": args.new_tokens})  # fmt: skip
        for repeat in range(args.repeats):
            engine = KVEngine.from_pretrained(model, tokenizer=tok, store=MemoryStore(), progress=False)
            llm = CacheGenLLM(engine=engine, generation_kwargs=gen)
            t = time.perf_counter()
            result = llm.generate([prompt]).generations[0][0]
            cold = time.perf_counter() - t
            engine.flush()  # the documents' caches, computed after the answer
            with torch.no_grad():
                t = time.perf_counter()
                model.generate(plain_ids, attention_mask=torch.ones_like(plain_ids), do_sample=False, pad_token_id=tok.eos_token_id, **gen)
                plain = time.perf_counter() - t
            again = llm.generate([SYSTEM + format_documents(docs[::-1]) + question]).generations[0][0].generation_info
            info = result.generation_info
            ratios.append(cold / plain)
            out.emit({"repeat": repeat, "cold_total_s": round(cold, 3), "cold_ttft_s": round(info["ttft_s"], 3), "plain_total_s": round(plain, 3),
                      "ratio": round(cold / plain, 3), "documents_queued_tokens": info["tokens_queued"],
                      "warm_ttft_s": round(again["ttft_s"], 3), "documents_reused": again["documents_reused"]})  # fmt: skip
            engine.close()
        out.emit({"summary": "cold over plain", "median": round(statistics.median(ratios), 3), "max": round(max(ratios), 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
