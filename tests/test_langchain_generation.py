"""LangChain's generation parameters on CacheGenLLM and ChatCacheGen: per call and through ``bind``, on invoke,
stream and batch, with their usual meaning (``generation.py``), and a clear error for any other keyword."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from langchain_cachegen import CacheGenLLM, ChatCacheGen
from langchain_cachegen.generation import ACCEPTED, to_transformers

SEEDS = range(4)


@pytest.fixture(params=["llm", "chat"])
def model(request, tiny_llama, tiny_tokenizer):
    """Each class over a fresh engine; prompts shorter than a chunk, so every call computes the same KV."""
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=256, partial_step=0, background=False)
    llm = CacheGenLLM(engine=engine, model_id="tiny", generation_kwargs={"max_new_tokens": 8})
    return llm if request.param == "llm" else ChatCacheGen(llm=llm)


def _prompt(model, seed: int = 1):
    text = words(seed, 30)
    return [HumanMessage(text)] if isinstance(model, ChatCacheGen) else text


def _text(out) -> str:
    return out if isinstance(out, str) else out.content


def _stream(model, prompt, **kw) -> str:
    return "".join(_text(c) for c in model.stream(prompt, **kw))


def _new_tokens(model, prompt, **kw) -> int:
    if isinstance(model, ChatCacheGen):
        return model.invoke(prompt, **kw).usage_metadata["output_tokens"]
    return model.generate([prompt], **kw).generations[0][0].generation_info["new_tokens"]


def test_max_tokens_per_call_through_bind_on_invoke_stream_and_batch(model):
    prompt = _prompt(model)
    full = _text(model.invoke(prompt))
    assert _new_tokens(model, prompt) == 8
    short = _text(model.invoke(prompt, max_tokens=3))
    assert short and full.startswith(short) and short != full and _new_tokens(model, prompt, max_tokens=3) == 3
    assert _text(model.bind(max_tokens=3).invoke(prompt)) == short
    assert _stream(model, prompt, max_tokens=3) == _stream(model.bind(max_tokens=3), prompt) == short
    assert [_text(o) for o in model.batch([prompt, prompt], max_tokens=3)] == [short, short]
    assert [_text(o) for o in model.bind(max_tokens=3).batch([prompt])] == [short]


def test_temperature_samples_and_seed_repeats_a_sample(model):
    prompt = _prompt(model)
    greedy = _text(model.invoke(prompt))
    assert _text(model.invoke(prompt, temperature=0)) == greedy
    sampled = [_text(model.invoke(prompt, temperature=1.5, seed=s)) for s in SEEDS]
    assert any(t != greedy for t in sampled)  # sampling, not the greedy answer with a warning
    assert [_text(model.bind(temperature=1.5, seed=s).invoke(prompt)) for s in SEEDS] == sampled  # a seed repeats its sample
    assert [_stream(model, prompt, temperature=1.5, seed=s) for s in SEEDS] == sampled
    assert [_text(o) for o in model.batch([prompt] * 2, temperature=1.5, seed=0)] == sampled[:1] * 2


def test_top_p_restricts_sampling(model):
    prompt = _prompt(model)
    greedy = _text(model.invoke(prompt))
    assert all(_text(model.invoke(prompt, top_p=1e-6, seed=s)) == greedy for s in SEEDS)  # the nucleus is the top token
    assert any(_text(model.invoke(prompt, top_p=1.0, seed=s)) != greedy for s in SEEDS)  # top_p alone samples (temperature 1)
    assert all(_text(model.invoke(prompt, top_k=1, temperature=2.0, seed=s)) == greedy for s in SEEDS)


def test_stop_per_call_and_through_bind(model):
    prompt = _prompt(model)
    full = _text(model.invoke(prompt))
    word = full.split()[2]
    cut = full[: full.find(word)]
    assert _text(model.invoke(prompt, stop=[word])) == _text(model.bind(stop=[word]).invoke(prompt)) == cut
    assert _stream(model.bind(stop=[word]), prompt) == cut


async def test_an_unknown_keyword_is_a_clear_error_everywhere(model):
    prompt = _prompt(model)
    calls = [lambda: model.invoke(prompt, max_length=3), lambda: list(model.stream(prompt, max_length=3)),
             lambda: model.batch([prompt], max_length=3), lambda: model.bind(max_length=3).invoke(prompt)]  # fmt: skip
    for call in calls:
        with pytest.raises(TypeError, match="max_length.*accepted: max_tokens, temperature, top_p, top_k, seed, stop"):
            call()
    with pytest.raises(TypeError, match="max_length"):
        await model.ainvoke(prompt, max_length=3)
    with pytest.raises(TypeError, match="max_length"):
        [c async for c in model.astream(prompt, max_length=3)]


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ({"max_tokens": 3}, {"max_new_tokens": 3}),
        ({"temperature": 0.7}, {"max_new_tokens": 8, "do_sample": True, "temperature": 0.7}),
        ({"temperature": 0, "top_p": 0.5}, {"max_new_tokens": 8, "do_sample": False}),
        ({"top_p": 0.5, "seed": 3}, {"max_new_tokens": 8, "do_sample": True, "top_p": 0.5, "seed": 3}),
        ({"max_tokens": None, "temperature": None}, {"max_new_tokens": 8}),
    ],
)
def test_the_mapping_to_transformers_names(call, expected):
    assert to_transformers({"max_new_tokens": 8}, call, "x") == expected
    assert set(ACCEPTED) >= set(call)


def test_greedy_drops_sampling_defaults_and_bad_values_are_refused():
    defaults = {"max_new_tokens": 8, "do_sample": True, "temperature": 0.5}
    assert to_transformers(defaults, {"temperature": 0}, "x") == {"max_new_tokens": 8, "do_sample": False}
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": 0}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            to_transformers({}, bad, "x")


def test_tracing_params_follow_the_call(model):
    params = model._get_ls_params(max_tokens=3, temperature=0.5)
    assert params["ls_max_tokens"] == 3 and params["ls_temperature"] == 0.5
    assert model._get_ls_params()["ls_max_tokens"] == 8
