"""Quality against size: CacheGen at every level vs fp16, uniform 8/4-bit, KIVI 2/4-bit and zstd.

    python -m benchmarks.quality_size [--quick] [--model M] [--data F] [--plot FILE.png] [--out F]

Each context is the first C tokens of a transcript; its KV is built once with the
model, passed through a method, and the next 256 tokens are scored teacher-forced on
the reconstructed KV. One JSON line per (method, level, context length): bits per
element (everything stored), size ratio vs fp16, perplexity, its relative change vs
fp16, top-1 agreement with fp16, the mean KL of the next-token distributions from fp16's
(millinats per token), and LongChat task accuracy (the transcript's question
asked on top of the reconstructed KV; does the answer name the first topic?).

Baselines (``baselines.py``): ``uniform8`` / ``uniform4`` quantise keys per channel (groups of
128 tokens) and values per token (per head), fp16 scales counted; ``kivi2`` / ``kivi4`` add
KIVI's 128-token fp16 window at the context's end (counted); ``uniform8-token`` is the weak
per-token variant of earlier results. CacheGen's bits include its profile only as the
per-model tables it names (amortised: ``docs/results.md`` says how big they are).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable

import torch

from benchmarks import baselines
from benchmarks.common import HELD_OUT, Rows, context_kv, load, parser, read_jsonl, setup_threads
from benchmarks.plotting import Panels, line_panels
from cachegen_core.hfcompat import cache_arg
from cachegen_core.kv import KVCache

QUESTION = (
    " \n USER: Great, this is the end of our discussion. Now the record ends. What is the first topic we discussed? "
    "Only give me the topic name. Do not summarize yourself. ASSISTANT:"
)
Method = Callable[[KVCache], tuple[KVCache, int]]
Scores = tuple[float, int, torch.Tensor, torch.Tensor]  # score_logp's: NLL sum, count, top-1, log-probabilities


@dataclass
class Tally:
    """Running sums for one (method, level, context length)."""

    bytes: int = 0
    elements: int = 0
    nll: float = 0.0
    kl: float = 0.0
    count: int = 0
    agree: int = 0
    correct: int = 0
    asked: int = 0
    contexts: int = 0
    seconds: float = 0.0
    answers: list[str] = field(default_factory=list)

    def add(self, nbytes: int, elements: int, scored: Scores, reference: Scores) -> None:
        """One context's size and scores (``score_logp``'s), against the fp16 KV's ``reference`` scores."""
        nll, n, top, logp = scored
        self.bytes += nbytes
        self.elements += elements
        self.nll += nll
        self.kl += kl_sum(reference[3], logp)
        self.count += n
        self.agree += int((top == reference[2]).sum())


@torch.no_grad()
def score_logp(model: Any, kv: KVCache, continuation: list[int]) -> Scores:
    """Teacher-forced NLL (sum) of ``continuation[1:]`` on top of ``kv``, the count, the argmax predictions and
    the next-token log-probabilities (float32, ``(count, vocab)``, on the model's device)."""
    dtype = next(model.parameters()).dtype
    past = kv.to(device=model.device, dtype=dtype).to_dynamic_cache(model.config)
    logits = model(torch.tensor([continuation], device=model.device), **cache_arg(model, past)).logits[0, :-1].float()
    logp = logits.log_softmax(-1)
    target = torch.tensor(continuation[1:], device=model.device)
    nll = -logp.gather(1, target[:, None]).sum().item()
    return nll, len(continuation) - 1, logits.argmax(-1).cpu(), logp


def score(model: Any, kv: KVCache, continuation: list[int]) -> tuple[float, int, torch.Tensor]:
    """``score_logp`` without the log-probabilities."""
    return score_logp(model, kv, continuation)[:3]


def kl_sum(ref_logp: torch.Tensor, logp: torch.Tensor) -> float:
    """Sum over positions of KL(reference || method) of the next-token distributions, in nats: how far a lossy KV
    moves the whole distribution, a far less noisy measure than top-1 agreement on a few thousand tokens."""
    return (ref_logp.exp() * (ref_logp - logp)).sum().item()


