"""The name a model is reported under (``model_name`` in generation info and response metadata, ``llm_output``, traces'
``ls_model_name``): the model's own, whichever way the LangChain classes were built, never a default's."""

from __future__ import annotations

from typing import Any

import torch
from langchain_core.messages import HumanMessage, SystemMessage
from transformers import AutoModelForCausalLM, AutoTokenizer

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from langchain_cachegen import CacheGenLLM, ChatCacheGen

OPTIONS: dict[str, Any] = {"chunk_tokens": 32, "level": "lossless", "background": False, "allow_text": False}


def _reported(llm: CacheGenLLM, prompt: str) -> tuple[set[str], dict[str, Any]]:
    """Every name ``llm`` reports for one answer to ``prompt``, and that answer's generation info."""
    result = llm.generate([prompt])
    info = result.generations[0][0].generation_info
    return {info["model_name"], result.llm_output["model_name"], result.llm_output["model_id"],
            llm._get_ls_params()["ls_model_name"], llm._identifying_params["model_id"]}, info  # fmt: skip


def test_your_own_model_in_bfloat16_is_reported_under_its_name(tiny_model_dir: str) -> None:
    """The own-model route of docs/quickstart.md: a transformers model loaded by the application, in bfloat16."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = KVEngine.from_pretrained(model, tokenizer=tok, store=MemoryStore(), profile=None, **OPTIONS)
    llm = CacheGenLLM(engine=engine, max_tokens=4)
    assert llm.engine.model is model and model.dtype == torch.bfloat16  # used as it is
    prompt = words(11, 100)
    names, cold = _reported(llm, prompt)
    assert names == {tiny_model_dir} and model.name_or_path == tiny_model_dir  # its name_or_path, not "smollm2-135m"
    _, warm = _reported(llm, prompt)
    assert cold["cached_tokens"] == 0 and warm["cached_tokens"] >= 96  # the bfloat16 KV was stored and reused

    chat = ChatCacheGen(llm=llm, max_tokens=4)
    reply = chat.invoke([SystemMessage(words(12, 40)), HumanMessage(words(13, 8))])
    assert reply.response_metadata["model_name"] == chat._get_ls_params()["ls_model_name"] == chat.model_id == tiny_model_dir


def test_an_engine_loaded_by_name_reports_that_name(tiny_model_dir: str) -> None:
    engine = KVEngine.from_pretrained(tiny_model_dir, store=MemoryStore(), profile=None, **OPTIONS)
    names, _ = _reported(CacheGenLLM(engine=engine, max_tokens=2), words(14, 20))
    assert names == {tiny_model_dir}


def test_a_nameless_model_is_reported_by_its_class_and_a_given_name_wins(tiny_llama, tiny_tokenizer) -> None:
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), **OPTIONS)
    assert tiny_llama.name_or_path == ""  # random init: no path, no id
    assert CacheGenLLM(engine=engine).model_id == "LlamaForCausalLM"
    llm = CacheGenLLM(engine=engine, model_id="my-llama", max_tokens=2)
    names, _ = _reported(llm, words(15, 20))
    assert names == {"my-llama"} and ChatCacheGen(llm=llm).model_id == "my-llama"
