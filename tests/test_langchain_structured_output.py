"""ChatCacheGen.with_structured_output: JSON answers steered by the prompt and the answer's first token."""

import json

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from langchain_cachegen.chat_models import ChatCacheGen
from langchain_cachegen.chat_template import render_prompt
from langchain_cachegen.llms import CacheGenLLM
from langchain_cachegen.structured_output import response_format_prompt
from langchain_cachegen.tool_calls import forced_call_prefill
from tests.langchain_scripted import script_answers


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


class JokeDict(TypedDict):
    """Joke to tell user."""

    setup: str
    punchline: str


JOKE = {"setup": "Why?", "punchline": "Because."}
ANSWER = json.dumps(JOKE)[1:]  # what the model writes after the prefilled "{"


@pytest.fixture
def chat(tiny_llama, tiny_tokenizer):
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=32, level=0, background=False)
    return ChatCacheGen(llm=CacheGenLLM(engine=engine, model_id="tiny", generation_kwargs={"max_new_tokens": 8}))


@pytest.mark.parametrize("schema", [Joke, JokeDict, Joke.model_json_schema()])
def test_json_schema_method_prompts_the_schema_and_starts_the_object(chat, monkeypatch, schema):
    calls = script_answers(chat.engine, monkeypatch, ANSWER)
    result = chat.with_structured_output(schema).invoke([SystemMessage("w7"), HumanMessage("w9")])
    assert result == (Joke(**JOKE) if schema is Joke else JOKE)
    system_text, prefill = response_format_prompt({"type": "json_schema", "json_schema": {"schema": convert_to_json_schema(schema)}})
    assert prefill == "{" and json.dumps(convert_to_json_schema(schema)) in system_text
    expected = list(render_prompt(chat.engine.tokenizer, [SystemMessage("w7"), HumanMessage("w9")], system_text=system_text, prefill="{"))
    assert calls[0]["prompt"] == expected


def test_json_mode_only_starts_the_object(chat, monkeypatch):
    calls = script_answers(chat.engine, monkeypatch, ANSWER)
    assert chat.with_structured_output(Joke, method="json_mode").invoke("w9") == Joke(**JOKE)
    assert chat.with_structured_output(None, method="json_mode").invoke("w9") == JOKE
    assert calls[0]["prompt"] == list(render_prompt(chat.engine.tokenizer, [HumanMessage("w9")], prefill="{"))


@pytest.mark.parametrize("schema", [Joke, JokeDict])
def test_function_calling_method_forces_the_schema_as_a_tool(chat, monkeypatch, schema):
    calls = script_answers(chat.engine, monkeypatch, json.dumps(JOKE)[1:] + "}\n</tool_call>")
    assert chat.with_structured_output(schema, method="function_calling").invoke("w9") == (Joke(**JOKE) if schema is Joke else JOKE)
    tool = convert_to_openai_tool(schema)
    prefill = forced_call_prefill([tool], tool["function"]["name"])
    assert calls[0]["prompt"] == list(render_prompt(chat.engine.tokenizer, [HumanMessage("w9")], tools=[tool], prefill=prefill))


def test_structured_stream_yields_growing_objects(chat, monkeypatch):
    script_answers(chat.engine, monkeypatch, ANSWER)
    jokes = list(chat.with_structured_output(Joke).stream("w9"))  # once the partial JSON validates
    assert jokes[-1] == Joke(**JOKE) and all(isinstance(j, Joke) for j in jokes)
    parts = list(chat.with_structured_output(JokeDict).stream("w9"))
    assert parts[-1] == JOKE and len(parts) > 1 and all(set(p) <= set(JOKE) for p in parts)


def test_include_raw_returns_the_message_and_the_parsing_error(chat, monkeypatch):
    script_answers(chat.engine, monkeypatch, '"setup": 3')
    out = chat.with_structured_output(Joke, include_raw=True).invoke("w9")
    assert out["parsed"] is None and out["parsing_error"] is not None and out["raw"].content == '{"setup": 3'
    with pytest.raises(Exception, match="Failed to parse"):
        chat.with_structured_output(Joke).invoke("w9")


def test_structured_output_is_traced_with_its_schema(chat, monkeypatch):
    from langchain_core.callbacks import BaseCallbackHandler

    class Options(BaseCallbackHandler):
        def __init__(self):
            self.options = []

        def on_chat_model_start(self, serialized, messages, *, options=None, **kwargs):
            self.options.append(options)

    script_answers(chat.engine, monkeypatch, ANSWER)
    for method in ("json_schema", "json_mode", "function_calling"):
        cb = Options()
        chat.with_structured_output(Joke, method=method).invoke("w9", config={"callbacks": [cb]})
        assert cb.options[0]["ls_structured_output_format"] == {"kwargs": {"method": method}, "schema": convert_to_json_schema(Joke)}


def test_bad_arguments_are_refused(chat):
    with pytest.raises(ValueError, match="unknown method"):
        chat.with_structured_output(Joke, method="grammar")
    with pytest.raises(ValueError, match="unsupported arguments"):
        chat.with_structured_output(Joke, temperature=0)
    with pytest.raises(ValueError, match="needs a schema"):
        chat.with_structured_output(None)
    with pytest.raises(ValueError, match="unsupported response_format"):
        chat.invoke("w9", response_format={"type": "text"})