@torch.no_grad()
def answer(model: Any, tokenizer: Any, kv: KVCache, context: list[int], max_new_tokens: int = 24) -> str:
    """Greedy answer to the LongChat question asked after ``context`` whose KV is ``kv``."""
    q = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([context + q], device=model.device)
    dtype = next(model.parameters()).dtype
    past = kv.to(device=model.device, dtype=dtype).to_dynamic_cache(model.config)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **cache_arg(model, past),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def names_topic(answer_text: str, topic: str) -> bool:
    """Whether the answer names the topic: most of the topic's content words appear in it."""
    words = [w for w in re.findall(r"[a-z]+", topic.lower()) if w not in {"the", "of", "a", "an", "and", "in", "on", "to", "for"}]
    said = set(re.findall(r"[a-z]+", answer_text.lower()))
    return bool(words) and sum(w in said for w in words) >= max(1, math.ceil(0.6 * len(words)))


def methods(codec: Any, chunk_tokens: int, zstd_level: int = 19, only: Sequence[str] | None = None) -> dict[tuple[str, int | None], Method]:
    """Every method under test (or those named in ``only``, and ``fp16``: the reference), keyed by (name, level)."""

    def cachegen(level: int) -> Method:
        def run(kv: KVCache) -> tuple[KVCache, int]:
            parts, size = [], 0
            for s in range(0, kv.num_tokens, chunk_tokens):
                blob = codec.encode(kv.slice(s, s + chunk_tokens), level, start=s)
                size += len(blob)
                parts.append(codec.decode(blob))
            return KVCache.concat(parts), size

        return run

    out: dict[tuple[str, int | None], Method] = {("fp16", None): baselines.fp16}
    for lv in codec.levels:
        out[("cachegen", lv)] = cachegen(lv)
    out[("uniform8", None)] = lambda kv: baselines.uniform(kv, 8)
    out[("uniform4", None)] = lambda kv: baselines.uniform(kv, 4)
    out[("uniform8-token", None)] = lambda kv: baselines.uniform_per_token(kv, 8)
    out[("kivi2", None)] = lambda kv: baselines.kivi(kv, 2)
    out[("kivi4", None)] = lambda kv: baselines.kivi(kv, 4)
    if baselines.quanto_available():  # what a transformers user would pick (optional, not a dependency)
        out[("quanto4", None)] = lambda kv: baselines.quanto(kv, 4)
        out[("quanto2", None)] = lambda kv: baselines.quanto(kv, 2)
    out[("zstd", None)] = lambda kv: baselines.zstd(kv, zstd_level)
    if only is not None:
        unknown = set(only) - {name for name, _ in out}
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; known: {sorted({name for name, _ in out})}")
        out = {k: m for k, m in out.items() if k[0] == "fp16" or k[0] in only}
    return out


def evaluate(
    model: Any,
    tokenizer: Any,
    records: list[dict[str, Any]],
    context_tokens: int,
    codec: Any,
    *,
    continuation_tokens: int = 256,
    chunk_tokens: int = 1536,
    task: bool = True,
    zstd_level: int = 19,
    progress: bool = True,
    only: Sequence[str] | None = None,
) -> dict[tuple[str, int | None], Tally]:
    """Run every method on every record long enough for ``context_tokens + continuation_tokens``."""
    from tqdm import tqdm  # noqa: PLC0415

    tallies: dict[tuple[str, int | None], Tally] = {}
    ms = methods(codec, chunk_tokens, zstd_level, only)
    for rec in tqdm(records, desc=f"C={context_tokens}", disable=not progress, file=sys.stderr):
        ids = tokenizer(rec["prompt"])["input_ids"]
        if len(ids) < context_tokens + continuation_tokens:
            continue
        ctx, cont = ids[:context_tokens], ids[context_tokens : context_tokens + continuation_tokens]
        kv = context_kv(model, ctx)
        ref: Scores | None = None
        for key, method in ms.items():
            t = tallies.setdefault(key, Tally())
            t0 = time.perf_counter()
            kv_hat, size = method(kv)
            t.seconds += time.perf_counter() - t0
            scored = score_logp(model, kv_hat, cont)
            ref = scored if ref is None else ref  # fp16 comes first: the reference
            t.add(size, kv.num_elements, scored, ref)
            t.contexts += 1
            if task and rec.get("label"):
                text = answer(model, tokenizer, kv_hat, ctx)
                t.asked += 1
                t.correct += names_topic(text, rec["label"][0])
                t.answers.append(text.strip()[:80])
    return tallies


