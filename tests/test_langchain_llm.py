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
    # one stored option, never text: every warm call streams the same KV (the adaptive choice has its own tests)
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, store_options=[0], background=False,
                      allow_text=False)  # fmt: skip
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
    assert p["model_id"] == "tiny" and p["codec_id"].startswith("cachegen-v3-") and p["chunk_tokens"] == CHUNK
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


def test_finish_reason_length_at_the_token_limit_else_stop(llm):
    prompt = words(9, 40)
    info = llm.generate([prompt], max_new_tokens=3).generations[0][0].generation_info
    assert info["new_tokens"] == 3 and info["finish_reason"] == "length"
    full = llm.invoke(prompt)
    stop_word = full.split()[1]
    for result in (llm.generate([prompt], stop=[stop_word]), llm.generate([prompt], stop=[stop_word], max_new_tokens=2)):
        assert result.generations[0][0].generation_info["finish_reason"] == "stop"  # a stop sequence ended it
    chunks = list(llm._stream(prompt, stop=[stop_word]))
    assert chunks[-1].generation_info["finish_reason"] == "stop"
    assert list(llm._stream(prompt, max_new_tokens=2))[-1].generation_info["finish_reason"] == "length"


def test_usage_model_name_and_token_usage_are_reported(llm):
    prompts = [words(10, 50), words(11, 20)]
    result = llm.generate(prompts)
    infos = [g[0].generation_info for g in result.generations]
    for info in infos:
        assert info["model_name"] == "tiny"
        assert info["usage_metadata"] == {
            "input_tokens": info["prompt_tokens"],
            "output_tokens": info["new_tokens"],
            "total_tokens": info["prompt_tokens"] + info["new_tokens"],
            "input_token_details": {"cache_read": info["cached_tokens"], "cache_creation": info["tokens_queued"]},
        }
    assert [i["tokens_queued"] for i in infos] == [CHUNK, 0]  # the 50-token prompt's complete chunk; 20 tokens: none
    usage = result.llm_output["token_usage"]
    assert usage["prompt_tokens"] == sum(i["prompt_tokens"] for i in infos) == 70
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert result.llm_output["model_name"] == "tiny"
    warm = llm.generate(prompts[:1]).generations[0][0].generation_info
    assert warm["usage_metadata"]["input_token_details"] == {"cache_read": CHUNK, "cache_creation": 0}


def test_tracing_params_name_the_model(llm):
    params = llm._get_ls_params(stop=["w5"])
    assert params["ls_model_name"] == "tiny" and params["ls_provider"] == "cachegen" and params["ls_model_type"] == "llm"
    assert params["ls_max_tokens"] == 8 and params["ls_stop"] == ["w5"]
    assert llm._get_ls_params(max_new_tokens=4, temperature=0.5)["ls_max_tokens"] == 4
    assert llm._get_ls_params(temperature=0.5)["ls_temperature"] == 0.5
