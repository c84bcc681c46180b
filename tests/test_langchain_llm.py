import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.prompts import PromptTemplate
from langchain_tests.unit_tests import ChatModelUnitTests

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from langchain_cachegen.chat_models import ChatCacheGen
from langchain_cachegen.chat_template import render_prompt
from langchain_cachegen.llms import CacheGenLLM
from langchain_cachegen.stop import StopStreamer, cut_at_stop
from tests.conftest import make_tiny_llama, make_tiny_tokenizer, words

CHUNK = 32


@pytest.fixture
def llm(tiny_llama, tiny_tokenizer):
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, background=False)
    return CacheGenLLM(engine=engine, model_id="tiny", generation_kwargs={"max_new_tokens": 8})


def test_invoke_twice_hits_cache_with_same_text(llm):
    prompt = words(1, 100)
    r1 = llm.generate([prompt])
    r2 = llm.generate([prompt])
    g1, g2 = r1.generations[0][0], r2.generations[0][0]
    assert g1.text == g2.text
    assert g1.generation_info["cached_tokens"] == 0 and g2.generation_info["cached_tokens"] == 96


def test_stream_yields_the_same_text_as_generate(llm):
    prompt = words(2, 70)
    text = llm.invoke(prompt)
    assert "".join(llm.stream(prompt)) == text


def test_callbacks_get_every_token(llm):
    from langchain_core.callbacks import BaseCallbackHandler

    class Collect(BaseCallbackHandler):
        tokens: list[str] = []

        def on_llm_new_token(self, token, **kwargs):
            self.tokens.append(token)

    cb = Collect()
    text = "".join(llm.stream(words(3, 40), config={"callbacks": [cb]}))
    assert "".join(cb.tokens) == text and len(cb.tokens) > 1


def test_batch_and_chain(llm):
    prompts = [words(4, 50), words(5, 60), words(4, 50)]
    out = llm.batch(prompts)
    assert out[0] == out[2] and len(out) == 3
    chain = PromptTemplate.from_template("{doc} w9 w10") | llm
    assert isinstance(chain.invoke({"doc": words(6, 40)}), str)


async def test_ainvoke(llm):
    prompt = words(7, 45)
    llm.invoke(prompt)  # cold: stores the chunk
    warm = llm.invoke(prompt)
    result = await llm.ainvoke(prompt)
    assert result == warm


def test_stop_sequences_are_honoured(llm):
    prompt = words(8, 50)
    full = llm.invoke(prompt)
    stop_word = full.split()[2]
    cut = full[: full.find(stop_word)]
    assert llm.invoke(prompt, stop=[stop_word]) == cut
    assert "".join(llm.stream(prompt, stop=[stop_word])) == cut


def test_stop_helpers():
    assert cut_at_stop("abc STOP def", ["STOP"]) == ("abc ", True)
    s = StopStreamer(["END"])
    out = "".join(s.feed(p) for p in ["hello E", "N", "D more"]) + s.finish()
    assert out == "hello "
    s = StopStreamer(["END"])
    assert "".join(s.feed(p) for p in ["a E", "x"]) + s.finish() == "a Ex"


def test_identifying_params(llm):
    p = llm._identifying_params
    assert p["model_id"] == "tiny" and p["codec_id"].startswith("cachegen-v1-") and p["chunk_tokens"] == CHUNK
    assert llm._llm_type == "cachegen"


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


class TestChatCacheGenStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatCacheGen

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


def test_from_model_id_loads_a_local_dir_with_streaming_options(tiny_llama, tiny_tokenizer, tmp_path):
    tiny_llama.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    llm = CacheGenLLM.from_model_id(tmp_path / "m", store=MemoryStore(), chunk_tokens=CHUNK, level=1, slo_s=2.0,
                                    estimator="last", background=False, generation_kwargs={"max_new_tokens": 3})  # fmt: skip
    assert (llm.engine.slo_s, llm.engine.estimator_name, llm.engine.level, llm.engine.chunk_tokens) == (2.0, "last", 1, CHUNK)
    prompt = words(40, 2 * CHUNK + 2)
    llm.invoke(prompt)
    info = llm.generate([prompt]).generations[0][0].generation_info
    assert info["cached_tokens"] == 2 * CHUNK and len(info["stream"]) == 2
    chat = ChatCacheGen.from_model_id(tmp_path / "m", store=MemoryStore(), slo_s=1.0, background=False)
    assert chat.engine.slo_s == 1.0
