"""Retrieved documents in any order: full prefill vs prefix cache vs document caches (concatenated, blended).

    python -m benchmarks.rag_reuse [--quick] [--data F] [--docs 6] [--doc-tokens 1024] [--ratios 0.05 0.15 0.3] [--epic] [--out F]

Documents are ~1K-token segments of LongChat transcripts; each prompt is an instruction, ``--docs``
documents drawn from the pool in a shuffled order (separated by a blank line), and a question.
Quality is measured as ``benchmarks.quality_size`` does, against full prefill, on the real
tokens after the prompt: the next ``--continuation`` tokens of the last document's transcript,
teacher-forced on top of each method's prompt KV (``KVEngine.prompt_kv``).

Methods: ``full-prefill`` (no cache: the reference); ``prefix-cache`` (today's reuse: complete
chunks behind the same prefix, the store warmed with the same documents in other orders);
``concat`` (document caches moved to their positions, nothing recomputed but the text between
them); ``blend-r`` (the same, then CacheBlend's selective recompute of a share ``r`` of the cached
tokens, those the question attends to most); with ``--epic``, ``epic-r`` (the same share, EPIC's pick:
each document's first tokens, ``BlendConfig(select="document_starts")``). Every engine stores and reads the raw 16-bit form
(``level="raw"``), so the rows measure reuse, not compression. TTFT is the engine's time to first token (one prompt at a time, on this
machine's cores), full prefill timed in the same run; ``ttft_speedup`` is full prefill's over the method's.

One JSON line per method: ``method``, ``recompute_ratio``, ``docs``, ``context_tokens``,
``ttft_s``, ``ppl_rel_delta``, ``top1_agreement``, ``cached_tokens`` (means over prompts), and
``ttft_speedup``, ``prompts``.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from typing import Any

import torch

from benchmarks.common import Rows, load, parser, setup_threads, transcripts
from cachegen_core.hfcompat import cache_arg

INSTRUCTION = "Answer the question using these conversation records.\n\n"
SEPARATOR = "\n\n"
QUESTION = "\n\nQuestion: how does the last record go on?\nAnswer:"


def add_prompt_options(ap: argparse.ArgumentParser, prompts: int) -> None:
    """The options that shape the prompts (documents, continuation), shared with ``blend_ablation``; ``--model``
    and ``--data`` come with :func:`benchmarks.common.parser`."""
    ap.add_argument("--docs", type=int, default=6, help="documents per prompt")
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--pool", type=int, default=12, help="documents the prompts draw from")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--continuation", type=int, default=128)


def document_pool(tok: Any, texts: list[str], doc_tokens: int, continuation: int, size: int) -> list[tuple[list[int], list[int]]]:
    """Up to ``size`` (document ids, the ids that follow it) pairs: consecutive transcript segments."""
    pool = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for at in range(0, len(ids) - doc_tokens - continuation, doc_tokens):
            pool.append((ids[at : at + doc_tokens], ids[at + doc_tokens : at + doc_tokens + continuation]))
    random.Random(0).shuffle(pool)
    return pool[:size]


def build(tok: Any, docs: list[list[int]]) -> Any:
    """A prompt: the tokenizer's leading specials, the instruction, the documents, the question."""
    from cachegen_core.keys.segments import SegmentedPrompt, tokenize_parts  # noqa: PLC0415

    text = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    lead = tokenize_parts(tok, [(INSTRUCTION, False)]).ids
    parts: list[tuple[list[int], bool]] = [(list(lead), False)]
    for i, d in enumerate(docs):
        parts += [(text(SEPARATOR), False)] * (i > 0) + [(d, True)]
    return SegmentedPrompt.from_parts([*parts, (text(QUESTION), False)])


@torch.no_grad()
def score(model: Any, kv: Any, last: int, continuation: list[int]) -> tuple[float, torch.Tensor, torch.Tensor]:
    """NLL (sum) of ``continuation`` after the prompt (its KV without the last token, then ``last``), the argmaxes,
    and by how much (log-probability) each argmax leads the runner-up."""
    past = kv.to_dynamic_cache(model.config)
    logits = model(torch.tensor([[last, *continuation[:-1]]]), **cache_arg(model, past)).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(continuation), reduction="sum").item()
    two = logits.topk(2, -1)
    return nll, two.indices[:, 0], two.values[:, 0] - two.values[:, 1]


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="2 prompts, ratios 0.15 only")
    add_prompt_options(ap, prompts=3)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.3])
    ap.add_argument("--epic", action="store_true", help="also EPIC's pick (each document's first tokens) at each ratio")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    with Rows("rag_reuse", args.out, argv) as out:
        run(args, out)


