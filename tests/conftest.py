"""Shared fixtures: tiny random-init GQA Llama models and KV caches (no downloads)."""

from __future__ import annotations

import pytest
import torch

pytest_plugins: list[str] = []


def make_tiny_llama(seed: int = 0, *, layers: int = 3, heads: int = 4, kv_heads: int = 2, vocab: int = 128, dtype=torch.float32):
    """A tiny random-init ``LlamaForCausalLM`` with GQA (``kv_heads < heads``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

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
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_kv(tiny_llama):
    """A real KV cache of the tiny model over 157 random tokens."""
    from cachegen_core.kv import KVCache

    torch.manual_seed(1)
    ids = torch.randint(3, tiny_llama.config.vocab_size, (1, 157))
    with torch.no_grad():
        out = tiny_llama(ids, use_cache=True)
    return KVCache.from_dynamic_cache(out.past_key_values)


def make_tiny_tokenizer(vocab: int = 128):
    """A word-level fast tokenizer over words ``w3``..``w{vocab-1}`` (+ pad/bos/eos), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}w3 {{ 'w4' if m['role'] == 'user' else 'w5' }} {{ m['content'] }} w6 {% endfor %}"
        "{% if add_generation_prompt %}w3 w5 {% endif %}"
    )
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


def words(seed: int, n: int, vocab: int = 128) -> str:
    """A reproducible prompt of ``n`` words of the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(7, vocab, (n,), generator=g))
from tests.redis_fixture import fresh_redis_server, redis_server  # noqa: E402,F401  (real redis-server fixtures)
