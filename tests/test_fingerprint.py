"""Model fingerprint: stable for the same model, different for anything that changes the KV."""

from __future__ import annotations

import re
import time

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from cachegen_core.keys.fingerprint import model_fingerprint, tokenizer_fingerprint


def tiny_config(**over) -> LlamaConfig:
    kw = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    return LlamaConfig(**{**kw, **over})


def tiny_model(seed: int = 0, **over) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**over)).eval()


def tiny_tokenizer(n_words: int = 60, *, template: str | None = None, eos: str = "</s>") -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<eos2>": 3, **{f"w{i}": i for i in range(4, 4 + n_words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token=eos)
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_format_and_determinism(model, tok):
    fp = model_fingerprint(model, tok)
    assert re.fullmatch(r"[0-9a-f]{32}", fp)
    assert model_fingerprint(model, tok) == fp
    assert model_fingerprint(tiny_model(0), tiny_tokenizer()) == fp, "same seed, same config: same model"


def test_two_random_inits_differ(model, tok):
    assert model_fingerprint(tiny_model(1), tok) != model_fingerprint(model, tok)


def test_one_changed_weight_row_is_seen(model, tok):
    other = tiny_model(0)
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.weight[0].add_(0.5)  # row 0 is always sampled
    assert model_fingerprint(other, tok) != model_fingerprint(model, tok)


def test_config_change_is_seen(tok):
    a = tiny_model(0)
    b = tiny_model(0, rope_theta=1234.0)  # same weights (same seed, same shapes), other RoPE
    assert model_fingerprint(a, tok) != model_fingerprint(b, tok)


def test_dtype_is_seen(tok):
    m32 = tiny_model(0)
    fp32 = model_fingerprint(m32, tok)
    assert model_fingerprint(m32, tok, dtype=torch.bfloat16) != fp32
    assert model_fingerprint(tiny_model(0).to(torch.bfloat16), tok) != fp32
    assert model_fingerprint(m32, tok, dtype=torch.float32) == fp32, "explicit default dtype changes nothing"


@pytest.mark.parametrize(
    "other",
    [
        lambda: tiny_tokenizer(61),  # one more word
        lambda: tiny_tokenizer(template="{{ messages }}"),
        lambda: tiny_tokenizer(eos="<eos2>"),
    ],
    ids=["vocab", "chat-template", "special-tokens"],
)
def test_tokenizer_change_is_seen(model, tok, other):
    t = other()
    assert tokenizer_fingerprint(t) != tokenizer_fingerprint(tok)
    assert model_fingerprint(model, t) != model_fingerprint(model, tok)


def test_survives_save_and_reload(model, tok, tmp_path):
    """Where a model was loaded from (``_name_or_path``) is not part of its identity."""
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    loaded_tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "m")
    assert tokenizer_fingerprint(loaded_tok) == tokenizer_fingerprint(tok)
    assert model_fingerprint(loaded, loaded_tok) == model_fingerprint(model, tok)


def test_meta_device_weights_do_not_crash(tok):
    with torch.device("meta"):
        m = LlamaForCausalLM(tiny_config())
    assert re.fullmatch(r"[0-9a-f]{32}", model_fingerprint(m, tok))


def test_fast_on_a_135m_model(tok):
    """SmolLM2-135M's shapes (random init, no download): well under a second."""
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    m = m.to_empty(device="cpu")  # real memory, arbitrary values: sampling cost is what is measured
    m.tie_weights()
    n = sum(p.numel() for p in m.parameters())
    assert 130e6 < n < 140e6
    model_fingerprint(m, tok)
    t0 = time.perf_counter()
    model_fingerprint(m, tok)
    assert time.perf_counter() - t0 < 1.0
