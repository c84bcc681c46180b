"""ChatCacheGen: a chat model over a CacheGenLLM, sharing its loader, engine and stop handling."""

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGenerationChunk
from langchain_tests.unit_tests import ChatModelUnitTests

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import make_tiny_llama, make_tiny_tokenizer, words
from langchain_cachegen.chat_models import ChatCacheGen
from langchain_cachegen.chat_template import render_prompt
from langchain_cachegen.llms import CacheGenLLM

CHUNK = 32


@pytest.fixture
def llm(tiny_llama, tiny_tokenizer):
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, background=False)
    return CacheGenLLM(engine=engine, model_id="tiny", generation_kwargs={"max_new_tokens": 8})


class _Tokens(BaseCallbackHandler):
    def __init__(self):
        self.tokens, self.chunk_types = [], set()

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)
        self.chunk_types.add(type(kwargs.get("chunk")))


def _record_engine_calls(engine, monkeypatch):
    """Record the generation kwargs each engine call receives."""
    calls = []
    for name in ("generate_many", "stream"):
        real = getattr(engine, name)

        def spy(prompts, _real=real, _name=name, **gen):
            calls.append((_name, prompts, {k: v for k, v in gen.items() if k != "cancel"}))  # the generation kwargs only
            return _real(prompts, **gen)

        monkeypatch.setattr(engine, name, spy)
    return calls


def test_chat_history_is_reused_turn_after_turn(tiny_llama, tiny_tokenizer):
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, background=False)
    chat = ChatCacheGen(llm=CacheGenLLM(engine=engine, model_id="tiny"), max_tokens=6)
    history = [SystemMessage(words(20, 30))]
    cached = []
    for turn in range(5):
        history.append(HumanMessage(words(30 + turn, 25)))
        reply = chat.invoke(history)
        cached.append(reply.response_metadata["cached_tokens"])
        history.append(AIMessage(reply.content))
        n_prompt = len(render_prompt(tiny_tokenizer, history[:-1]))
        assert reply.usage_metadata["input_tokens"] == n_prompt
    assert cached[0] == 0
    # from turn 2 on, every complete chunk of the previous turn's prompt is reused
    assert all(c >= CHUNK for c in cached[1:]) and cached == sorted(cached)


def test_chat_without_template_uses_plain_rendering(tiny_llama):
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    ids = render_prompt(tok, [HumanMessage("w10 w11")])
    assert tok.decode(ids).startswith("<pad>")  # 'user:' is unknown to the word vocabulary, but rendering works


def test_chat_wraps_the_llm_and_generates_from_rendered_token_ids(llm, monkeypatch):
    chat = ChatCacheGen(llm=llm)
    assert chat.engine is llm.engine and chat.model_id == "tiny"
    calls = _record_engine_calls(llm.engine, monkeypatch)
    messages = [SystemMessage(words(50, 20)), HumanMessage(words(51, 10))]
    reply = chat.invoke(messages)
    ((name, prompts, gen),) = calls
    assert name == "generate_many" and prompts == [render_prompt(llm.engine.tokenizer, messages)]
    assert gen == {"max_new_tokens": 8}  # the LLM's generation kwargs, as no chat field overrides them
    assert reply.usage_metadata["output_tokens"] == reply.response_metadata["new_tokens"] <= 8
    assert reply.response_metadata["model_name"] == "tiny"


def test_chat_fields_and_call_kwargs_map_onto_the_llm_generation_kwargs(llm, monkeypatch):
    chat = ChatCacheGen(llm=llm, max_tokens=3, temperature=0.7, stop=["w99"])
    calls = _record_engine_calls(llm.engine, monkeypatch)
    chat.invoke([HumanMessage(words(52, 10))], top_k=5)
    list(chat.stream([HumanMessage(words(52, 10))], stop=["w98"], max_new_tokens=2))
    expected = {"max_new_tokens": 3, "do_sample": True, "temperature": 0.7, "top_k": 5, "stop": ["w99"]}
    assert calls[0][0] == "generate_many" and calls[0][2] == expected
    assert calls[1][0] == "stream"
    assert calls[1][2] == {"max_new_tokens": 2, "do_sample": True, "temperature": 0.7, "stop": ["w98"]}
    assert llm.generation_kwargs == {"max_new_tokens": 8}  # per call only


def test_chat_stream_matches_invoke_and_ends_with_metadata(llm):
    chat = ChatCacheGen(llm=llm)
    messages = [SystemMessage(words(53, 40)), HumanMessage(words(54, 10))]
    chat.invoke(messages)  # cold: stores the history's chunk
    text = chat.invoke(messages).content

    cb = _Tokens()
    chunks = list(chat.stream(messages, config={"callbacks": [cb]}))
    assert "".join(c.content for c in chunks) == text == "".join(cb.tokens)  # each token reported once
    last = chunks[-1]
    assert last.chunk_position == "last" and last.response_metadata["cached_tokens"] == CHUNK
    assert last.usage_metadata["input_tokens"] == len(render_prompt(llm.engine.tokenizer, messages))
    assert ChatCacheGen(llm=llm, streaming=True).invoke(messages).content == text


def test_chat_event_stream_reports_each_token_once_as_a_chat_chunk(llm):
    chat = ChatCacheGen(llm=llm)
    messages = [HumanMessage(words(57, 20))]
    text = chat.invoke(messages).content
    cb = _Tokens()
    stream = chat.stream_events(messages, version="v3", config={"callbacks": [cb]})
    assert stream.output.text == text == "".join(cb.tokens)  # the chat model gets a run manager here
    assert cb.chunk_types == {ChatGenerationChunk}


