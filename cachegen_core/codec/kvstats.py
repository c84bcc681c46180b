"""Second-order statistics of a model's KV that the codec's transform is fitted from.

- **Covariance** of each head's channels about the chunk mean (what the codec codes),
  keys before the rotary embedding when the codec codes them that way.
- **Fisher information** of the model's predictions with respect to the KV: the
  codec's distortion measure is the KL divergence between next-token distributions on
  the exact and on the reconstructed KV, which for small errors ``e`` is ``e^T F e / 2``.
  Estimated per (kind, layer, group of KV heads) as an ``n x n`` matrix (``n``: the group's
  channels, ``transform.group_heads``; heads one at a time for ``group`` = 1): score a continuation
  on a context's KV, draw each next token from the model's own distribution and add up
  ``g g^T`` of the gradient ``g`` of the log-likelihood with respect to every context
  token's key and value (one backward pass per draw; cross terms between positions
  vanish in expectation).

Attention-sink tokens are left out of both: the codec keeps them exactly, and their
gradient is thousands of times larger than any other token's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ..hfcompat import cache_arg, output_cache
from ..kv import KVCache
from .rotary import RotarySpec
from .transform import group_heads


@dataclass
class KVStats:
    """Running sums per (kind, layer, group of ``group`` heads), float64 ``(2, layers, heads // group, n, n)``."""

    covariance_sum: torch.Tensor
    fisher_sum: torch.Tensor
    covariance_tokens: int = 0
    fisher_tokens: int = 0
    contexts: list[int] = field(default_factory=list)
    group: int = 1

    @classmethod
    def empty(cls, layers: int, heads: int, dim: int, group: int = 1) -> "KVStats":
        if group < 1 or heads % group:
            raise ValueError(f"a group of {group} heads does not divide {heads} heads")
        z = torch.zeros(2, layers, heads // group, group * dim, group * dim, dtype=torch.float64)
        return cls(z, z.clone(), group=group)

    @property
    def covariance(self) -> torch.Tensor:
        return self.covariance_sum / max(self.covariance_tokens, 1)

    @property
    def fisher(self) -> torch.Tensor:
        """Fisher per context token."""
        return self.fisher_sum / max(self.fisher_tokens, 1)

    def add_covariance(self, kv: KVCache, *, rotary: RotarySpec | None, chunk_tokens: int, sink_tokens: int) -> None:
        """Add a context's KV (from position 0), centred per chunk of ``chunk_tokens`` as the codec centres it."""
        for start in range(0, kv.num_tokens, chunk_tokens):
            chunk = kv.slice(start, start + chunk_tokens)
            skip = max(0, min(chunk.num_tokens, sink_tokens - start))
            for kind, x in enumerate((chunk.keys, chunk.values)):
                x = rotary.unrotate(x, start) if kind == 0 and rotary is not None else x.float()
                body = group_heads(x[:, :, skip:], self.group).double()
                if body.shape[2] < 2:
                    continue
                body = body - body.mean(dim=2, keepdim=True)
                self.covariance_sum[kind] += torch.einsum("lhti,lhtj->lhij", body, body).cpu()
            self.covariance_tokens += chunk.num_tokens - skip

    def add_fisher(
        self,
        model: Any,
        kv: KVCache,
        continuation: list[int],
        *,
        rotary: RotarySpec | None,
        sink_tokens: int,
        generator: torch.Generator | None = None,
    ) -> None:
        """Add one draw of the Fisher of ``continuation`` scored on ``kv`` (the KV of the tokens before it)."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.requires_grad_(False)
        try:
            keys = kv.keys.detach().float()
            keys = (rotary.unrotate(keys, 0) if rotary is not None else keys).requires_grad_(True)
            values = kv.values.detach().float().requires_grad_(True)
            rotated = rotary.rotate(keys, 0) if rotary is not None else keys
            dtype = next(model.parameters()).dtype
            past = KVCache(rotated.to(dtype), values.to(dtype)).to_dynamic_cache(model.config)
            logits = model(torch.tensor([continuation], device=model.device), **cache_arg(model, past)).logits[0].float()
            drawn = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
            loss = torch.nn.functional.cross_entropy(logits, drawn, reduction="sum")
            grads = torch.autograd.grad(loss, [keys, values])
        finally:
            for p in trainable:
                p.requires_grad_(True)
        skip = min(sink_tokens, kv.num_tokens)
        for kind, g in enumerate(grads):
            g = group_heads(g[:, :, skip:], self.group).double()
            self.fisher_sum[kind] += torch.einsum("lhti,lhtj->lhij", g, g).cpu()
        self.fisher_tokens += kv.num_tokens - skip
        self.contexts.append(kv.num_tokens)


def _plain_cache() -> Any:
    from transformers import DynamicCache  # noqa: PLC0415

    return DynamicCache()


def kv_statistics(
    model: Any,
    token_ids: Iterable[list[int]],
    *,
    rotary: RotarySpec | None,
    contexts: tuple[int, ...] = (1536, 4096),
    continuation: int = 256,
    chunk_tokens: int = 1536,
    sink_tokens: int = 1,
    seed: int = 0,
    group: int = 1,
) -> KVStats:
    """Covariance and Fisher over texts: for each text, one forward pass over its first
    ``max(contexts)`` tokens (the covariance), then one Fisher draw per context length
    ``c`` the text is long enough for (``c`` tokens of context, the next ``continuation`` scored);
    ``group``: heads per matrix."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    stats: KVStats | None = None
    for ids in token_ids:
        usable = [c for c in contexts if len(ids) >= c + continuation]
        if not usable:
            continue
        with torch.no_grad():  # plain cache layers: a sliding-window layer of the config's would keep only its window
            out = model(torch.tensor([ids[: max(usable)]], device=model.device), use_cache=True, **cache_arg(model, _plain_cache()))
        kv = KVCache.from_dynamic_cache(output_cache(out))
        if stats is None:
            stats = KVStats.empty(kv.num_layers, kv.num_kv_heads, kv.head_dim, group)
        stats.add_covariance(kv, rotary=rotary, chunk_tokens=chunk_tokens, sink_tokens=sink_tokens)
        for c in usable:
            stats.add_fisher(model, kv.slice(0, c), ids[c : c + continuation], rotary=rotary, sink_tokens=sink_tokens, generator=gen)
    if stats is None:
        raise ValueError(f"no text has the {min(contexts)} + {continuation} tokens the statistics need")
    return stats
