"""One forward pass for many requests: their new tokens packed into one sequence, each attending to its own KV.

The scheduler (``serving/scheduler.py``) runs every running request's next token, and a piece of a joining
request's prompt, as one sequence of ``T`` tokens through the model (``forward``): the model's matrix products see
all of them at once, as in vLLM's flattened batches. Each request (a :class:`Part`) has its rows of the sequence,
its positions, and its KV: optionally a *shared prefix* (positions ``[0, n)``, read-only, held once for every
request whose prompt starts with it) and its *own* buffer (the positions after it, where its new tokens are
written). transformers computes the projections, the rotary embedding (from the packed ``position_ids``) and the
MLPs; the cache (:class:`PlanCache`) writes each request's new keys and values into its own buffer, and the
attention (:func:`packed_attention`, under the implementation name :data:`NAME`, which has no mask function:
transformers builds no mask for it) reads them from there:

- a request without a shared prefix: SDPA over its own buffer (causal with an offset for a piece of its prompt);
- requests sharing a prefix: the queries of all of them over the prefix in one call (the prefix read once: cascade
  attention, as FlashInfer's and Hydragen's), the tails of requests decoding one token each padded into one call, the
  two combined by their softmax normalisers (log-sum-exp). Both calls are torch's fused kernels that return it (the
  CPU's flash attention, CUDA's memory-efficient attention: 16-bit keys and values read as they are); elsewhere, with
  soft-capping, or once a kernel has failed, by hand in float32, a tail at a time.

On a GPU the requests that decode one token (those without a shared prefix together, and each group's tails) are
read by one Triton launch a layer instead (``own_decode.py``), which also writes their new keys and values.

Sliding-window layers read only the window (keys after ``position - window``), as transformers' masks give them;
Gemma 2's logit soft-capping is applied to the scores. Nothing is copied per step but each request's new keys and
values and its queries.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from ...hfcompat import cache_arg
from ...kv import KVCache
from . import lse, own_decode
from .attention import blocked_offset_attention, offset_causal_attention

#: The attention implementation name a packed forward runs under (registered on first use; no mask function).
NAME = "cachegen_packed"
_STATE = threading.local()  # the plan of the forward running in this thread
_registered = False


@dataclass(eq=False)
class Part:
    """One request's share of a packed forward.

    ``rows``: its tokens' rows in the sequence; ``own``: its own KV buffer (positions ``offset`` on), of which the
    first ``filled`` tokens are computed: the new tokens go to ``[filled, filled + rows)``; ``shared``: the KV of
    positions ``[0, offset)`` (None when ``offset`` is 0), read by other parts too.
    """

    start: int
    stop: int
    own: KVCache
    filled: int
    offset: int = 0
    shared: KVCache | None = None

    @property
    def tokens(self) -> int:
        return self.stop - self.start

    @property
    def first_position(self) -> int:
        """The position of the part's first new token."""
        return self.offset + self.filled

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Its new tokens' keys and values at ``layer`` (its rows of the forward's (1, kv_heads, T, head_dim)) into its buffer."""
        self.own.keys[layer, :, self.filled : self.filled + self.tokens].copy_(keys[0, :, self.start : self.stop])
        self.own.values[layer, :, self.filled : self.filled + self.tokens].copy_(values[0, :, self.start : self.stop])


@dataclass
class Plan:
    """The parts of one packed forward (in row order) and each layer's sliding window (None: full attention).

    ``groups``: the parts reading one shared prefix (the same memory and length), in row order, each with what every
    layer of the forward reuses: its rows and positions (and masks, per window). ``batches``: decoding parts whose
    attention one kernel launch a layer computes (:meth:`use_kernel`; key None: those without a shared prefix, else
    their group's index), ``kernel_parts`` the ids of those parts (the kernel writes their new keys and values)."""

    parts: Sequence[Part]
    windows: Sequence[int | None]
    groups: list[Group] = field(default_factory=list)
    batches: dict[int | None, own_decode.Batch] = field(default_factory=dict)
    kernel_parts: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        by: dict[tuple[int, int], list[Part]] = {}
        for p in self.parts:
            if p.shared is not None:
                by.setdefault((p.shared.keys.data_ptr(), p.shared.num_tokens), []).append(p)
        for p in self.parts:  # the request whose buffer holds a prefix others read: its prefix read with theirs, once
            if p.shared is None and p.offset == 0:
                n = max((n for ptr, n in by if ptr == p.own.keys.data_ptr() and n <= p.filled), default=0)
                if n:
                    p.shared, p.own, p.offset, p.filled = p.own.slice(0, n), p.own.slice(n, p.own.num_tokens), n, p.filled - n
                    by[(p.shared.keys.data_ptr(), n)].append(p)
        self.groups = [Group(sorted(g, key=lambda p: p.start)) for g in by.values()]

    def use_kernel(self, device: torch.device, dtype: torch.dtype, softcap: float | None) -> None:
        """Where ``own_decode.py``'s kernel runs, the decoding parts' attention by one launch a layer: those without a
        shared prefix together, and each group whose parts all decode."""
        if not own_decode.usable(device, softcap):
            return
        own = [p for p in self.parts if p.shared is None and p.tokens == 1]
        sets = [(None, own, [p.start for p in own])] + [(i, g.parts, range(len(g))) for i, g in enumerate(self.groups) if g.decoding]
        for key, parts, rows in sets:
            if len(parts) >= own_decode.MIN_PARTS and own_decode.Batch.fits(parts, dtype, device):
                self.batches[key] = own_decode.Batch(parts, rows, device)
        self.kernel_parts = {id(p) for b in self.batches.values() for p in b.parts}

    def without_kernel(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The kernel did not run at ``layer``: its parts' new keys and values written here, and from the next layer on
        by the cache, their attention by the calls of each part."""
        for p in self.parts:
            if id(p) in self.kernel_parts:
                p.store(layer, key, value)
        self.batches, self.kernel_parts = {}, set()


class Group:
    """Parts reading one shared prefix, with the index tensors every layer reuses (built once per forward)."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        shared = parts[0].shared
        assert shared is not None
        self.shared, device = shared, shared.keys.device
        self.rows = torch.cat([torch.arange(p.start, p.stop, device=device) for p in parts])
        self.positions = torch.cat([torch.arange(p.first_position, p.first_position + p.tokens, device=device) for p in parts])
        self.decoding = all(p.tokens == 1 for p in parts)  # one query each: their tails attended in one call
        self._masks: dict[int | None, Any] = {}

    def __len__(self) -> int:
        return len(self.parts)

    def __iter__(self) -> Iterator[Part]:
        return iter(self.parts)

    def prefix_mask(self, window: int | None, g: int) -> torch.Tensor | None:
        """Which shared keys each query (rows repeated per query head of a KV head) sees; None: all."""
        key = ("prefix", window)
        if key not in self._masks:
            mask = None
            if window is not None and int(self.positions.max()) - window + 1 > 0:
                keys = torch.arange(self.shared.num_tokens, device=self.positions.device)
                mask = (keys[None, :] > self.positions[:, None] - window).repeat(g, 1)
            self._masks[key] = mask
        return self._masks[key]

    def tails(self, window: int | None, align: int = 1) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """Decoding parts: each one's own keys ``[first, end)`` and the additive mask of their padded batch, its length
        a multiple of ``align``."""
        key = ("tails", window, align)
        if key not in self._masks:
            spans = [(_window_start(p.filled, window), p.filled + 1) for p in self.parts]
            longest = -(-max(e - f for f, e in spans) // align) * align
            lengths = torch.tensor([e - f for f, e in spans])
            mask = torch.zeros(len(spans), 1, 1, longest, dtype=self.shared.dtype)
            mask.masked_fill_(torch.arange(longest)[None, None, None, :] >= lengths[:, None, None, None], float("-inf"))
            self._masks[key] = (spans, mask.to(self.shared.keys.device))
        return self._masks[key]


class PlanCache(Cache):
    """The cache a packed forward passes the model: each part's new keys and values written into its own buffer."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(layers=[])
        self.plan = plan

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for p in self.plan.parts:
            if id(p) not in self.plan.kernel_parts:  # the kernel writes those
                p.store(layer_idx, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


# ------------------------------------------------------------------ attention
def _window_start(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` sees (transformers' sliding masks: keys after ``position - window``)."""
    return 0 if window is None else max(0, position - window + 1)


def _own_mask(t: int, filled: int, first: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which of the own keys ``[first, filled + t)`` each of ``t`` queries (at own positions ``filled ...``) sees;
    None when every query sees all of them."""
    if t == 1:
        return None
    keys = torch.arange(first, filled + t, device=device)
    q = torch.arange(filled, filled + t, device=device)[:, None]
    mask = keys[None, :] <= q
    if window is not None:
        mask &= keys[None, :] > q - window
    return mask


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Queries (h, m, d) as (1, kv_heads, (h / kv_heads) * m, d): each KV head's query heads stacked along the rows."""
    h, m, d = q.shape
    return q.reshape(kv_heads, (h // kv_heads) * m, d).unsqueeze(0)


def _plain_own(q: torch.Tensor, own: KVCache, layer: int, p: Part, window: int | None, scale: float,
               softcap: float | None) -> torch.Tensor:  # fmt: skip
    """A part without a shared prefix: (1, h, t, d) attention over its own keys."""
    t, end = p.tokens, p.filled + p.tokens
    first = _window_start(p.filled, window) if t == 1 else 0
    k, v = own.keys[layer, :, first:end].unsqueeze(0), own.values[layer, :, first:end].unsqueeze(0)
    if softcap:
        return lse.manual(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // k.shape[1], 1), scale,
                          _own_mask(t, p.filled, first, window, q.device), softcap)[0]  # fmt: skip
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if t == 1:
        return sdpa(q, k, v, scale=scale, enable_gqa=True)
    if window is None and p.filled == 0:
        return sdpa(q, k, v, scale=scale, is_causal=True, enable_gqa=True)
    mask = _own_mask(t, p.filled, first, window, q.device)
    if window is None and p.filled <= t / 2:
        return offset_causal_attention(q, k, v, scale)
    if window is None:
        return blocked_offset_attention(q, k, v, mask[None, None], scale)  # type: ignore[index]
    return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _shared_group(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, plan: Plan, index: int, layer: int,
                  window: int | None, scale: float, softcap: float | None) -> None:  # fmt: skip
    """The parts sharing one prefix (``plan.groups[index]``): every query over the prefix in one call, each part's own
    tail (all of them in one call when each decodes one token), the two combined by their log-sum-exp."""
    group = plan.groups[index]
    shared = group.shared
    h, d, kvh = query.shape[1], query.shape[3], shared.keys.shape[1]
    g = h // kvh
    q = query[0][:, group.rows]  # (h, m, d)
    m = q.shape[1]
    mask = group.prefix_mask(window, g)
    o1, l1 = lse.with_lse(_grouped(q, kvh), shared.keys[layer].unsqueeze(0), shared.values[layer].unsqueeze(0), scale, mask, softcap)
    if mask is not None:  # a query whose window starts past the prefix sees none of it: no weight (the kernel says 0), no NaN
        o1 = torch.nan_to_num(o1, nan=0.0)
        l1 = l1.masked_fill(~mask.any(-1), float("-inf"))
    tails = None
    if index in plan.batches:
        tails = _kernel_tails(query, key, value, plan.batches[index], layer, window, scale, kvh)
        if tails is None:
            plan.without_kernel(layer, key, value)
    if tails is None and group.decoding and lse.fuses(q, shared.keys, softcap):
        tails = _tails(q, group, layer, window, scale, kvh)
    o2, l2 = tails if tails is not None else _each_tail(q, group, layer, window, scale, softcap, kvh)
    l1, o1 = l1.view(kvh, g, m), o1.view(kvh, g, m, d)
    both = torch.logaddexp(l1, l2)
    merged = o1.float() * torch.exp(l1 - both)[..., None] + o2.float() * torch.exp(l2 - both)[..., None]
    out[0, group.rows] = merged.permute(2, 0, 1, 3).reshape(m, h, d).to(out.dtype)


def _kernel_tails(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: own_decode.Batch, layer: int, window: int | None,
                  scale: float, kvh: int) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """The decoding tails of a group by the kernel (``own_decode.py``), as :func:`_tails` gives them; None if it failed."""
    m, (h, d) = len(batch), (query.shape[1], query.shape[3])
    o = query.new_empty(1, m, h, d)
    sums = torch.empty(m, h, device=query.device)
    if not own_decode.attend(query, key, value, batch, layer, window, scale, o, sums):
        return None
    return o[0].view(m, kvh, h // kvh, d).permute(1, 2, 0, 3), sums.view(m, kvh, h // kvh).permute(1, 2, 0)


def _tails(q: torch.Tensor, group: Group, layer: int, window: int | None, scale: float, kvh: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each decoding part's one query over its own keys, all parts padded into one call of the fused kernel: ((kvh, g, m,
    d), (kvh, g, m)); None if it failed."""
    h, m, d = q.shape
    spans, mask = group.tails(window, lse.ALIGN.get(q.device.type, 1))
    own = group.parts[0].own
    keys = own.keys.new_zeros(m, kvh, mask.shape[-1], d)
    values = own.values.new_zeros(m, kvh, mask.shape[-1], d)
    for i, (p, (f, e)) in enumerate(zip(group.parts, spans)):
        keys[i, :, : e - f] = p.own.keys[layer, :, f:e]
        values[i, :, : e - f] = p.own.values[layer, :, f:e]
    queries = q.view(kvh, h // kvh, m, d).permute(2, 0, 1, 3)  # (m parts, kvh, g, d)
    fused = lse.fused(queries, keys, values, mask, scale)
    if fused is None:
        return None
    o, sums = fused
    return o.permute(1, 2, 0, 3), sums.permute(1, 2, 0)


def _each_tail(q: torch.Tensor, group: Group, layer: int, window: int | None, scale: float, softcap: float | None,
               kvh: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each part's queries over its own keys (causal among its new tokens), one call each."""
    h, m, d = q.shape
    g = h // kvh
    o2 = q.new_empty(kvh, g, m, d)
    l2 = torch.empty(kvh, g, m, device=q.device)
    at = 0
    for p in group:
        t, end = p.tokens, p.filled + p.tokens
        first = _window_start(p.filled, window) if t == 1 else 0
        mine = _own_mask(t, p.filled, first, window, q.device)
        o, sums = lse.with_lse(_grouped(q[:, at : at + t], kvh), p.own.keys[layer, :, first:end].unsqueeze(0),
                               p.own.values[layer, :, first:end].unsqueeze(0), scale, None if mine is None else mine.repeat(g, 1), softcap)  # fmt: skip
        o2[:, :, at : at + t] = o.view(kvh, g, t, d)
        l2[:, :, at : at + t] = sums.view(kvh, g, t)
        at += t
    return o2, l2


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                     dropout: float = 0.0, scaling: float | None = None, softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface over the plan of the forward running in this thread (see the module doc):
    ``query`` (1, heads, T, head_dim) of every part; ``key``/``value`` are the new tokens', in the parts' own buffers
    already but those the kernel writes (``plan.kernel_parts``). Returns (1, T, heads, head_dim)."""
    plan: Plan = _STATE.plan
    layer, window = module.layer_idx, plan.windows[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    if plan.kernel_parts and softcap:  # soft-capping the config did not name: not the kernel's
        plan.without_kernel(layer, key, value)
    if None in plan.batches and not own_decode.attend(query, key, value, plan.batches[None], layer, window, scale, out):
        plan.without_kernel(layer, key, value)
    for p in plan.parts:
        if p.shared is None and id(p) not in plan.kernel_parts:
            o = _plain_own(query[:, :, p.start : p.stop], p.own, layer, p, window, scale, softcap)
            out[0, p.start : p.stop] = o[0].transpose(0, 1)
    for index in range(len(plan.groups)):
        _shared_group(query, key, value, out, plan, index, layer, window, scale, softcap)
    return out, None


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface  # noqa: PLC0415

        AttentionInterface.register(NAME, packed_attention)
        _registered = True


@contextlib.contextmanager
def _packed(model: Any, plan: Plan) -> Iterator[None]:
    """The model's attention is :func:`packed_attention` over ``plan`` inside (this thread only computes with it)."""
    _register()
    configs = [model.config]
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if text is not model.config:
        configs.append(text)
    before = [c._attn_implementation_internal for c in configs]
    _STATE.plan = plan
    for c in configs:
        c._attn_implementation_internal = NAME
    try:
        yield
    finally:
        for c, b in zip(configs, before):
            c._attn_implementation_internal = b
        _STATE.plan = None


@torch.no_grad()
def forward(model: Any, ids: torch.Tensor, positions: torch.Tensor, plan: Plan, keep: torch.Tensor) -> torch.Tensor:
    """One packed forward: ``ids``/``positions`` (T,) of every part's new tokens in row order; returns the logits
    (float32) of the rows ``keep`` only (the model's head runs on those alone where it can)."""
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if getattr(model, "dtype", None) is not None:
        plan.use_kernel(ids.device, model.dtype, getattr(text, "attn_logit_softcapping", None))
    cache = PlanCache(plan)
    with _packed(model, plan):
        try:
            out = model(input_ids=ids[None], position_ids=positions[None], **cache_arg(model, cache), use_cache=True, logits_to_keep=keep)
            logits = out.logits[0]
        except TypeError as e:  # a model without logits_to_keep
            if "logits_to_keep" not in str(e):
                raise
            logits = model(input_ids=ids[None], position_ids=positions[None], **cache_arg(model, cache), use_cache=True).logits[0, keep]
    return logits.float()


def packs(model: Any) -> str | None:
    """None when the model's forward can run packed (its attention through transformers' attention interface, positions
    from ``position_ids``); else why not (its requests are then answered one at a time)."""
    config = getattr(model, "config", None)
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "rotary") == "alibi":
        return "ALiBi position biases are not supported by the packed attention"
    can = getattr(model, "_can_set_attn_implementation", None)
    if callable(can) and not can():
        return f"{type(model).__name__} does not compute attention through transformers' attention interface"
    return None
