"""A LangGraph chatbot on ChatCacheGen: the checkpointed conversation is reused from the KV store every turn.

    python -m examples.langgraph_chat [--model smollm2-135m] [--data F] [--turns 5] [--doc-tokens 1024] [--chunk-tokens 128]

The graph is one node over ``MessagesState``; an ``InMemorySaver`` checkpointer keeps
each thread's messages, so a turn sends only the new user message (LangChain 1.x's
replacement for ``RunnableWithMessageHistory``). The node prompts the model with a long
system document (a transcript of the demo excerpt shipped in ``examples/data/``, or of
``--data``) followed by the thread's messages: each turn's prompt extends the previous
one's, so the document and the earlier turns come back from the store instead of being
prefilled again. Prints, per turn, the prompt length, the cached tokens and the time to
first token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph

from langchain_cachegen import ChatCacheGen

DATA = Path(__file__).resolve().parent / "data" / "longchat_demo.jsonl"
SYSTEM = "You are a helpful assistant. Answer in one or two sentences, using this conversation record:\n\n{document}"


def build_graph(chat: ChatCacheGen, system: str, checkpointer: BaseCheckpointSaver | None = None) -> Any:
    """A one-node chatbot graph: ``system`` then the thread's messages, answered by ``chat``."""

    def chatbot(state: MessagesState) -> dict[str, Any]:
        return {"messages": [chat.invoke([SystemMessage(system), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("chatbot", chatbot)
    graph.add_edge(START, "chatbot")
    graph.add_edge("chatbot", END)
    return graph.compile(checkpointer=checkpointer or InMemorySaver())


def load_record(tokenizer: Any, doc_tokens: int, path: Path = DATA) -> tuple[str, list[str]]:
    """The first transcript of ``path`` cut to ``doc_tokens`` tokens, and its topics."""
    with open(path) as f:
        rec = json.loads(f.readline())
    ids = tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"][:doc_tokens]
    return tokenizer.decode(ids), rec["label"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", type=Path, default=DATA, help="LongChat-style JSON-lines transcripts (default: the shipped demo excerpt)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--doc-tokens", type=int, default=1024, help="tokens of the transcript in the system message")
    ap.add_argument("--chunk-tokens", type=int, default=128, help="small chunks so that each turn soon fills one")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--store", default="memory", choices=("memory", "disk"), help="memory (default here) or disk")
    args = ap.parse_args(argv)

    from cachegen_core.stores import DiskCacheStore, MemoryStore

    store = MemoryStore() if args.store == "memory" else DiskCacheStore()
    chat = ChatCacheGen.from_model_id(args.model, store=store, chunk_tokens=args.chunk_tokens, max_tokens=args.max_tokens)
    document, topics = load_record(chat.engine.tokenizer, args.doc_tokens, args.data)
    graph = build_graph(chat, SYSTEM.format(document=document))
    config = {"configurable": {"thread_id": "demo"}}  # the checkpointer keeps this thread's history

    print(f"{'turn':>4} {'history':>7} {'prompt':>7} {'cached':>7} {'TTFT s':>7}  reply")
    for turn in range(1, args.turns + 1):
        question = f"What did we say about {topics[(turn - 1) % len(topics)].lower()}?"
        state = graph.invoke({"messages": [HumanMessage(question)]}, config)
        chat.engine.flush()  # this turn's new chunks are stored before the next turn reads them
        reply = state["messages"][-1]
        m = reply.response_metadata
        print(f"{turn:>4} {len(state['messages']):>7} {m['prompt_tokens']:>7} {m['cached_tokens']:>7} {m['ttft_s']:>7.2f}  "
              f"{reply.content.strip()[:60]!r}")  # fmt: skip


if __name__ == "__main__":
    main()
