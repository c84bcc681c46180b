"""Token counting uses the engine's tokenizer, offline (issue 47, item 2).

LangChain's default ``get_token_ids`` fetches GPT-2's tokenizer from the Hugging Face hub; both classes count
with the engine's tokenizer instead, the chat model through the chat template it renders with, so that
``trim_messages(..., token_counter=chat)`` trims to the prompt the model will get.
"""

from __future__ import annotations

import socket

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
from langchain_core.tools import tool

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from langchain_cachegen import CacheGenLLM, ChatCacheGen, format_documents
from langchain_cachegen.chat_template import render_prompt


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection or resolve a name fails the test (and is recorded, should it be caught)."""
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"network access attempted: {args!r}")

    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield attempts
    assert not attempts, attempts


@pytest.fixture
def chat(tiny_llama, tiny_tokenizer):
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=64, background=False)
    return ChatCacheGen(llm=CacheGenLLM(engine=engine, model_id="tiny", max_tokens=2))


def _history(n: int) -> list:
    out: list = [SystemMessage(words(1, 12))]
    for i in range(n):
        out += [HumanMessage(words(10 + i, 9)), AIMessage(words(50 + i, 7))]
    return [*out, HumanMessage(words(99, 5))]


def test_counts_are_the_engines_tokens_and_nothing_is_fetched(chat, no_network):
    llm, tok = chat.llm, chat.engine.tokenizer
    text = words(2, 37)
    assert llm.get_num_tokens(text) == len(llm.get_token_ids(text)) == len(chat.engine.tokenize(text)) == 37
    assert chat.get_num_tokens(text) == len(tok(text, add_special_tokens=False)["input_ids"]) == 37
    assert llm.get_num_tokens(format_documents([words(3, 20), words(4, 30)]) + " w9") == 51  # markers are no tokens
    messages = _history(3)
    assert chat.get_num_tokens_from_messages(messages) == len(render_prompt(tok, messages))
    reply = chat.invoke(messages)
    assert chat.get_num_tokens_from_messages(messages) == reply.usage_metadata["input_tokens"]  # what the call is billed
    assert (
        llm.get_num_tokens_from_messages(messages)
        == llm.generate([llm._convert_input(messages).to_string()]).generations[0][0].generation_info["prompt_tokens"]
    )
    assert chat.get_num_tokens_from_messages([]) == 0


def test_tools_count_as_the_call_renders_them(chat, no_network):
    @tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        return "sunny"

    messages = [HumanMessage(words(5, 8))]
    with_tools = chat.get_num_tokens_from_messages(messages, tools=[get_weather])
    assert with_tools > chat.get_num_tokens_from_messages(messages)
    assert with_tools == chat.bind_tools([get_weather]).invoke(messages).usage_metadata["input_tokens"]
    with pytest.raises(ValueError, match="takes no tools"):
        chat.llm.get_num_tokens_from_messages(messages, tools=[get_weather])


def test_trim_messages_trims_to_the_budget(chat, no_network):
    messages = _history(20)
    assert chat.get_num_tokens_from_messages(messages) > 300
    trimmed = trim_messages(messages, max_tokens=100, token_counter=chat, strategy="last", include_system=True, start_on="human")
    assert 1 < len(trimmed) < len(messages) and trimmed[0] == messages[0] and trimmed[-1] == messages[-1]
    assert chat.get_num_tokens_from_messages(trimmed) <= 100  # the prompt the model gets fits
    assert chat.invoke(trimmed).usage_metadata["input_tokens"] <= 100
    first = messages.index(trimmed[1])
    assert chat.get_num_tokens_from_messages([messages[0], *messages[first - 2 :]]) > 100  # one more turn would not fit


def test_a_custom_counter_still_wins(chat, no_network):
    counted = ChatCacheGen(llm=chat.llm, custom_get_token_ids=lambda text: [0] * len(text))
    assert counted.get_num_tokens("abc") == 3
