"""A RAG chain over LongChat transcripts, run twice: cold (prefill + store) and warm (KV reused).

    python -m examples.rag_chain [--model smollm2-135m] [--data F] [--doc-tokens 3072] [--store disk|memory|redis://...]

The retriever returns the transcript that best matches the question; the chat prompt
puts the documents first (system message) and the question last, so every complete
chunk of the documents is found in the store on the second run. Prints cached tokens
and time to first token for both runs. The transcripts are the demo excerpt shipped in
``examples/data/`` (see its README) unless ``--data`` names another LongChat-style file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough

from langchain_cachegen import ChatCacheGen

DATA = Path(__file__).resolve().parent / "data" / "longchat_demo.jsonl"
SYSTEM = "Answer the question using these documents.\n\n{context}"


class KeywordRetriever(BaseRetriever):
    """The ``k`` documents sharing the most words with the query (no embedding model needed)."""

    documents: list[Document]
    k: int = 1

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        q = set(re.findall(r"[a-z]+", query.lower()))
        scored = sorted(self.documents, key=lambda d: -len(q & set(re.findall(r"[a-z]+", d.page_content.lower()))))
        return scored[: self.k]


def load_documents(tokenizer, n_docs: int, doc_tokens: int, path: Path = DATA) -> list[Document]:
    """The first ``n_docs`` transcripts of ``path``, each cut to ``doc_tokens`` tokens."""
    docs = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            ids = tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"][:doc_tokens]
            docs.append(Document(page_content=tokenizer.decode(ids), metadata={"id": rec["test_id"], "topic": rec["label"][0]}))
            if len(docs) == n_docs:
                break
    return docs


def make_store(spec: str):
    """The store ``spec`` names, as ``CACHEGEN_STORE`` takes it: a typo (``dsik``) is an error, not a new store."""
    from cachegen_core.stores import open_store  # redis:// needs the redis extra

    return open_store(spec)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", type=Path, default=DATA, help="LongChat-style JSON-lines transcripts (default: the shipped demo excerpt)")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=3072)
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    ap.add_argument("--store", default="disk", help="disk (default, user cache), memory, a directory (./kv), or redis://host:port")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    llm = ChatCacheGen.from_model_id(args.model, store=make_store(args.store), chunk_tokens=args.chunk_tokens, max_tokens=args.max_new_tokens)
    profile = llm.engine.codec.profile
    print(
        f"model {args.model} ready in {time.perf_counter() - t0:.1f} s; codec {llm.engine.codec.codec_id}, "
        f"profile {f'{profile.id} ({profile.origin})' if profile else 'none'}, coder {getattr(llm.engine.codec.coder, 'name', 'none (raw KV only)')}",
        file=sys.stderr,
    )
    docs = load_documents(llm.engine.tokenizer, args.docs, args.doc_tokens, args.data)
    retriever = KeywordRetriever(documents=docs)
    question = "What did the user and the assistant discuss about " + docs[0].metadata["topic"].lower() + "?"

    def fmt(ds: list[Document]) -> str:
        return "\n\n".join(d.page_content for d in ds)

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    chain = {"context": retriever | fmt, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()

    class Info(BaseCallbackHandler):
        """Keeps the generation info (cached tokens, TTFT) of the last LLM call."""

        def __init__(self) -> None:
            self.info = {}

        def on_llm_end(self, response, **kwargs) -> None:
            self.info = response.generations[0][0].message.response_metadata

    rows = []
    for run in ("cold", "warm"):
        cb = Info()
        t = time.perf_counter()
        answer = chain.invoke(question, config={"callbacks": [cb]})
        total = time.perf_counter() - t
        llm.engine.flush()  # the cold run's chunks are stored in the background; wait before the warm run
        i = cb.info
        rows.append((run, i.get("prompt_tokens"), i.get("cached_tokens"), i.get("ttft_s"), total, answer.strip()))
        print(
            json.dumps(
                {
                    "run": run,
                    "prompt_tokens": i.get("prompt_tokens"),
                    "cached_tokens": i.get("cached_tokens"),
                    "ttft_s": round(i.get("ttft_s", 0), 3),
                    "total_s": round(total, 3),
                    "bytes_fetched": i.get("bytes_fetched"),
                    "answer": answer.strip()[:120],
                }
            ),
            flush=True,
        )
    cold, warm = rows
    print(
        f"\n{'run':6} {'prompt':>7} {'cached':>7} {'TTFT s':>8}\n"
        f"{'cold':6} {cold[1]:>7} {cold[2]:>7} {cold[3]:>8.2f}\n"
        f"{'warm':6} {warm[1]:>7} {warm[2]:>7} {warm[3]:>8.2f}\n"
        f"warm TTFT is {cold[3] / warm[3]:.1f}x faster than cold"
        if warm[3]
        else ""
    )
    if cold[2]:  # the disk store persists in the user cache: an earlier run already stored these chunks
        print(
            f"note: the first run was not cold: {cold[2]} tokens were already in the store from an earlier run "
            f"(the default disk store lives in the user cache); `--store memory` starts from an empty store"
        )


if __name__ == "__main__":
    main()