def summarise(tallies: dict[tuple[str, int | None], Tally], context_tokens: int) -> list[dict[str, Any]]:
    """One JSON-ready record per method."""
    ref = tallies[("fp16", None)]
    ref_ppl = math.exp(ref.nll / ref.count)
    out = []
    for (name, level), t in tallies.items():
        bpe = 8 * t.bytes / t.elements
        ppl = math.exp(t.nll / t.count)
        out.append(
            {
                "method": name,
                "level": level,
                "context_tokens": context_tokens,
                "n_contexts": t.contexts,
                "bits_per_element": round(bpe, 4),
                "size_ratio_vs_fp16": round(bpe / 16, 5),
                "ppl": round(ppl, 4),
                "ppl_rel_delta": round(ppl / ref_ppl - 1, 6),
                "top1_agreement": round(t.agree / t.count, 5),
                "kl_mnat_per_token": round(1000 * t.kl / t.count, 4),
                "task_accuracy": round(t.correct / t.asked, 4) if t.asked else None,
                "fp16_task_accuracy": round(ref.correct / ref.asked, 4) if ref.asked else None,
                "seconds_per_context": round(t.seconds / max(t.contexts, 1), 3),
            }
        )
    return out


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Bits per element against top-1 disagreement with fp16 (the share of next tokens unlike fp16's; log-log), a panel
    per context length, a curve per method (a row's ``label`` names it where set), cachegen's points marked with their
    level. Lossless rows (no disagreement) have no place on a log axis: left out."""
    panels: Panels = {}
    for r in sorted(rows, key=lambda r: r["context_tokens"]):
        if r["top1_agreement"] < 1:
            note = () if r.get("level") is None else (f"L{r['level']}",)
            series = panels.setdefault(f"context {r['context_tokens']} tokens", {})
            series.setdefault(r.get("label") or r["method"], []).append((r["bits_per_element"], 100 * (1 - r["top1_agreement"]), *note))
    line_panels(panels, path, xlabel="bits per element (log)", ylabel="top-1 disagreement vs fp16 (%)", xlog=True,
                bold="cachegen", hline=(1.0, "1 % (target: >= 99 % top-1)"))  # fmt: skip


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="2 contexts of 1536 tokens (< 3 minutes)")
    ap.add_argument("--first", type=int, default=HELD_OUT, help="first record used (0-9 fitted the shipped profile, 0-11 tuned the codec)")
    ap.add_argument("--last", type=int, default=25, help="one past the last record used")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1536, 4096, 7680])
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    ap.add_argument("--no-task", action="store_true", help="skip the LongChat question")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--profile",
        default=None,
        help="a profile file to code with, under the codec configuration it was fitted for (default: the model's, found as an engine finds it)",
    )
    ap.add_argument("--zstd-level", type=int, default=19)
    ap.add_argument("--methods", nargs="+", default=None, help="only these methods (fp16, the reference, always runs)")
    ap.add_argument("--plot", default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    with Rows("quality_size", args.out, argv) as out:
        run(args, out)


def run(args: argparse.Namespace, out: Rows) -> None:
    if args.quick:
        args.last, args.contexts, args.zstd_level = args.first + 2, [1536], 10
    setup_threads()

    from cachegen_core.codec.kvcodec import KVCodec  # noqa: PLC0415
    from cachegen_core.codec.config import CodecConfig  # noqa: PLC0415
    from cachegen_core.keys.fingerprint import model_fingerprint  # noqa: PLC0415
    from cachegen_core.codec.profile import Profile  # noqa: PLC0415
    from cachegen_core.codec.profiles import find_profile  # noqa: PLC0415

    model, tok = load(args.model)
    fp = model_fingerprint(model, tok)
    profile = None if args.no_profile else Profile.load(args.profile) if args.profile else find_profile(fp, CodecConfig())
    config = CodecConfig(**profile.meta["codec_config"]) if args.profile and profile else CodecConfig()  # a given profile's own
    print(f"# profile: {profile.id if profile else 'none (classes picked on each chunk)'}", file=sys.stderr)
    codec = KVCodec(config, profile, fingerprint=fp)
    records = read_jsonl(args.data)[args.first : args.last]
    rows = []
    for c in args.contexts:
        tallies = evaluate(model, tok, records, c, codec, chunk_tokens=args.chunk_tokens, task=not args.no_task,
                           zstd_level=args.zstd_level, only=args.methods)  # fmt: skip
        if not tallies:
            print(f"# no record has {c} + 256 tokens", file=sys.stderr)
            continue
        for row in summarise(tallies, c):
            row["tables"] = "profile" if profile else "inline"
            out.emit(row)
            rows.append(row)
    if args.plot and rows:
        plot(rows, args.plot)
        print(f"# plot written to {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
