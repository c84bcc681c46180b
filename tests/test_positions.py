"""A prompt longer than the model's positions is refused with a ``ValueError`` naming both numbers, from every
way in (``generate``, ``generate_many``, ``stream``, both LangChain classes); rotary scaling extends the range."""

from __future__ import annotations

import pytest
import torch
from langchain_core.messages import HumanMessage
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM, Qwen2Config

from cachegen_core.engine import KVEngine
from cachegen_core.engine.model.positions import position_limit
from cachegen_core.stores import MemoryStore
from cachegen_core.testing import make_family_model, make_tiny_tokenizer, words
from langchain_cachegen import CacheGenLLM, ChatCacheGen
from tests.test_engine import plain_greedy

LIMIT = 64


def llama(max_positions: int = LIMIT, rope: dict | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    kw = {"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, initializer_range=0.1, **kw)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def engine(model, store=None) -> KVEngine:
    return KVEngine(model, make_tiny_tokenizer(), store=MemoryStore() if store is None else store, chunk_tokens=16, background=False)


def test_the_range_of_each_kind_of_config():
    assert position_limit(LlamaConfig(max_position_embeddings=8192)) == 8192  # the reference model's
    assert position_limit(GPT2Config(n_positions=1024)) == 1024  # learned positions
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    assert position_limit(Qwen2Config(max_position_embeddings=32768, rope_parameters=yarn)) == 131072  # Qwen2.5's recipe
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 5e5}  # fmt: skip
    assert position_limit(LlamaConfig(max_position_embeddings=131072, rope_parameters=llama31)) == 131072
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    assert position_limit(LlamaConfig(max_position_embeddings=4096, rope_parameters=dynamic)) == 8192
    linear = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}
    assert position_limit(LlamaConfig(max_position_embeddings=16384, rope_parameters=linear)) == 16384  # states the extended length
    assert position_limit(LlamaConfig(max_position_embeddings=2048, rope_parameters={**linear, "original_max_position_embeddings": 2048})) == 16384
    assert position_limit(make_family_model("gemma3-text-window").config) == 4096  # rotary parameters per layer type
    assert position_limit(object()) is None


def test_generate_refuses_a_request_past_the_positions(tiny_tokenizer):
    model = llama()
    e = engine(model)
    prompt = words(1, LIMIT - 4)
    assert len(e.tokenize(prompt)) == LIMIT - 4  # a token a word
    text, info = e.generate(prompt, max_new_tokens=5)  # exactly the model's positions: the last new token is never read
    assert text == plain_greedy(model, tiny_tokenizer, prompt, 5) and info.prompt_tokens == LIMIT - 4 and info.new_tokens == 5
    with pytest.raises(ValueError, match=rf"prompt's {LIMIT - 4} tokens and max_new_tokens=6 need {LIMIT + 1} positions, the model has {LIMIT}: "):
        e.generate(prompt, max_new_tokens=6)
    assert e.store_kv(words(2, LIMIT))
    with pytest.raises(ValueError, match=rf"prompt's {LIMIT + 1} tokens need {LIMIT + 1} positions, the model has {LIMIT}: shorten the prompt \("):
        e.store_kv(words(2, LIMIT + 1))
    store = MemoryStore()
    e = engine(model, store)
    with pytest.raises(ValueError, match=rf"need {LIMIT + 59} positions, the model has {LIMIT}"):
        e.generate_many([words(3, 2), words(4, LIMIT)], max_new_tokens=60)  # the second: refused before any work
    assert len(store) == 0 and not e.metrics_recorder.snapshot()
    stream = e.stream(words(5, LIMIT + 10), max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"the model has {LIMIT}"):
        next(stream)


def test_both_langchain_classes_refuse_it(tiny_tokenizer):
    llm = CacheGenLLM(engine=engine(llama()))
    long = words(6, LIMIT + 1)
    with pytest.raises(ValueError, match=rf"the model has {LIMIT}"):
        llm.invoke(long)
    with pytest.raises(ValueError, match=rf"the model has {LIMIT}"):
        list(llm.stream(long))
    chat = ChatCacheGen(llm=llm)
    with pytest.raises(ValueError, match=rf"the model has {LIMIT}"):
        chat.invoke([HumanMessage(long)])
    with pytest.raises(ValueError, match=rf"the model has {LIMIT}"):
        list(chat.stream([HumanMessage(long)]))


def test_learned_positions_would_fail_inside_torch(tiny_tokenizer):
    model = make_family_model("gpt2")
    e = engine(model)
    prompt = words(7, 1020)
    assert e.generate(prompt, max_new_tokens=5)[0] == plain_greedy(model, tiny_tokenizer, prompt, 5)  # 1,024 positions
    with pytest.raises(ValueError, match=r"1020 tokens and max_new_tokens=6 need 1025 positions, the model has 1024"):
        e.generate(prompt, max_new_tokens=6)


def test_rotary_scaling_extends_the_range(tiny_tokenizer):
    model = llama(rope={"rope_type": "yarn", "factor": 4.0})  # pretrained on 64 positions, scaled to 256
    e = engine(model)
    prompt = words(8, 3 * LIMIT)
    assert e.max_positions == 4 * LIMIT
    assert e.generate(prompt, max_new_tokens=4)[0] == plain_greedy(model, tiny_tokenizer, prompt, 4)  # as the model answers
    with pytest.raises(ValueError, match=rf"the model has {4 * LIMIT}"):
        e.generate(words(9, 4 * LIMIT), max_new_tokens=2)
