"""A standard RAG chain whose retrieved documents are reused in any order: BM25 over the demo transcripts.

    python -m examples.rag_documents [--model smollm2-135m] [--data F] [--doc-tokens 1024] [--k 3] [--store memory|disk|...]
                                     [--no-index] [--blend fast|balanced|exact]

The transcripts are cut into ~1K-token passages and indexed with BM25 (:class:`BM25Retriever`, a
LangChain retriever over ``bm25s``, extra ``rag``: ``pip install 'langchain-cachegen[rag]'``); runs offline. The chain is the usual one, with
``format_documents`` as its ``format_docs`` step::

    {"context": retriever | format_documents, "question": RunnablePassthrough()} | prompt | llm

``format_documents`` marks where each passage starts and ends. When the passages are indexed for
the retriever, ``llm.cache_documents(passages)`` computes each one's KV on its own and stores it under
its content (``--no-index``: the first question retrieving a passage pays its prefill instead); the
chat model then reuses it wherever a question's retriever puts it (any question, order or
neighbours), recomputing a small share of tokens so that passages attend to each other (CacheBlend,
``--blend``). Prints per question the passages retrieved, how many came from the store, cached
tokens and time to first token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough

from examples.rag_chain import make_store
from langchain_cachegen import ChatCacheGen, format_documents

DATA = Path(__file__).resolve().parent / "data" / "longchat_demo.jsonl"
SYSTEM = "Answer the question using these conversation records.\n\n{context}"
QUESTIONS = [
    "What did they say about the role of art in society?",
    "What was discussed about science and technology?",
    "What did the user ask about art and society, and about technology?",
    "Which records talk about society?",
]


def passages(tokenizer, doc_tokens: int, path: Path = DATA) -> list[Document]:
    """Every transcript of ``path`` cut into passages of ``doc_tokens`` tokens."""
    docs = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            ids = tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"]
            for i, at in enumerate(range(0, len(ids), doc_tokens)):
                text = tokenizer.decode(ids[at : at + doc_tokens])
                docs.append(Document(page_content=text, metadata={"id": f"{rec['test_id']}-{i}"}))
    return docs


class BM25Retriever(BaseRetriever):
    """The ``k`` documents that score highest for a query under BM25 (``bm25s``, in memory, offline)."""

    docs: list[Document]
    index: Any
    k: int = 3

    @classmethod
    def from_documents(cls, docs: list[Document], k: int = 3) -> BM25Retriever:
        import bm25s  # the rag extra

        index = bm25s.BM25()
        index.index(bm25s.tokenize([d.page_content for d in docs], show_progress=False), show_progress=False)
        return cls(docs=list(docs), index=index, k=k)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        import bm25s

        found, _ = self.index.retrieve(bm25s.tokenize([query], show_progress=False), k=min(self.k, len(self.docs)), show_progress=False)
        return [self.docs[i] for i in found[0]]


class Info(BaseCallbackHandler):
    """Keeps the generation info (cached tokens, documents reused, TTFT) of the last LLM call."""

    def __init__(self) -> None:
        self.info: dict = {}

    def on_llm_end(self, response, **kwargs) -> None:
        self.info = response.generations[0][0].message.response_metadata


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", type=Path, default=DATA, help="LongChat-style JSON-lines transcripts (default: the shipped demo excerpt)")
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3, help="passages per question")
    ap.add_argument("--store", default="memory", help="memory (default), disk (user cache), a directory (./kv), or redis://host:port")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    ap.add_argument("--no-index", action="store_true", help="do not cache the passages when indexing them")
    ap.add_argument("--blend", default="fast", choices=["fast", "balanced", "exact"], help="the blend's preset (default fast)")
    args = ap.parse_args(argv)

    llm = ChatCacheGen.from_model_id(args.model, store=make_store(args.store), chunk_tokens=args.chunk_tokens, max_tokens=args.max_new_tokens,
                                     blend=args.blend)  # fmt: skip
    docs = passages(llm.engine.tokenizer, args.doc_tokens, args.data)
    retriever = BM25Retriever.from_documents(docs, k=args.k)
    if not args.no_index:  # beside the retriever's index: every passage's document cache, computed once
        t = time.perf_counter()
        done = llm.cache_documents(docs)
        print(f"cached {len(done.stored)} passages ({done.tokens} tokens) in {time.perf_counter() - t:.1f} s; "
              f"{len(done.already_cached)} were in the store already", file=sys.stderr)  # fmt: skip
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    chain = {"context": retriever | format_documents, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()

    rows = []
    for question in QUESTIONS:
        cb = Info()
        ids = [d.metadata["id"] for d in retriever.invoke(question)]
        t = time.perf_counter()
        answer = chain.invoke(question, config={"callbacks": [cb]})
        llm.engine.flush()  # new passages are stored in the background; wait, so the next question finds them
        i = cb.info
        row = {"question": question, "passages": ids, "documents_reused": i.get("documents_reused"), "prompt_tokens": i.get("prompt_tokens"),
               "cached_tokens": i.get("cached_tokens"), "ttft_s": round(i.get("ttft_s", 0), 3),
               "total_s": round(time.perf_counter() - t, 3), "answer": answer.strip()[:100]}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"{sum(r['documents_reused'] or 0 for r in rows)} of {sum(len(r['passages']) for r in rows)} retrieved passages came "
          "from the store", file=sys.stderr)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
