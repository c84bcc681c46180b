"""A 10-turn conversation whose growing history is reused from the store every turn.

    python -m examples.chat_history [--model smollm2-135m] [--data F] [--turns 10] [--chunk-tokens 256]

Each turn's prompt (rendered with the model's chat template) extends the previous
turn's tokens, so the complete chunks of the history come back from the store instead
of being prefilled again. Prints, per turn, the prompt length, the cached tokens and
the time to first token. The user messages open the topics of the first transcript of
the demo excerpt shipped in ``examples/data/`` (or of ``--data``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from langchain_cachegen import ChatCacheGen

DATA = Path(__file__).resolve().parent / "data" / "longchat_demo.jsonl"


def user_turns(n: int, path: Path = DATA) -> list[str]:
    """Real user messages: the topic openers of the first LongChat transcript of ``path``."""
    with open(path) as f:
        rec = json.loads(f.readline())
    topics = rec["label"]
    return [f"I would like to discuss the topic of {topics[i % len(topics)].lower()}. What matters most about it?" for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", type=Path, default=DATA, help="LongChat-style JSON-lines transcripts (default: the shipped demo excerpt)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--chunk-tokens", type=int, default=256, help="small chunks so a short chat history spans several")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--store", default="memory", choices=("memory", "disk"), help="memory (default here) or disk")
    args = ap.parse_args(argv)

    from cachegen_core.stores import DiskCacheStore, MemoryStore

    store = MemoryStore() if args.store == "memory" else DiskCacheStore()
    chat = ChatCacheGen.from_model_id(args.model, store=store, chunk_tokens=args.chunk_tokens, max_tokens=args.max_tokens)
    history = [SystemMessage("You are a helpful assistant. Answer in two or three sentences.")]
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT s':>7}  reply")
    for turn, text in enumerate(user_turns(args.turns, args.data), 1):
        history.append(HumanMessage(text))
        reply = chat.invoke(history)
        chat.engine.flush()  # this turn's new chunks are stored before the next turn reads them
        m = reply.response_metadata
        print(f"{turn:>4} {m['prompt_tokens']:>7} {m['cached_tokens']:>7} {m['ttft_s']:>7.2f}  {reply.content.strip()[:60]!r}")
        history.append(AIMessage(reply.content))


if __name__ == "__main__":
    main()
