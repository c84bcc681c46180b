"""Selective recompute (CacheBlend, EuroSys'25): documents cached on their own made to attend to each other.

Documents whose KV was computed each on its own and moved to their positions in a prompt
(``rope.shift_keys``) have the right KV at layer 0 (it depends on the token and its position
only), but from layer 1 on each token's KV ignores the documents before it. :func:`blend`
repairs the tokens where that matters most: it runs layer 0 for every token of the region,
compares the layer-``check_layer`` keys and values it gets with the cached ones, keeps the
tokens that deviate most (``ratio`` of the cached tokens), and recomputes those through the
remaining layers with attention over the whole blended KV, overwriting their KV in place.
With ``scores`` (:func:`question_attention`: how much the question after the documents attends
to each token over the concatenated caches) the tokens scoring highest are kept instead of the
deviating ones, picked before layer 0 (no pass over the others: it only serves the deviation).
Cached tokens given as ``first`` (:func:`forced_tokens`: the document right before the question, or
each document's first tokens as EPIC picks them, :func:`document_starts`) are recomputed before any
picked, within the same budget.
Tokens with no cached KV (text between documents, documents not in the store) are always
recomputed, through every layer. Every other token keeps its cached KV at every layer, so
``ratio=0`` with nothing to force leaves the KV as it is (plain concatenation) and
``ratio=1`` recomputes what a full prefill computes.

Built from the model's own modules (embeddings, rotary embedding, each decoder layer's
norms, projections and MLP) for the Llama family; :func:`blend_support` says why any other
model is refused (the engine then prefills instead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...codec.rotary import apply_rotary
from ...kv import KVCache
from ..model.rope import Rope, rope_of

#: Architectures whose decoder layers are Llama's (pre-norm, q/k/v/o projections, RoPE by rotate_half, MLP).
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})
_HAS_GQA = "enable_gqa" in (torch.nn.functional.scaled_dot_product_attention.__doc__ or "")
#: What a blend's budget goes to (``BlendConfig.select``).
SELECTIONS = ("question", "last_document", "deviation", "document_starts")


@dataclass(frozen=True)
class BlendConfig:
    """How prompts with documents are assembled from document caches.

    ``recompute_ratio``: share of the cached document tokens recomputed (0: concatenation);
    ``check_layer``: the layer whose KV deviation picks them (>= 1: layer 0's KV does not depend
    on the context); ``min_document_tokens``: shorter documents are plain text;
    ``query_block``: queries per attention block (bounds memory).

    ``select``: which cached tokens the budget goes to.
    ``"question"`` (default): those the question attends to most (:func:`question_attention`: the
    last ``question_tokens`` tokens after the documents, every layer, over the concatenated caches);
    a prompt that ends with a document falls back to ``"last_document"``.
    ``"last_document"``: the region's last document first (all of it when it fits; else its first
    ``head_tokens`` and as many of its last tokens as the budget leaves), then the deviation.
    ``"deviation"``: the tokens whose KV deviates most at ``check_layer`` (CacheBlend as published).
    ``"document_starts"``: each document's first tokens, the budget split evenly over the documents (EPIC's
    pick, ICML'25: the attention sinks a document computed on its own has in the wrong place).
    ``sink_tokens``: each document's first ``sink_tokens`` recomputed before the selection picks the rest
    of the budget (EPIC's sinks beside another rule; 0: none).
    Measured on SmolLM2-135M (``benchmarks.blend_ablation``, rag_reuse's prompts, 4 prompts of
    6 x 1024 tokens, 15 %), perplexity and top-1 agreement against full prefill: deviation +14.6 %
    and 92.6 % (any check layer, keys or values, per document, gradually filtered: within a point);
    last document +1.8 % and 93.5 %; question +0.8 % and 95.9 % (``benchmarks.rag_reuse``, 3 prompts:
    -0.02 % and 96.9 %; 6 prompts: +1.7 % and 94.3 %): what the answer reads is where the context each
    cached document lacked matters.
    Top-1 agreement >= 97 % takes 50-70 % recomputed on this model: selections that know the answer (upper
    bounds) give 92-93 % at 15 % (``docs/history/2026-11-24-results-journal.md``, "How far any pick of 15 % can go").
    """

    recompute_ratio: float = 0.15
    check_layer: int = 1
    min_document_tokens: int = 16
    query_block: int = 256
    select: str = "question"
    question_tokens: int = 64
    head_tokens: int = 128
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if self.check_layer < 1:
            raise ValueError("check_layer must be >= 1 (layer 0's KV does not depend on the context)")
        if self.min_document_tokens < 1 or self.query_block < 1:
            raise ValueError("min_document_tokens and query_block must be >= 1")
        if self.head_tokens < 0 or self.sink_tokens < 0 or self.question_tokens < 1:
            raise ValueError(
                "head_tokens and sink_tokens must be >= 0 and question_tokens >= 1, got "
                f"{self.head_tokens}, {self.sink_tokens}, {self.question_tokens}"
            )
        if self.select not in SELECTIONS:
            raise ValueError(f"select must be one of {SELECTIONS}, got {self.select!r}")


#: The blend's quality choices, by name (``KVEngine(blend=...)``, ``from_model_id(blend=...)``): ``"fast"`` (the
#: default) and ``"balanced"`` recompute the shares of the cached document tokens that held perplexity within +2 %
#: and +0.5 % of full prefill on the dev transcripts (``docs/results.md``, "The presets, and EPIC's pick"); ``"exact"`` blends
#: nothing: documents are plain text, reused only inside a stored prefix, so answers are the no-cache answers up to
#: the stored level's own loss (none at ``level="lossless"`` on a 16-bit model).
PRESETS: dict[str, BlendConfig | None] = {
    "fast": BlendConfig(recompute_ratio=0.15),
    "balanced": BlendConfig(recompute_ratio=0.25),
    "exact": None,
}


def blend_config(blend: BlendConfig | str | None) -> BlendConfig | None:
    """The configuration a preset's name stands for (a ``BlendConfig`` as it is; None as ``"exact"``)."""
    if blend is None or isinstance(blend, BlendConfig):
        return blend
    if blend not in PRESETS:
        raise ValueError(f"blend must be one of {sorted(PRESETS)} or a BlendConfig, got {blend!r}")
    return PRESETS[blend]


def budget(cached: torch.Tensor, ratio: float) -> int:
    """How many cached tokens a blend at ``ratio`` recomputes: ``ceil(ratio * cached)``."""
    return math.ceil(ratio * int(cached.sum())) if ratio > 0 else 0


def last_document_first(spans: Sequence[tuple[int, int]], start: int, cached: torch.Tensor, ratio: float, head_tokens: int) -> torch.Tensor:
    """The cached tokens of the last document of the region ``[start, start + len(cached))`` (``spans``: the
    prompt's document spans) that a blend at ``ratio`` recomputes first (bool per region token): all of them
    when they fit the budget, else the first ``head_tokens`` and the last ones the budget leaves."""
    first = torch.zeros_like(cached, dtype=torch.bool)
    end = start + len(cached)
    inside = [(max(s, start), min(e, end)) for s, e in spans if s < end and e > start]
    n = budget(cached, ratio)
    if not inside or n == 0:
        return first
    s, e = max(inside)
    at = cached[s - start : e - start].nonzero().flatten() + (s - start)
    if len(at) > n:
        head = min(head_tokens, n)
        at = torch.cat([at[:head], at[len(at) - (n - head) :]])
    first[at] = True
    return first


def _inside(spans: Sequence[tuple[int, int]], start: int, n: int) -> list[tuple[int, int]]:
    """The parts of ``spans`` inside the region ``[start, start + n)``."""
    return [(max(s, start), min(e, start + n)) for s, e in spans if s < start + n and e > start]


def document_starts(spans: Sequence[tuple[int, int]], start: int, cached: torch.Tensor, n: int) -> torch.Tensor:
    """EPIC's pick: the first cached tokens of each document of the region ``[start, start + len(cached))``, ``n`` in
    all split evenly over them (the first ones get the remainder; a document shorter than its share gives all its
    tokens, the rest is not carried over); bool per region token."""
    first = torch.zeros_like(cached, dtype=torch.bool)
    inside = _inside(spans, start, len(cached))
    for i, (s, e) in enumerate(inside):
        share = n // len(inside) + (i < n % len(inside))
        first[(cached[s - start : e - start].nonzero().flatten() + (s - start))[:share]] = True
    return first


def forced_tokens(config: BlendConfig, spans: Sequence[tuple[int, int]], start: int, cached: torch.Tensor,
                  question: bool) -> torch.Tensor | None:  # fmt: skip
    """The cached tokens of the region a blend with ``config`` recomputes before it picks any (bool per region token;
    None: none): EPIC's document starts (the whole budget), the last document (``"last_document"``, or
    ``"question"`` when no ``question`` follows the region to score with), and each document's first ``sink_tokens``."""
    n = budget(cached, config.recompute_ratio)
    first = None
    if config.select == "document_starts":
        first = document_starts(spans, start, cached, n)
    elif config.select == "last_document" or (config.select == "question" and not question):
        first = last_document_first(spans, start, cached, config.recompute_ratio, config.head_tokens)
    if config.sink_tokens and n:
        sinks = document_starts(spans, start, cached, min(n, config.sink_tokens * len(_inside(spans, start, len(cached)))))
        first = sinks if first is None else first | sinks
    return first


@torch.no_grad()
def question_attention(model: Any, ids: Sequence[int], buffer: KVCache, start: int, end: int, cached: torch.Tensor,
                       last: int = 64) -> torch.Tensor:  # fmt: skip
    """How much the prompt's last ``last`` tokens after ``end`` (the question) attend to each token of ``[start, end)``:
    the square root of their attention summed over every layer, head and question token (float, ``end - start``;
    zeros when no token follows ``end``). The root spreads the pick past the few tokens a head attends to most:
    perplexity +0.8 / +1.7 % against +1.9 / +2.7 % for the plain sum (``benchmarks.blend_ablation``, 4 / 6 prompts).
    Computed over ``buffer``'s KV before ``end`` (exact before ``start``, the caches where ``cached``; the region's
    other tokens, not computed yet, and any question token before the last ``last`` are left out), the question's
    own KV computed on the way and not written."""
    inner, device = model.model, buffer.keys.device
    scores = torch.zeros(end - start, dtype=torch.float32, device=device)
    at = max(end, len(ids) - last)
    if at >= len(ids):
        return scores
    nq = len(ids) - at
    pos = torch.arange(at, len(ids), device=device)
    h = inner.embed_tokens(torch.tensor([list(ids[at:])], device=device))[0]
    cos, sin = (t[0] for t in inner.rotary_emb(h[None], pos[None]))
    hidden = torch.zeros(nq, end + nq, dtype=torch.bool)  # keys a question token does not see
    hidden[:, start:end] = ~cached.cpu().bool()
    hidden[:, end:] = torch.ones(nq, nq, dtype=torch.bool).triu(1)
    hidden = hidden.to(device)
    for li, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = apply_rotary(_heads(attn.q_proj(x), attn.head_dim), cos, sin)
        k = torch.cat([buffer.keys[li][:, :end], apply_rotary(_heads(attn.k_proj(x), attn.head_dim), cos, sin).to(buffer.keys.dtype)], 1)
        v = torch.cat([buffer.values[li][:, :end], _heads(attn.v_proj(x), attn.head_dim).to(buffer.values.dtype)], 1)
        q = q.reshape(k.shape[0], -1, attn.head_dim).to(k.dtype)  # a KV head's query heads side by side: no key copied
        logits = (q @ k.transpose(1, 2)).float() * attn.scaling
        p = logits.masked_fill(hidden.repeat(attn.num_key_value_groups, 1), -math.inf).softmax(-1)  # (kv heads, groups * nq, keys)
        scores += p[:, :, start:end].sqrt().sum((0, 1))
        o = (p.to(v.dtype) @ v).reshape(-1, nq, attn.head_dim).transpose(0, 1).reshape(nq, -1)
        h = h + attn.o_proj(o.to(h.dtype))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return scores


def blend_support(model: Any) -> Rope | str:
    """The model's RoPE when :func:`blend` can run on it, else why it cannot."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in LLAMA_FAMILY:
        return f"model type {kind!r} is not of the Llama family {sorted(LLAMA_FAMILY)}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention is not supported"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "rotary_emb")):
        return f"{type(model).__name__} lacks model.embed_tokens, model.layers or model.rotary_emb"
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        parts = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "num_key_value_groups", "head_dim")
        if attn is None or not all(hasattr(attn, a) for a in parts) or hasattr(attn, "q_norm"):
            return f"decoder layer of {type(layer).__name__} is not Llama's (q/k/v/o projections, no q/k norms)"
        if not all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return f"decoder layer of {type(layer).__name__} lacks Llama's norms or MLP"
    return rope_of(model)


def _select(k: torch.Tensor, v: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor, forced: torch.Tensor, n_pick: int,
            scores: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The forced tokens and the ``n_pick`` others scoring highest (``scores``, else how much their fresh K and V
    (kv_heads, n, dim) deviate from the cached ones, each deviation relative to the cached tensors' mean squared
    norm per token); sorted indices."""
    if scores is not None:
        dev = scores.to(device=k.device, dtype=torch.float32).clone()
    else:
        dev = torch.zeros(k.shape[1], dtype=torch.float32, device=k.device)
        for new, old in ((k, old_k), (v, old_v)):
            old = old.float()
            dev += (new.float() - old).pow(2).sum((0, 2)) / old.pow(2).sum((0, 2)).mean().clamp_min(1e-12)
    dev[forced] = -math.inf
    top = torch.topk(dev, n_pick).indices if n_pick else forced[:0]
    return torch.cat([forced, top]).sort().values


def _heads(x: torch.Tensor, dim: int) -> torch.Tensor:
    """(tokens, heads * dim) -> (heads, tokens, dim)."""
    return x.view(x.shape[0], -1, dim).transpose(0, 1)


def _masks(pos: torch.Tensor, end: int, block: int) -> list[tuple[slice, torch.Tensor]]:
    """Per block of queries at (sorted) positions ``pos``: its slice and its causal mask over the keys up to its
    last query (keys past it are masked for every query of the block: left out, not computed)."""
    at = torch.arange(end, device=pos.device)
    out = []
    for s in range(0, len(pos), block):
        rows = pos[s : s + block]
        out.append((slice(s, s + block), at[None, : int(rows.max()) + 1] <= rows[:, None]))
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, masks: list[tuple[slice, torch.Tensor]], attn: Any) -> torch.Tensor:
    """Attention of queries ``q`` (heads, n, dim) over ``keys``/``values`` (kv_heads, end, dim) under ``masks``
    (see :func:`_masks`: each block over the keys its mask spans); returns (n, heads * dim). Batched 4-D
    inputs: the CPU's fused kernel takes them (3-D ones fall back to a kernel several times slower)."""
    k, v = keys[None], values[None]
    gqa = {"enable_gqa": True} if _HAS_GQA else {}
    if attn.num_key_value_groups > 1 and not _HAS_GQA:
        k, v = k.repeat_interleave(attn.num_key_value_groups, dim=1), v.repeat_interleave(attn.num_key_value_groups, dim=1)
    out = []
    for rows, mask in masks:
        span = mask.shape[1]
        o = torch.nn.functional.scaled_dot_product_attention(q[None, :, rows], k[:, :, :span], v[:, :, :span], attn_mask=mask,
                                                             scale=attn.scaling, **gqa)  # fmt: skip
        out.append(o[0].transpose(0, 1).reshape(mask.shape[0], -1))
    return torch.cat(out)


