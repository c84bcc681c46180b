"""A multi-turn chat through ``ChatCacheGen`` with default settings: what each turn reuses and recomputes.

    python -m benchmarks.chat_reuse [--quick] [--data F] [--turns 6] [--system-tokens 2400] [--out F]

The system message is a LongChat transcript cut to ``--system-tokens`` tokens (a long system
document, as in a chatbot over a file); each user turn asks one of a few questions about it and the
answer (``--new-tokens`` at most) joins the history. The engine is ``CacheGenLLM.from_model_id``'s
default (1536-token chunks, partial chunks every 64 tokens, background writer, disk store in a
temporary directory), with a store wrapper that counts requests and bytes.

One JSON line per turn: ``turn``, ``prompt_tokens``, ``cached_tokens``, ``recomputed_tokens``,
``new_tokens``, ``ttft_s``, and ``added_tokens`` (prompt tokens since the previous turn's prompt),
``store_requests`` (store calls during the turn: lookups, fetches, writes, deletes), ``store_bytes``
(bytes stored so far), ``partial_bytes`` (of those, partial chunks': the cost of reusing every token)
and ``branch`` (false). A last line with ``branch`` true asks the first turn again with another
question (an edited first message): it reuses the first turn's partial chunk, which later turns
extended, so only its level is left in the store (``ChunkWriter.supersede``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks.common import Rows, parser, setup_threads, transcripts

QUESTIONS = [
    "What was the first topic we discussed?",
    "Which topic came right after it?",
    "Summarise the second topic in one sentence.",
    "Was any topic about science?",
    "List three topics we covered.",
    "Which topic did you find the most interesting, and why?",
]


class CountingStore:
    """A ``KVStore`` that counts the calls made to the store it wraps and the bytes put in it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.requests, self.sizes = inner, 0, {}

    def get(self, key: str) -> bytes | None:
        self.requests += 1
        return self.inner.get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self.requests += 1
        return self.inner.get_many(keys)

    def put(self, key: str, value: bytes) -> None:
        self.requests += 1
        self.sizes[key] = len(value)
        self.inner.put(key, value)

    def put_many(self, items: Any) -> None:
        items = list(items.items() if hasattr(items, "items") else items)
        self.requests += 1
        self.sizes.update((k, len(v)) for k, v in items)
        self.inner.put_many(items)

    def contains(self, key: str) -> bool:
        self.requests += 1
        return self.inner.contains(key)

    def delete(self, key: str) -> None:
        self.requests += 1
        self.sizes.pop(key, None)
        self.inner.delete(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        self.requests += 1
        for k in keys:
            self.sizes.pop(k, None)
        self.inner.delete_many(keys)

    def keys(self, prefix: str = "") -> Iterator[str]:
        return self.inner.keys(prefix)

    def close(self) -> None:
        self.inner.close()


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="4 turns of at most 24 new tokens")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=2400)
    ap.add_argument("--new-tokens", type=int, default=48)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    if args.quick:
        args.turns, args.new_tokens = 4, 24
    setup_threads()

    # the default disk store, in a throwaway directory
    with Rows("chat_reuse", args.out, argv) as out, tempfile.TemporaryDirectory() as store_dir:
        run(args, store_dir, out)


def run(args: argparse.Namespace, store_dir: str, out: Rows) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage  # noqa: PLC0415

    from cachegen_core.stores import DiskCacheStore  # noqa: PLC0415
    from langchain_cachegen import CacheGenLLM, ChatCacheGen  # noqa: PLC0415

    store = CountingStore(DiskCacheStore(store_dir))
    llm = CacheGenLLM.from_model_id(args.model, store=store, generation_kwargs={"max_new_tokens": args.new_tokens})
    engine = llm.engine
    tok = engine.tokenizer
    text = next(t for t in transcripts(args.data) if len(tok(t)["input_ids"]) >= args.system_tokens)
    system = tok.decode(tok(text, add_special_tokens=False)["input_ids"][: args.system_tokens])
    chat = ChatCacheGen(llm=llm)
    history: list[Any] = [SystemMessage(system)]
    partial_keys: set[str] = set()
    last = 0
    for turn in range(1, args.turns + 2):
        branch = turn > args.turns
        if branch:  # the first question edited: the system message, then another question
            turn, history = 1, [history[0], HumanMessage("Which topic came last?")]
        else:
            history.append(HumanMessage(QUESTIONS[(turn - 1) % len(QUESTIONS)]))
        before = store.requests
        answer = chat.invoke(history)
        history.append(answer)
        engine.flush()
        meta = answer.response_metadata
        partial_keys |= partial_entries(engine, tok, history[:-1], meta["prompt_tokens"])
        out.emit({
            "turn": turn,
            "branch": branch,
            "prompt_tokens": meta["prompt_tokens"],
            "cached_tokens": meta["cached_tokens"],
            "recomputed_tokens": meta["recomputed_tokens"],
            "new_tokens": meta["new_tokens"],
            "ttft_s": round(meta["ttft_s"], 4),
            "added_tokens": None if branch else meta["prompt_tokens"] - last,
            "store_requests": store.requests - before,
            "store_bytes": sum(store.sizes.values()),
            "partial_bytes": sum(n for k, n in store.sizes.items() if k.split("-")[0] in partial_keys),
        })  # fmt: skip
        last = meta["prompt_tokens"]
    print(f"# {len(store.sizes)} entries stored", file=sys.stderr)


def partial_entries(engine: Any, tok: Any, messages: list[Any], n_tokens: int) -> set[str]:
    """Keys of every partial chunk a prompt of these messages could have stored."""
    from langchain_cachegen.chat_template import render_prompt  # noqa: PLC0415

    ids = list(render_prompt(tok, messages))
    assert len(ids) == n_tokens, (len(ids), n_tokens)
    start = len(ids) - len(ids) % engine.chunk_tokens
    return {c.key for c in engine._partials(ids)(start)}


if __name__ == "__main__":
    main()