def run(args: argparse.Namespace, out: Rows) -> None:
    if args.quick:
        args.prompts, args.ratios = 2, [0.15]
    setup_threads()

    from cachegen_core.engine import KVEngine  # noqa: PLC0415
    from cachegen_core.engine.model import hf  # noqa: PLC0415
    from cachegen_core.engine.documents.blend import BlendConfig  # noqa: PLC0415
    from cachegen_core.stores import MemoryStore  # noqa: PLC0415

    model, tok = load(args.model)
    pool = document_pool(tok, transcripts(args.data), args.doc_tokens, args.continuation, args.pool)
    if len(pool) < args.docs:
        sys.exit(f"only {len(pool)} documents of {args.doc_tokens} tokens in {args.data}")
    rng = random.Random(1)
    picks = [rng.sample(range(len(pool)), args.docs) for _ in range(args.prompts)]

    def engine(store: Any, blend: Any, partial_step: int = 64) -> Any:
        return KVEngine(model, tok, store=store, level="raw", store_options=["raw"], background=False, blend=blend, partial_step=partial_step)

    doc_store = MemoryStore()
    methods: dict[tuple[str, float | None], Any] = {
        ("full-prefill", None): None,
        ("prefix-cache", None): engine(MemoryStore(), None, partial_step=0),
        ("concat", 0.0): engine(doc_store, BlendConfig(recompute_ratio=0.0)),
        **{(f"blend-{r:g}", r): engine(doc_store, BlendConfig(recompute_ratio=r)) for r in args.ratios},
        **{(f"epic-{r:g}", r): engine(doc_store, BlendConfig(recompute_ratio=r, select="document_starts")) for r in args.ratios if args.epic},
    }
    methods[("concat", 0.0)].store_documents([d for d, _ in pool])  # indexing: every document computed once, on its own
    prefix = methods[("prefix-cache", None)]
    for p in picks:  # yesterday's prompts: the same documents, in another order
        _, info = prefix.generate(build(tok, [pool[i][0] for i in rng.sample(p, len(p))]).ids, max_new_tokens=1)
        print(f"# prefix cache warmed with {info.prompt_tokens} tokens in {info.total_s:.1f} s", file=sys.stderr)
    prefix.generate(build(tok, [pool[0][0][:64]]).ids, max_new_tokens=1)  # warm-up

    tally: dict[tuple[str, float | None], dict[str, list[float]]] = {m: {} for m in methods}
    for n, p in enumerate(picks):
        prompt = build(tok, [pool[i][0] for i in p])
        cont = pool[p[-1]][1]
        ref_top = None
        for key, eng in methods.items():
            if eng is None:  # full prefill: a fresh engine with nothing stored; the model's own KV
                _, info = engine(MemoryStore(), None, partial_step=0).generate(prompt.ids, max_new_tokens=1)
                kv = hf.prefill(model, list(prompt.ids))
            else:  # the timed request, then the KV it used (a prefix cache's chunks: stored by now, as the next hit reads them)
                given = prompt if key[1] is not None else prompt.ids
                _, info = eng.generate(given, max_new_tokens=1)
                kv, _ = eng.prompt_kv(given)
            nll, top, _ = score(model, kv.slice(0, len(prompt) - 1), prompt[-1], cont)
            if ref_top is None:
                ref_top = top
            t = tally[key]
            for name, value in (("ttft_s", info.ttft_s), ("cached_tokens", info.cached_tokens), ("nll", nll),
                                ("agree", float((top == ref_top).float().mean())), ("context_tokens", len(prompt))):  # fmt: skip
                t.setdefault(name, []).append(value)
            print(f"# prompt {n}: {key[0]} ttft {info.ttft_s:.3f} s, cached {info.cached_tokens}, nll {nll / len(cont):.4f}", file=sys.stderr)

    ref = tally[("full-prefill", None)]
    for (name, ratio), t in tally.items():
        out.emit({
            "method": name,
            "recompute_ratio": ratio,
            "docs": args.docs,
            "context_tokens": round(statistics.mean(t["context_tokens"])),
            "ttft_s": round(statistics.mean(t["ttft_s"]), 4),
            "ppl_rel_delta": round(math.exp((sum(t["nll"]) - sum(ref["nll"])) / (len(t["nll"]) * args.continuation)) - 1, 5),
            "top1_agreement": round(statistics.mean(t["agree"]), 4),
            "cached_tokens": round(statistics.mean(t["cached_tokens"])),
            "ttft_speedup": round(statistics.mean(ref["ttft_s"]) / statistics.mean(t["ttft_s"]), 2),
            "prompts": len(picks),
        })  # fmt: skip


if __name__ == "__main__":
    main()
