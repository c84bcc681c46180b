"""Tiny random-init Llama models, a word-level tokenizer and prompts for them (no downloads).

Tests and the robustness benchmark run the real engine on these: a GQA model small
enough to prefill hundreds of tokens in milliseconds, and a tokenizer whose words
``w3``..``w{vocab-1}`` map one-to-one onto token ids.
"""

from __future__ import annotations

from typing import Any

import torch


def make_tiny_llama(
    seed: int = 0, *, layers: int = 3, heads: int = 4, kv_heads: int = 2, vocab: int = 128, dtype: torch.dtype = torch.float32
) -> Any:
    """A tiny random-init ``LlamaForCausalLM`` with GQA (``kv_heads < heads``), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,  # peakier logits, like a trained model, so greedy margins are not ~1e-3
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


def make_tiny_kv(model: Any, tokens: int = 157, seed: int = 1) -> Any:
    """A real ``KVCache`` of ``model`` over ``tokens`` random token ids."""
    from transformers import DynamicCache  # noqa: PLC0415

    from cachegen_core.hfcompat import cache_arg, output_cache  # noqa: PLC0415
    from cachegen_core.kv import KVCache  # noqa: PLC0415

    torch.manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens))
    with torch.no_grad():  # plain cache layers: every token, sliding-window models too
        out = model(ids, use_cache=True, **cache_arg(model, DynamicCache()))
    return KVCache.from_dynamic_cache(output_cache(out))


def make_tiny_tokenizer(vocab: int = 128) -> Any:
    """A word-level fast tokenizer over words ``w3``..``w{vocab-1}`` (+ pad/bos/eos), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocabulary = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}w3 {{ 'w4' if m['role'] == 'user' else 'w5' }} {{ m['content'] }} w6 {% endfor %}"
        "{% if add_generation_prompt %}w3 w5 {% endif %}"
    )
    return fast


def words(seed: int, n: int, vocab: int = 128) -> str:
    """A reproducible prompt of ``n`` words of the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(7, vocab, (n,), generator=g))