@torch.no_grad()
def blend(
    model: Any,
    ids: Sequence[int],
    buffer: KVCache,
    start: int,
    end: int,
    cached: torch.Tensor,
    ratio: float,
    *,
    check_layer: int = 1,
    query_block: int = 256,
    first: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> int:
    """Recompute, in ``buffer``, the KV of selected tokens of ``ids[start:end]``; returns how many.

    ``buffer`` holds the exact KV of ``[0, start)`` and, for the region's tokens where ``cached``
    (bool, ``end - start``) is set, their cached KV at their positions; the others are computed.
    Of the cached tokens, ``ceil(ratio * cached)`` with the largest layer-``check_layer`` KV
    deviation (or the highest ``scores``, float, ``end - start``: then picked before layer 0, the other tokens not
    run at all) are recomputed from that layer on (see module doc); the cached tokens set in ``first`` (bool,
    ``end - start``) are among them whatever their deviation (and recomputed at layer 0 too).
    """
    n = end - start
    cached = cached.to(device="cpu", dtype=torch.bool)
    first = torch.zeros(n, dtype=torch.bool) if first is None else first.to(device="cpu", dtype=torch.bool) & cached
    if cached.shape != (n,) or first.shape != (n,):
        raise ValueError(f"cached and first must have one flag per region token ({n}), got {tuple(cached.shape)}")
    forced = (~cached | first).nonzero().flatten()
    n_pick = max(0, budget(cached, ratio) - int(first.sum()))
    if n == 0 or (n_pick == 0 and forced.numel() == 0):
        return 0
    inner = model.model
    device = buffer.keys.device
    positions = torch.arange(start, end, device=device)
    h = inner.embed_tokens(torch.tensor([list(ids[start:end])], device=device))[0]
    cos, sin = (t[0] for t in inner.rotary_emb(h[None], positions[None]))
    rows = torch.arange(n, device=device)  # the region tokens whose hidden state h holds: the queries
    forced = forced.to(device)
    # scores pick before layer 0: no other token needs a pass (layer 0's KV is context-free); the deviation needs one,
    # unless there is nothing for it to pick
    check_layer = 0 if scores is not None or n_pick == 0 else min(check_layer, len(inner.layers) - 1)
    masks = _masks(positions, end, query_block) if check_layer > 0 else []  # made for the picked rows at the check layer
    for li, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        k = apply_rotary(_heads(attn.k_proj(x), attn.head_dim), cos, sin)
        v = _heads(attn.v_proj(x), attn.head_dim)
        kbuf, vbuf = buffer.keys[li], buffer.values[li]  # (kv_heads, capacity, dim)
        if li < check_layer:  # every token is a query; only the forced tokens write theirs
            kbuf[:, start + forced] = k[:, forced].to(kbuf.dtype)
            vbuf[:, start + forced] = v[:, forced].to(vbuf.dtype)
        else:
            if li == check_layer:  # keep the forced tokens and the cached ones scoring highest (else deviating most)
                rows = _select(k, v, kbuf[:, start:end], vbuf[:, start:end], forced, n_pick, scores)
                h, x, k, v, cos, sin = h[rows], x[rows], k[:, rows], v[:, rows], cos[rows], sin[rows]
                masks = _masks(positions[rows], end, query_block)
            kbuf[:, start + rows] = k.to(kbuf.dtype)
            vbuf[:, start + rows] = v.to(vbuf.dtype)
        q = apply_rotary(_heads(attn.q_proj(x), attn.head_dim), cos, sin)
        o = _attend(q, kbuf[:, :end], vbuf[:, :end], masks, attn)
        h = h + attn.o_proj(o.to(h.dtype))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return int(rows.numel())
