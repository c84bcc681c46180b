"""Attention for a long reused KV on the CPU: transformers' SDPA path, but with SDPA's own GQA.

With grouped-query attention (SmolLM2: 9 query heads share 3 KV heads) transformers' SDPA
wrapper copies every KV head once per query head it serves (``repeat_kv``) whenever it
passes an attention mask, which it does for the question's prefill on a reused cache: for
a 7,680-token cache that copy was half of the question's prefill on 2 CPU cores. PyTorch's
``scaled_dot_product_attention(enable_gqa=True)`` reads the shared heads in place, with the
same result (checked against ``sdpa`` in the tests). Registered under :data:`NAME` for
transformers' ``AttentionInterface``; the engine switches to it only models it loads itself.

Prefilling many tokens after a reused prefix (a cold request whose first 64 tokens hit a stored
partial chunk, a chat turn, text between documents) is the other case transformers passes a mask
for: causal with an offset. SDPA then computes every query against every key, masked half
included: 3,008 queries after a 64-token hit took 2x the attention time of the 3,072-token
prefill with no hit at all. Where the prefix is at most half the new tokens,
:func:`offset_causal_attention` does only the causal work instead; after a longer prefix,
:func:`blocked_offset_attention` runs the queries in blocks, each over the keys it may see (half
the 8,207 tokens after a 4,103-token prefix of the reference model: 22.1 s instead of 24.7 s on 2 cores).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

NAME = "cachegen_sdpa"
#: Queries from which a prefill after a prefix takes :func:`offset_causal_attention` (a question's few
#: tokens keep the mask: one small SDPA call).
MIN_OFFSET_QUERIES = 64
#: Blocks the queries of a prefill after a longer prefix run in (:func:`blocked_offset_attention`): each computes the
#: masked half of its own square, q^2 / 16 scores in all with 8, against the masked call's q^2 / 2.
OFFSET_BLOCKS = 8
#: Fewest queries in a block (smaller ones would be calls too small to use the cores).
MIN_BLOCK = 256
_verified: tuple[Any, int | None] | None = None  # the last mask seen to be causal with an offset (weakly), its version


def _is_offset_causal(mask: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether ``mask`` (bool, one row per query) lets query ``i`` see exactly the keys ``<= keys - queries + i``.
    The model passes one mask to all its layers: checked once per tensor."""
    global _verified
    if mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape) != (1, 1, queries, keys):
        return False
    # an inference-mode tensor has no version counter: the mask is the one transformers built for this forward
    version = None if mask.is_inference() else mask._version
    if _verified is not None and _verified[0]() is mask and _verified[1] == version:
        return True
    at = torch.arange(keys, device=mask.device)
    ok = torch.equal(mask[0, 0], at[None, :] <= at[keys - queries :, None])
    if ok:
        _verified = (weakref.ref(mask), version)
    return ok


def offset_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal attention of the last ``q`` positions (``query`` (1, heads, q, dim)) over ``key``/``value``
    (1, kv_heads, k, dim) with ``k - q <= q / 2``: the queries padded in front to a square problem, which
    SDPA's causal kernel computes without a mask, masked half skipped; the padding's rows are dropped.
    (With a longer prefix the masked call is as fast: most of its work is the prefix, which every query sees.)"""
    prefix = key.shape[2] - query.shape[2]
    padded = torch.cat([query.new_zeros(*query.shape[:2], prefix, query.shape[3]), query], dim=2)
    return torch.nn.functional.scaled_dot_product_attention(padded, key, value, is_causal=True, scale=scaling, enable_gqa=True)[:, :, prefix:]


def blocked_offset_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal attention of the last ``q`` positions over ``k`` keys, the queries in :data:`OFFSET_BLOCKS` blocks (at least
    :data:`MIN_BLOCK` each), each block over the keys up to its last position with its slice of ``mask``: one
    masked call computes all ``q x k`` scores, the blocks ``q (k - q) + q^2 / 2`` and half a block's square each."""
    q, prefix = query.shape[2], key.shape[2] - query.shape[2]
    step = max(MIN_BLOCK, -(-q // OFFSET_BLOCKS))
    out = []
    for i in range(0, q, step):
        j = min(i + step, q)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, i:j], key[:, :, : prefix + j], value[:, :, : prefix + j], attn_mask=mask[:, :, i:j, : prefix + j],
            scale=scaling, enable_gqa=True))  # fmt: skip
    return torch.cat(out, dim=2)


def sdpa_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` with ``enable_gqa`` (its other cases delegated to it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415

    groups = getattr(module, "num_key_value_groups", 1)
    special = any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap")) or kwargs.get("output_attentions")
    if groups <= 1 or special:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    q_length = query.shape[2]
    short = key.shape[2] <= 1.5 * q_length  # the prefix at most half the new tokens
    if (attention_mask is not None and not dropout and q_length < key.shape[2]
            and q_length >= (MIN_OFFSET_QUERIES if short else 2 * MIN_BLOCK)
            and _is_offset_causal(attention_mask, q_length, key.shape[2])):  # fmt: skip
        out = offset_causal_attention(query, key, value, scaling) if short else blocked_offset_attention(query, key, value, attention_mask, scaling)
        return out.transpose(1, 2).contiguous(), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_length > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_length:  # transformers' own quirk: an empty static cache's prefill
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: Any) -> bool:
    """Switch ``model`` to :func:`sdpa_gqa_attention` where it uses SDPA with grouped KV heads; True if it did."""
    from transformers import AttentionInterface  # noqa: PLC0415

    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not heads or not kv_heads or heads == kv_heads:
        return False
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: PLC0415

    AttentionInterface.register(NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the very masks sdpa gets (else: none at all)
    model.set_attn_implementation(NAME)
    return True
