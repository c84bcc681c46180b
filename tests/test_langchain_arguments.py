"""Every construction argument of CacheGenLLM and ChatCacheGen is honoured or refused (issue 47, items 1 and 8).

LangChain's generation fields (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``) mean at
construction what they mean per call; a call's override them; anything else is a ``TypeError`` naming the
accepted keywords, raised before a model is loaded; ``generation_kwargs`` are checked when given. An empty prompt
is answered by both classes.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import make_tiny_tokenizer, words
from langchain_cachegen import CacheGenLLM, ChatCacheGen

SEEDS = range(4)


@pytest.fixture
def engine(tiny_llama, tiny_tokenizer):
    """Prompts shorter than a chunk and no partial chunks: every call computes the same KV."""
    return KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=256, partial_step=0, background=False)


def _new_tokens(model, prompt, **kw) -> int:
    if isinstance(model, ChatCacheGen):
        return model.invoke([HumanMessage(prompt)], **kw).usage_metadata["output_tokens"]
    return model.generate([prompt], **kw).generations[0][0].generation_info["new_tokens"]


def _text(model, prompt, **kw) -> str:
    out = model.invoke([HumanMessage(prompt)] if isinstance(model, ChatCacheGen) else prompt, **kw)
    return out if isinstance(out, str) else out.content


def test_generation_fields_at_construction_mean_what_they_mean_per_call(engine):
    prompt = words(1, 30)
    llm = CacheGenLLM(engine=engine, max_tokens=3)
    assert _new_tokens(llm, prompt) == 3 and _new_tokens(llm, prompt, max_tokens=5) == 5  # the call's overrides the field's
    greedy = _text(CacheGenLLM(engine=engine, max_tokens=8), prompt)
    for model in (CacheGenLLM(engine=engine, max_tokens=8, temperature=1.5, seed=2), ChatCacheGen(llm=llm, max_tokens=8, temperature=1.5, seed=2)):
        per_call = CacheGenLLM(engine=engine, max_tokens=8) if isinstance(model, CacheGenLLM) else ChatCacheGen(llm=llm, max_tokens=8)
        assert _text(model, prompt) == _text(per_call, prompt, temperature=1.5, seed=2)  # the same sample as per call
        assert _text(model, prompt, temperature=0) == _text(per_call, prompt)  # a call's temperature 0: greedy
    sampled = [_text(CacheGenLLM(engine=engine, max_tokens=8, top_p=1.0, seed=s), prompt) for s in SEEDS]
    assert any(t != greedy for t in sampled)  # top_p alone samples, as per call
    assert all(_text(CacheGenLLM(engine=engine, max_tokens=8, top_k=1, temperature=2.0, seed=s), prompt) == greedy for s in SEEDS)
    chat = ChatCacheGen(llm=llm, max_tokens=6, top_k=1, temperature=2.0, seed=0)
    assert _new_tokens(chat, prompt) == 6 and _text(chat, prompt) == _text(ChatCacheGen(llm=llm, max_tokens=6), prompt)


def test_stop_at_construction_cuts_the_answer_and_a_calls_replaces_it(engine):
    prompt = words(2, 30)
    full = _text(CacheGenLLM(engine=engine, max_tokens=8), prompt)
    first, third = full.split()[1], full.split()[3]
    llm = CacheGenLLM(engine=engine, max_tokens=8, stop=[first])
    assert llm.invoke(prompt) == "".join(llm.stream(prompt)) == full[: full.find(first)]
    assert llm.invoke(prompt, stop=[third]) == full[: full.find(third)]
    assert llm.generate([prompt]).generations[0][0].generation_info["finish_reason"] == "stop"


def test_the_chats_fields_override_the_llms(engine):
    llm = CacheGenLLM(engine=engine, max_tokens=3, temperature=1.5, seed=1)
    assert _new_tokens(ChatCacheGen(llm=llm), words(3, 20)) == 3
    assert _new_tokens(ChatCacheGen(llm=llm, max_tokens=5), words(3, 20)) == 5
    greedy = ChatCacheGen(llm=CacheGenLLM(engine=engine, max_tokens=3))
    assert _text(ChatCacheGen(llm=llm, temperature=0), words(3, 20)) == _text(greedy, words(3, 20))


def test_generation_kwargs_sampling_settings_sample(engine):
    prompt = words(4, 30)
    greedy = _text(CacheGenLLM(engine=engine, max_tokens=8), prompt)
    sampled = [_text(CacheGenLLM(engine=engine, generation_kwargs={"max_new_tokens": 8, "temperature": 1.5}, seed=s), prompt) for s in SEEDS]
    assert any(t != greedy for t in sampled)  # not dropped for want of do_sample
    off = CacheGenLLM(engine=engine, generation_kwargs={"max_new_tokens": 8, "temperature": 1.5, "do_sample": False})
    assert _text(off, prompt) == greedy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"foo": 1}, r"'foo'\. Accepted: .*max_tokens"),
        ({"temperature": 0.9, "foo": 1}, "'foo'"),
        ({"pipeline_kwargs": {"max_new_tokens": 3}}, "HuggingFacePipeline's option: pass transformers' generate arguments as generation_kwargs"),
        ({"max_new_tokens": 3}, "use max_tokens"),
        ({"max_token": 3}, "did you mean 'max_tokens'"),
        ({"generation_kwargs": {"max_new_token": 3}}, "generation_kwargs got .*'max_new_token' \\(did you mean 'max_new_tokens'\\?\\)"),
        ({"generation_kwargs": {"max_tokens": 3}}, "generation_kwargs takes transformers' names: max_new_tokens"),
        ({"generation_kwargs": {"max_length": 30}}, "max_length': it counts the prompt too"),
        ({"store": None}, "'store': an option of CacheGenLLM.from_model_id"),
    ],
)
def test_an_unknown_keyword_is_refused_naming_the_accepted_ones(engine, kwargs, match):
    with pytest.raises(TypeError, match=match):
        CacheGenLLM(engine=engine, **kwargs)


def test_the_chat_refuses_what_it_would_ignore(engine):
    llm = CacheGenLLM(engine=engine)
    with pytest.raises(TypeError, match="'max_new_tokens': transformers' name: use max_tokens.*Accepted: .*top_k"):
        ChatCacheGen(llm=llm, max_new_tokens=3)
    with pytest.raises(TypeError, match="'foo'"):
        ChatCacheGen(llm=llm, top_k=3, foo=1)
    with pytest.raises(TypeError, match="'generation_kwargs': an option of the CacheGenLLM"):
        ChatCacheGen(llm=llm, generation_kwargs={"max_new_tokens": 3})
    for bad in ({"temperature": -1}, {"top_p": 2.0}, {"top_k": 0}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            ChatCacheGen(llm=llm, **bad)
        with pytest.raises(ValueError):
            CacheGenLLM(engine=engine, **bad)
    with pytest.raises(ValueError, match="temperature"):
        CacheGenLLM(engine=engine, generation_kwargs={"temperature": -1})


@pytest.mark.parametrize("cls", [CacheGenLLM, ChatCacheGen])
def test_from_model_id_refuses_before_loading_anything(cls, tmp_path):
    missing = tmp_path / "no-such-model"  # loading it would fail otherwise: the keyword is checked first
    with pytest.raises(TypeError, match="from_model_id got unexpected keyword argument\\(s\\) 'foo'.*Accepted: .*store"):
        cls.from_model_id(missing, foo=1)
    with pytest.raises(TypeError, match="'max_new_tokenz'"):
        cls.from_model_id(missing, generation_kwargs={"max_new_tokenz": 3})
    with pytest.raises(TypeError, match="'pipeline_kwargs'"):
        cls.from_model_id(missing, pipeline_kwargs={"max_new_tokens": 3})


def test_from_model_id_honours_the_generation_fields(tiny_model_dir):
    llm = CacheGenLLM.from_model_id(tiny_model_dir, store=MemoryStore(), background=False, max_tokens=4, temperature=0.5)
    assert (llm.max_tokens, llm.temperature) == (4, 0.5) and _new_tokens(llm, words(5, 20)) == 4
    assert llm._identifying_params["generation_kwargs"] == {"max_new_tokens": 4, "do_sample": True, "temperature": 0.5}
    params = llm._get_ls_params()
    assert (params["ls_max_tokens"], params["ls_temperature"]) == (4, 0.5)
    chat = ChatCacheGen.from_model_id(tiny_model_dir, store=MemoryStore(), background=False, top_k=3, max_tokens=2)
    assert chat.top_k == 3 and _new_tokens(chat, words(6, 10)) == 2
    assert chat._identifying_params["generation_kwargs"] == {"max_new_tokens": 2, "do_sample": True, "top_k": 3}


def test_tracing_reports_the_real_settings(engine):
    llm = CacheGenLLM(engine=engine, max_tokens=4, stop=["w9"])
    params = llm._get_ls_params()
    assert (params["ls_max_tokens"], params["ls_temperature"], params["ls_stop"]) == (4, 0.0, ["w9"])  # greedy: temperature 0
    assert llm._get_ls_params(stop=["w8"], max_tokens=2)["ls_stop"] == ["w8"]
    chat = ChatCacheGen(llm=llm, temperature=0.7)
    params = chat._get_ls_params(max_tokens=9)
    assert (params["ls_max_tokens"], params["ls_temperature"], params["ls_stop"]) == (9, 0.7, ["w9"])
    assert chat._get_ls_params(foo=1)["ls_max_tokens"] == 4  # tracing a bad call never fails (the call does)


def test_an_empty_prompt_is_answered_by_both_classes(engine):
    llm = CacheGenLLM(engine=engine, max_tokens=4)
    start = [engine.tokenizer.bos_token_id]
    text, info = engine.generate(start, max_new_tokens=4)
    assert llm.invoke("") == "".join(llm.stream("")) == text and info.prompt_tokens == 1
    assert llm.generate([""]).generations[0][0].generation_info["prompt_tokens"] == 1
    reply = ChatCacheGen(llm=llm).invoke("")  # an empty message, rendered by the chat template
    assert reply.usage_metadata["output_tokens"] > 0


def test_an_empty_prompt_without_bos_starts_from_eos_and_without_either_is_a_clear_error(tiny_llama):
    tok = make_tiny_tokenizer()
    tok.bos_token = None
    llm = CacheGenLLM(engine=KVEngine(tiny_llama, tok, store=MemoryStore(), background=False), max_tokens=2)
    assert llm.generate([""]).generations[0][0].generation_info["prompt_tokens"] == 1
    assert llm.invoke("") == llm.engine.generate([tok.eos_token_id], max_new_tokens=2)[0]
    tok.eos_token = None
    with pytest.raises(ValueError, match="empty prompt"):
        llm.invoke("")
