"""What closes the blend's quality gap: variants of the selective recompute, measured on the same prompts.

    python -m benchmarks.blend_ablation [--quick] [--prompts 4] [--variants NAME ...] [--out F]

The prompts, the documents and the quality measure are ``benchmarks.rag_reuse``'s (``document_pool``,
``build``, ``score``: 6 documents of 1024 tokens from a pool of 12 LongChat segments, the next 128
real tokens of the last document's transcript teacher-forced; top-1 = argmax agreement with full
prefill). Full prefill is computed once per prompt, each document's KV once per preamble (rounded
through float16 as the ``raw`` stored form is), then every variant assembles the prompt's buffer
as the engine does (exact instruction, documents moved into place with ``rope.shift_keys``), runs
its recompute, prefills the question and is scored. No store, no timing: quality only.

A variant is a :class:`Variant`; the recompute share counts every cached token recomputed from the
check layer on (forced or picked) against ``ceil(ratio * cached)``; ``layer_share`` is the share of
(region token, layer) pairs computed, the layer-0 pass and layers before the check included.
The variant ``default`` runs ``blend.blend`` with ``BlendConfig()`` as ``DocumentCaches`` does
(``S:engine=1,ratio=R``: the same at ratio R with ``BlendConfig(select=S)`` when S is one of ``blend.SELECTIONS``,
as is ``NAME:engine=1,select=S``; with ``engine=1``, ``first=N`` is ``BlendConfig(sink_tokens=N)``).
Two selections that read the answer (upper bounds no engine can run, ``select=oracle-read|oracle-dev,engine=1``)
say how far any pick of the same share can go: ``oracle-read`` scores each cached token as
``blend.question_attention`` does but with the question and the 128 continuation tokens as readers,
``oracle-dev`` by how far its cached KV is from full prefill's, summed over every layer.

One JSON line per (variant, prompt) (``"row": "prompt"``; ``flip_margins``: at each token whose argmax differs
from full prefill's, by how much full prefill's argmax led its runner-up, in nats) and one summary per variant
(``"row": "summary"``: ``ppl_rel_delta`` over all prompts' tokens as rag_reuse computes it,
``top1_agreement`` mean over prompts, ``worst_top1``, ``recompute_share``, ``layer_share``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import Rows, load, parser, transcripts
from benchmarks.rag_reuse import INSTRUCTION, SEPARATOR, add_prompt_options, build, document_pool, score
from cachegen_core.codec.rotary import apply_rotary
from cachegen_core.engine.documents.blend import _attend, _heads, _masks


@dataclass(frozen=True)
class Variant:
    """One way of assembling and repairing the prompt (see module doc).

    ``ratio``: recompute budget (share of cached tokens); ``hkvd``: fill the budget with the tokens whose
    layer-``check_layer`` KV deviates most (else only the forced ones); ``metric``: ``kv``, ``k`` or ``v``;
    ``first``: the first tokens of each document always recomputed (EPIC's LegoLink); ``tail``: the last
    tokens of the last document always recomputed; ``head``: its first tokens; ``per_doc``: the budget split over documents by size
    rather than one global top-k; ``gradual``: pick ``gradual`` x the budget at the check layer and keep
    the budget's worth at the next layer (CacheBlend's gradual filtering); ``backfill``: with a check layer
    past 1, write the picked tokens' fresh KV of the layers before it too; ``preamble``: what each document
    is computed after (``bos``, ``none``, or a key of ``PREAMBLES``); ``engine``: run ``blend.blend`` with
    ``BlendConfig(recompute_ratio=ratio)`` (the shipped default) instead of this script's variant code;
    ``select``: what fills the budget: ``dev`` (the deviation), ``query`` (the attention the question's tokens pay
    to each cached token over the concatenated caches, summed over layers and heads: what the answer reads) or
    ``query*dev`` (their product, each over its mean); ``qagg``: how ``query`` pools heads and question
    tokens per layer (``sum`` of the attention, ``max``, ``vsum``: the attention times the value's norm, ``norm``:
    each head and token's attention over the region scaled to sum to 1, ``sqrt``: the sum of its square roots);
    ``qlast``: only the question's last tokens (0: all); ``qfrom``/``qto``: only layers ``[qfrom, qto)`` (0: all);
    ``rounds`` (with ``engine``): split the budget over that many blends, the question's attention scored again
    over the KV each one left. ``oracle-read`` / ``oracle-dev`` (with ``engine``): see module doc.
    """

    name: str
    ratio: float = 0.15
    hkvd: bool = True
    check_layer: int = 1
    metric: str = "kv"
    first: int = 0
    tail: int = 0
    head: int = 0
    per_doc: bool = False
    gradual: float = 0.0
    backfill: bool = False
    preamble: str = "bos"
    engine: bool = False
    select: str = "dev"
    qagg: str = "sum"
    qlast: int = 0
    qfrom: int = 0
    qto: int = 0
    rounds: int = 1


#: Content-independent texts a document can be computed after (besides the tokenizer's BOS).
PREAMBLES = {
    "sep": SEPARATOR,  # what separates documents in the prompts
    "doc": "Document:\n",
    "instr": INSTRUCTION,  # the application's own instruction (fixed, knows no document)
}

V = Variant
STAGE1 = [
    V("concat", ratio=0.0),
    V("baseline"),
    V("ratio-0.3", ratio=0.3),
    V("first4", first=4), V("first16", first=16), V("first32", first=32),
    V("first4-alone", hkvd=False, first=4), V("first16-alone", hkvd=False, first=16), V("first32-alone", hkvd=False, first=32),
    V("check2", check_layer=2), V("check4", check_layer=4), V("check4-backfill", check_layer=4, backfill=True),
    V("keys-only", metric="k"), V("values-only", metric="v"),
    V("per-doc", per_doc=True),
    V("tail64", tail=64), V("tail256", tail=256), V("tail256-alone", hkvd=False, tail=256),
    V("gradual2", gradual=2.0),
    V("pre-none", preamble="none"), V("pre-sep", preamble="sep"), V("pre-bos-sep", preamble="bos+sep"),
    V("pre-bos-doc", preamble="bos+doc"), V("pre-instr", preamble="instr"),
    V("concat-pre-instr", ratio=0.0, preamble="instr"),
]  # fmt: skip
QUICK = ["concat", "baseline", "first16", "tail64"]


def preamble_ids(tok: Any, name: str) -> tuple[int, ...]:
    """Token ids of a named preamble: ``bos``, ``none``, ``PREAMBLES`` keys, joined by ``+``."""
    out: list[int] = []
    for part in name.split("+"):
        if part == "bos":
            out.append(int(tok.bos_token_id))
        elif part != "none":
            out += tok(PREAMBLES[part], add_special_tokens=False)["input_ids"]
    return tuple(out)


def _deviation(k: torch.Tensor, v: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor, metric: str) -> torch.Tensor:
    dev = torch.zeros(k.shape[1], dtype=torch.float32)
    for new, old in [(k, old_k)] * (metric in ("kv", "k")) + [(v, old_v)] * (metric in ("kv", "v")):
        old = old.float()
        dev += (new.float() - old).pow(2).sum((0, 2)) / old.pow(2).sum((0, 2)).mean().clamp_min(1e-12)
    return dev


def _pick(dev: torch.Tensor, forced: torch.Tensor, n_pick: int, groups: list[torch.Tensor] | None) -> torch.Tensor:
    """Indices (into ``dev``) of the forced rows and the ``n_pick`` others deviating most (per group: by size)."""
    dev = dev.clone()
    dev[forced] = -math.inf
    free = ~forced
    if groups is None or n_pick == 0:
        top = torch.topk(dev, min(n_pick, int(free.sum()))).indices
    else:
        sizes = torch.tensor([int(free[g].sum()) for g in groups], dtype=torch.float64)
        quota = (sizes * n_pick / sizes.sum()).floor().long()
        for i in torch.argsort(sizes * n_pick / sizes.sum() - quota, descending=True)[: n_pick - int(quota.sum())]:
            quota[i] += 1
        top = torch.cat([g[torch.topk(dev[g], min(int(q), int(free[g].sum()))).indices] for g, q in zip(groups, quota)])
    return torch.cat([forced.nonzero().flatten(), top]).unique().sort().values


@torch.no_grad()
def query_importance(model: Any, ids: list[int], buffer: Any, start: int, end: int, agg: str = "sum", last: int = 0,
                     layers: tuple[int, int] = (0, 0)) -> torch.Tensor:  # fmt: skip
    """Attention the prompt's tokens after ``end`` (the question) pay to each token of ``[start, end)``, summed over
    layers, heads and question tokens, with the buffer's KV (the concatenated caches) before ``end``."""

    inner = model.model
    nq = len(ids) - end
    pos = torch.arange(end, len(ids))
    h = inner.embed_tokens(torch.tensor([ids[end:]]))[0]
    cos, sin = (t[0] for t in inner.rotary_emb(h[None], pos[None]))
    future = torch.arange(nq)[None, :] > torch.arange(nq)[:, None]  # causal among the question's tokens
    imp = torch.zeros(end - start)
    for li, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = apply_rotary(_heads(attn.q_proj(x), attn.head_dim), cos, sin)
        k = torch.cat([buffer.keys[li][:, :end], apply_rotary(_heads(attn.k_proj(x), attn.head_dim), cos, sin)], 1)
        v = torch.cat([buffer.values[li][:, :end], _heads(attn.v_proj(x), attn.head_dim)], 1)
        k, v = k.repeat_interleave(attn.num_key_value_groups, 0), v.repeat_interleave(attn.num_key_value_groups, 0)
        scores = q @ k.transpose(1, 2) * attn.scaling
        scores[:, :, end:] = scores[:, :, end:].masked_fill(future, -math.inf)
        p = scores.softmax(-1)
        seen = p[:, -last:, start:end] if last else p[:, :, start:end]
        if agg == "vsum":
            seen = seen * v[:, start:end].norm(dim=-1)[:, None, :]
        elif agg == "norm":  # each head and question token's attention over the region sums to 1
            seen = seen / seen.sum(-1, keepdim=True).clamp_min(1e-12)
        elif agg == "sqrt":
            seen = seen.sqrt()
        if li >= layers[0] and (not layers[1] or li < layers[1]):
            imp += seen.amax((0, 1)) if agg == "max" else seen.sum((0, 1))
        h = h + attn.o_proj((p @ v).transpose(0, 1).reshape(nq, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return imp


@torch.no_grad()
def blend_variant(model: Any, ids: list[int], buffer: Any, start: int, end: int, cached: torch.Tensor,
                  docs: list[tuple[int, int]], spec: Variant) -> tuple[int, int]:  # fmt: skip
    """``blend.blend`` with the variant's knobs; returns (cached tokens recomputed, layer-token pairs computed)."""

    n = end - start
    must = ~cached.clone()
    for s, e in docs:
        must[s - start : min(s + spec.first, e) - start] = True
    s, e = docs[-1]
    must[max(s, e - spec.tail) - start : e - start] |= spec.tail > 0
    must[s - start : min(e, s + spec.head) - start] |= spec.head > 0
    n_cached = int(cached.sum())
    extra = int((must & cached).sum())
    n_pick = max(0, math.ceil(spec.ratio * n_cached) - extra) if spec.hkvd and spec.ratio > 0 else 0
    groups = [torch.arange(s - start, e - start) for s, e in docs] if spec.per_doc else None
    inner = model.model
    layers = len(inner.layers)
    positions = torch.arange(start, end)
    h = inner.embed_tokens(torch.tensor([ids[start:end]]))[0]
    cos, sin = (t[0] for t in inner.rotary_emb(h[None], positions[None]))
    rows = torch.arange(n)
    masks = _masks(positions, end, 256)
    check = min(spec.check_layer, layers - 2)
    imp = query_importance(model, ids, buffer, start, end, spec.qagg, spec.qlast, (spec.qfrom, spec.qto)) if spec.select != "dev" else None
    early: list[tuple[torch.Tensor, torch.Tensor]] = []
    pairs = 0
    for li, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        k = apply_rotary(_heads(attn.k_proj(x), attn.head_dim), cos, sin)
        v = _heads(attn.v_proj(x), attn.head_dim)
        kbuf, vbuf = buffer.keys[li], buffer.values[li]
        if li < check:
            f = must.nonzero().flatten()
            kbuf[:, start + f], vbuf[:, start + f] = k[:, f], v[:, f]
            if spec.backfill and li > 0:
                early.append((k, v))
        else:
            narrow = li == check + 1 and spec.gradual > 0
            if li == check or narrow:
                if li == check:
                    want = n_pick if spec.gradual <= 0 else min(n_cached, math.ceil(spec.gradual * n_pick))
                    dev = _deviation(k, v, kbuf[:, start:end], vbuf[:, start:end], spec.metric)
                    if imp is not None:
                        dev = imp if spec.select == "query" else (imp / imp.mean()) * (dev / dev.mean())
                    keep = _pick(dev, must, want, groups)
                else:  # among the rows picked at the check layer, the budget's worth deviating most here
                    dev = _deviation(k, v, kbuf[:, start + rows], vbuf[:, start + rows], spec.metric)
                    sub = [torch.nonzero(torch.isin(rows, g)).flatten() for g in groups] if groups else None
                    keep = _pick(dev, must[rows], n_pick, sub)
                if li == check and spec.backfill:
                    for lj, (ek, ev) in enumerate(early, start=1):
                        buffer.keys[lj][:, start + keep] = ek[:, keep]
                        buffer.values[lj][:, start + keep] = ev[:, keep]
                rows = rows[keep]
                h, x, k, v, cos, sin = h[keep], x[keep], k[:, keep], v[:, keep], cos[keep], sin[keep]
                masks = _masks(positions[rows], end, 256)
            kbuf[:, start + rows], vbuf[:, start + rows] = k, v
        pairs += int(rows.numel())
        if not rows.numel():  # nothing selected (concatenation): no later layer computes anything
            break
        q = apply_rotary(_heads(attn.q_proj(x), attn.head_dim), cos, sin)
        o = _attend(q, kbuf[:, :end], vbuf[:, :end], masks, attn)
        h = h + attn.o_proj(o.to(h.dtype))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return int(cached[rows].sum()), pairs


@torch.no_grad()
def oracle_scores(model: Any, ids: list[int], cont: list[int], buffer: Any, start: int, end: int, cached: torch.Tensor,
                  how: str) -> torch.Tensor:  # fmt: skip
    """Scores that know the answer (see module doc): the attention the question and the continuation ``cont`` pay
    to each cached token (``oracle-read``), or its KV's distance from full prefill's over every layer (``oracle-dev``)."""
    from cachegen_core.engine.model import hf  # noqa: PLC0415
    from cachegen_core.engine.documents.blend import question_attention  # noqa: PLC0415

    if how == "oracle-read":
        return question_attention(model, [*ids, *cont], buffer, start, end, cached, len(ids) - end + len(cont))
    if how != "oracle-dev":
        raise ValueError(f"unknown oracle {how!r}")
    full, cut = hf.prefill(model, ids[:end]), slice(start, end)
    return sum(_deviation(full.keys[li][:, cut], full.values[li][:, cut], buffer.keys[li][:, cut], buffer.values[li][:, cut], "kv")
               for li in range(full.keys.shape[0]))  # fmt: skip


def doc_kv(model: Any, pre: tuple[int, ...], doc: list[int]) -> Any:
    """A document's KV computed after ``pre``, rounded through the 16-bit ``raw`` stored form."""
    from cachegen_core.engine.model import hf  # noqa: PLC0415
    from cachegen_core.kv import KVCache  # noqa: PLC0415

    kv = hf.prefill(model, [*pre, *doc]).slice(len(pre))
    r = lambda t: t.to(torch.float16 if t.abs().max() <= torch.finfo(torch.float16).max else torch.bfloat16).float()  # noqa: E731
    return KVCache(r(kv.keys), r(kv.values))


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help=f"2 prompts, variants {' '.join(QUICK)}")
    add_prompt_options(ap, prompts=4)
    ap.add_argument("--variants", nargs="+", default=None, help="names of STAGE1 variants, or specs name:field=value,...")
    ap.add_argument("--threads", type=int, default=1)
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = arguments()
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.variants = 2, args.variants or QUICK
    torch.set_num_threads(args.threads)

    from cachegen_core.engine.model import hf  # noqa: PLC0415
    from cachegen_core.engine.documents.blend import SELECTIONS, BlendConfig, blend, blend_support, forced_tokens, question_attention  # noqa: PLC0415
    from cachegen_core.engine.model.rope import shift_keys  # noqa: PLC0415
    from cachegen_core.kv import KVCache  # noqa: PLC0415
    from cachegen_core.keys.segments import document_spans  # noqa: PLC0415

    variants = [V("default", engine=True), *STAGE1]
    if args.variants:
        named = {v.name: v for v in variants}
        chosen = []
        for s in args.variants:
            name, _, fields = s.partition(":")
            base = named.get(name, V(name))
            for kv in filter(None, fields.split(",")):
                key, _, val = kv.partition("=")
                typ = type(getattr(base, key))
                base = dataclasses.replace(base, **{key: (val not in ("0", "false", "False")) if typ is bool else typ(val)})
            chosen.append(base)
        if len({v.name for v in chosen}) < len(chosen):
            ap.error("variant names must be unique (their rows are summarised by name)")
        variants = chosen
    model, tok = load(args.model)
    model.eval()
    rope = blend_support(model)
    pool = document_pool(tok, transcripts(args.data), args.doc_tokens, args.continuation, args.pool)
    rng = random.Random(1)  # rag_reuse's prompts: the same draws, in the same order
    picks = [rng.sample(range(len(pool)), args.docs) for _ in range(args.prompts)]
    docs_kv: dict[tuple[str, int], Any] = {}
    out = Rows("blend_ablation", args.out, argv)
    refs = []
    for p in picks:
        prompt = build(tok, [pool[i][0] for i in p])
        ids = list(prompt.ids)
        refs.append(score(model, hf.prefill(model, ids[:-1]), ids[-1], pool[p[-1]][1]))
        nll = refs[-1][0]
        print(f"# reference: {len(ids)} tokens, nll/token {nll / args.continuation:.4f}", file=sys.stderr)
    tally: dict[str, list[dict[str, Any]]] = {}
    for v in variants:
        pre = preamble_ids(tok, v.preamble)
        for n, p in enumerate(picks):
            prompt = build(tok, [pool[i][0] for i in p])
            ids, spans = list(prompt.ids), list(document_spans(prompt))
            start, end = spans[0][0], spans[-1][1]
            geo = hf.kv_geometry(model.config)
            buf = KVCache(torch.zeros(geo[0], geo[1], len(ids), geo[2]), torch.zeros(geo[0], geo[1], len(ids), geo[2]))
            hf.prefill_into(model, ids[:start], buf, 0)
            cached = torch.zeros(end - start, dtype=torch.bool)
            for (s, e), i in zip(spans, p):
                if (v.preamble, i) not in docs_kv:
                    docs_kv[(v.preamble, i)] = doc_kv(model, pre, pool[i][0])
                kv = KVCache(docs_kv[(v.preamble, i)].keys.clone(), docs_kv[(v.preamble, i)].values.clone())
                shift_keys(kv.keys, s - len(pre), rope)
                buf.slice(s, e).keys.copy_(kv.keys)
                buf.slice(s, e).values.copy_(kv.values)
                cached[s - start : e - start] = True
            if v.engine:  # what DocumentCaches does with this config
                select = v.select if v.select in SELECTIONS else v.name if v.name in SELECTIONS else "question"
                cfg = BlendConfig(recompute_ratio=v.ratio, select=select, sink_tokens=v.first)
                scores = question_attention(model, ids, buf, start, end, cached, cfg.question_tokens) if cfg.select == "question" else None
                if v.select.startswith("oracle"):
                    scores = oracle_scores(model, ids, pool[p[-1]][1], buf, start, end, cached, v.select)
                first = forced_tokens(cfg, spans, start, cached, question=True)
                ratio = cfg.recompute_ratio / v.rounds
                total = blend(model, ids, buf, start, end, cached, ratio, check_layer=cfg.check_layer,
                              query_block=cfg.query_block, first=first, scores=scores)  # fmt: skip
                done = torch.zeros_like(cached)
                for _ in range(v.rounds - 1):  # the picked so far: scored -inf (blend keeps the top of the rest)
                    done |= scores >= scores.topk(math.ceil(ratio * int(cached.sum()))).values[-1]
                    scores = question_attention(model, ids, buf, start, end, torch.ones_like(cached), cfg.question_tokens)
                    scores[done] = -math.inf
                    total += blend(model, ids, buf, start, end, torch.ones_like(cached), ratio * int(cached.sum()) / len(cached),
                                   check_layer=cfg.check_layer, query_block=cfg.query_block, scores=scores)  # fmt: skip
                recomputed, pairs = total - int((~cached).sum()), None
            else:
                recomputed, pairs = blend_variant(model, ids, buf, start, end, cached, spans, v)
            hf.prefill_into(model, ids[end:-1], buf, end)
            nll, top, _ = score(model, buf.slice(0, len(ids) - 1), ids[-1], pool[p[-1]][1])
            flips = top != refs[n][1]
            row = {"row": "prompt", "variant": v.name, "prompt": n, "nll": round(nll, 4),
                   "ref_nll": round(refs[n][0], 4), "top1": round(float((~flips).float().mean()), 4),
                   "flip_margins": sorted(round(float(m), 3) for m in refs[n][2][flips]),
                   "recompute_share": round(recomputed / int(cached.sum()), 4),
                   "layer_share": None if pairs is None else round(pairs / ((end - start) * len(model.model.layers)), 4)}  # fmt: skip
            tally.setdefault(v.name, []).append(row)
            out.emit(row)
        rows = tally[v.name]
        out.emit({"row": "summary", "variant": v.name, "spec": dataclasses.asdict(v), "prompts": len(rows),
              "ppl_rel_delta": round(math.exp((sum(r["nll"] for r in rows) - sum(r["ref_nll"] for r in rows))
                                              / (len(rows) * args.continuation)) - 1, 5),
              "top1_agreement": round(statistics.mean(r["top1"] for r in rows), 4),
              "worst_top1": min(r["top1"] for r in rows),
              "recompute_share": round(statistics.mean(r["recompute_share"] for r in rows), 4),
              "layer_share": None if rows[0]["layer_share"] is None else round(statistics.mean(r["layer_share"] for r in rows), 4)})  # fmt: skip
    out.close()


if __name__ == "__main__":
    main()
