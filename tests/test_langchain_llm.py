import pytest
from langchain_core.prompts import PromptTemplate

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from langchain_cachegen.chat_models import ChatCacheGen
from langchain_cachegen.llms import CacheGenLLM

CHUNK = 32


@pytest.fixture
def llm(tiny_llama, tiny_tokenizer):
    # one stored option: every warm call streams the same KV (the adaptive choice has its own tests)
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, store_options=[0], background=False)
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


def test_identifying_params(llm):
    p = llm._identifying_params
    assert p["model_id"] == "tiny" and p["codec_id"].startswith("cachegen-v1-") and p["chunk_tokens"] == CHUNK
    assert llm._llm_type == "cachegen"


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
