"""LangGraph on ChatCacheGen: a checkpointed chatbot and a tool-calling agent whose later turns reuse the earlier ones."""

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from examples.langgraph_chat import build_graph
from langchain_cachegen import CacheGenLLM, ChatCacheGen
from tests.langchain_scripted import script_answers

CHUNK = 32


@pytest.fixture
def chat(tiny_llama, tiny_tokenizer):
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, background=False)
    return ChatCacheGen(llm=CacheGenLLM(engine=engine, model_id="tiny"), max_tokens=4)


def test_checkpointed_chatbot_reuses_the_earlier_turns(chat):
    graph = build_graph(chat, words(90, 70))
    config = {"configurable": {"thread_id": "t1"}}
    cached = []
    for turn in range(4):
        state = graph.invoke({"messages": [HumanMessage(words(91 + turn, 12))]}, config)
        cached.append(state["messages"][-1].response_metadata["cached_tokens"])
    assert len(state["messages"]) == 8  # the checkpointer kept the thread
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]) and cached[-1] > cached[1]
    other = graph.invoke({"messages": [HumanMessage(words(99, 5))]}, {"configurable": {"thread_id": "t2"}})
    assert len(other["messages"]) == 2  # a thread of its own, on the same system document's chunks
    assert other["messages"][-1].response_metadata["cached_tokens"] >= 64


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return "w40 w41 w42"


def test_tool_agent_runs_the_tool_and_reuses_the_tool_history(chat, monkeypatch):
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "w9"}}\n</tool_call>'
    calls = script_answers(chat.engine, monkeypatch, call, "w50 w51", "w52 w53", run_engine=True)
    model = chat.bind_tools([lookup])
    system = SystemMessage(words(95, 40))

    def agent(state: MessagesState) -> dict:
        return {"messages": [model.invoke([system, *state["messages"]])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([lookup]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    graph = builder.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "agent"}}

    first = graph.invoke({"messages": [HumanMessage(words(96, 10))]}, config)["messages"]
    assert [type(m) for m in first] == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    assert first[1].tool_calls[0]["args"] == {"key": "w9"} and first[2].content == "w40 w41 w42"
    assert first[2].tool_call_id == first[1].tool_calls[0]["id"] and first[3].content == "w50 w51"

    second = graph.invoke({"messages": [HumanMessage(words(97, 10))]}, config)["messages"]
    assert len(second) == 6 and second[-1].content == "w52 w53"
    after_tool, later = calls[1]["prompt"], calls[2]["prompt"]
    assert later[: len(after_tool)] == after_tool  # the tool call and its result rendered the same way both times
    assert second[-1].response_metadata["cached_tokens"] >= len(after_tool) // CHUNK * CHUNK >= 2 * CHUNK