def test_chat_stop_sequences_are_honoured(llm):
    chat = ChatCacheGen(llm=llm)
    messages = [HumanMessage(words(55, 20))]  # shorter than a chunk: every call computes the same text
    full = chat.invoke(messages).content
    stop_word = full.split()[2]
    cut = full[: full.find(stop_word)]
    assert chat.invoke(messages, stop=[stop_word]).content == cut
    assert "".join(c.content for c in chat.stream(messages, stop=[stop_word])) == cut
    assert ChatCacheGen(llm=llm, stop=[stop_word]).invoke(messages).content == cut


def test_chat_identifying_and_tracing_params(llm):
    chat = ChatCacheGen(llm=llm, max_tokens=5)
    assert chat._identifying_params == {**llm._identifying_params, "generation_kwargs": {"max_new_tokens": 5}}  # the real settings
    assert ChatCacheGen(llm=llm, temperature=0.5)._identifying_params["generation_kwargs"] == {
        "max_new_tokens": 8,
        "do_sample": True,
        "temperature": 0.5,
    }
    assert chat._llm_type == "cachegen-chat"
    assert chat._get_ls_params()["ls_max_tokens"] == 5
    assert ChatCacheGen(llm=llm)._get_ls_params()["ls_max_tokens"] == 8  # the LLM's max_new_tokens


def test_chat_from_model_id_takes_the_llm_options(tiny_llama, tiny_tokenizer, tmp_path):
    tiny_llama.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    chat = ChatCacheGen.from_model_id(tmp_path / "m", store=MemoryStore(), chunk_tokens=CHUNK, level=1, background=False,
                                      generation_kwargs={"max_new_tokens": 3}, engine_kwargs={"store_options": [1, 2]},
                                      max_tokens=2, stop=["w9"])  # fmt: skip
    assert isinstance(chat.llm, CacheGenLLM) and chat.llm.model_id == str(tmp_path / "m")
    assert chat.llm.generation_kwargs == {"max_new_tokens": 3}
    assert (chat.engine.level, chat.engine.chunk_tokens, chat.engine.store_options) == (1, CHUNK, [1, 2])
    assert (chat.max_tokens, chat.stop) == (2, ["w9"])
    assert chat.invoke([HumanMessage(words(56, 10))]).usage_metadata["output_tokens"] <= 2


class TestChatCacheGenStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatCacheGen

    @property
    def standard_chat_model_params(self):
        """The suite's generation parameters; not a hosted model's ``timeout``, ``max_retries`` and ``api_key``: a
        local model has no request to time out, retry or authorise, and ChatCacheGen refuses what it would ignore."""
        params = super().standard_chat_model_params
        refused = {k: params.pop(k) for k in ("timeout", "max_retries", "api_key") if k in params}
        assert refused and params == {"temperature": 0, "max_tokens": 100, "stop": []}, params
        return params

    @property
    def chat_model_params(self):
        engine = _shared_engine()
        return {"llm": CacheGenLLM(engine=engine, model_id="tiny")}


_ENGINE = None


def _shared_engine():
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = KVEngine(make_tiny_llama(), make_tiny_tokenizer(), store=MemoryStore(), chunk_tokens=CHUNK, background=False)
    return _ENGINE


def test_chat_reports_finish_reason_and_cache_reads_in_usage(llm):
    chat = ChatCacheGen(llm=llm)
    messages = [SystemMessage(words(58, 40)), HumanMessage(words(59, 5))]
    cold = chat.invoke(messages, max_new_tokens=2)
    assert cold.response_metadata["finish_reason"] == "length" and cold.usage_metadata["output_tokens"] == 2
    assert cold.usage_metadata["input_token_details"] == {"cache_read": 0, "cache_creation": CHUNK}  # its complete chunk stored
    warm = chat.invoke(messages)
    assert warm.usage_metadata["input_token_details"] == {"cache_read": warm.response_metadata["cached_tokens"], "cache_creation": 0}
    assert warm.response_metadata["cached_tokens"] == CHUNK
    assert "usage_metadata" not in warm.response_metadata  # usage is the message's, not repeated in the metadata
    stop_word = warm.content.split()[0]
    assert chat.invoke(messages, stop=[stop_word]).response_metadata["finish_reason"] == "stop"


def test_chat_stream_carries_usage_and_finish_reason_once(llm):
    chat = ChatCacheGen(llm=llm)
    messages = [HumanMessage(words(60, 20))]
    chunks = list(chat.stream(messages))
    with_usage = [c for c in chunks if c.usage_metadata]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert [c.response_metadata.get("finish_reason") for c in chunks].count(chunks[-1].response_metadata["finish_reason"]) == 1
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    invoked = chat.invoke(messages)
    assert full.usage_metadata["input_tokens"] == invoked.usage_metadata["input_tokens"]
    assert full.usage_metadata["output_tokens"] == invoked.usage_metadata["output_tokens"]
    assert full.response_metadata["model_name"] == "tiny"


def test_with_default_settings_the_next_turn_reuses_the_last_without_flush(tiny_llama, tiny_tokenizer, tmp_path, monkeypatch):
    """Default engine (disk store in the user cache, background writer, 1536-token chunks): the turn right
    after a long first turn finds its complete chunks, nobody having waited for the writer."""
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path))
    chat = ChatCacheGen(llm=CacheGenLLM(engine=KVEngine(tiny_llama, tiny_tokenizer), generation_kwargs={"max_new_tokens": 4}))
    history = [SystemMessage(words(70, 1700)), HumanMessage(words(71, 10))]
    first = chat.invoke(history)
    assert first.response_metadata["cached_tokens"] == 0
    history += [first, HumanMessage(words(72, 10))]
    second = chat.invoke(history)  # straight away: no flush()
    assert second.response_metadata["cached_tokens"] >= 1536
    chat.engine.flush()
