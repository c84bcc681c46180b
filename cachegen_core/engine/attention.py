"""Attention for a long reused KV on the CPU: transformers' SDPA path, but with SDPA's own GQA.

With grouped-query attention (SmolLM2: 9 query heads share 3 KV heads) transformers' SDPA
wrapper copies every KV head once per query head it serves (``repeat_kv``) whenever it
passes an attention mask, which it does for the question's prefill on a reused cache: for
a 7,680-token cache that copy was half of the question's prefill on 2 CPU cores. PyTorch's
``scaled_dot_product_attention(enable_gqa=True)`` reads the shared heads in place, with the
same result (checked against ``sdpa`` in the tests). Registered under :data:`NAME` for
transformers' ``AttentionInterface``; the engine switches to it only models it loads itself.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "cachegen_sdpa"


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
