"""The examples run as shipped: default data from ``examples/data/``, ``--data``, every store option they parse.

A tiny random model saved as a transformers directory stands in for the reference
model, so this checks the examples' plumbing in seconds; ``make demo`` runs the RAG
example on the reference model.
"""

from __future__ import annotations

import json

import pytest

from examples import chat_history, langgraph_chat, rag_chain, rag_documents


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))


def test_demo_data_is_shipped_small_and_documented():
    records = [json.loads(line) for line in rag_chain.DATA.read_text().splitlines()]
    assert [r["test_id"] for r in records] == [21, 22, 23, 24]
    assert all(r["prompt"] and len(r["label"]) == 15 for r in records)
    assert rag_chain.DATA.stat().st_size < 300_000
    notes = (rag_chain.DATA.parent / "README.md").read_text()
    assert "Apache" in notes and (rag_chain.DATA.parent / "LICENSE-Apache-2.0.txt").is_file()
    assert chat_history.DATA == rag_chain.DATA == langgraph_chat.DATA


def test_rag_chain_reuses_the_documents_on_the_warm_run(tiny_model_dir, capsys):
    rag_chain.main(["--model", tiny_model_dir, "--store", "memory", "--doc-tokens", "200", "--chunk-tokens", "64",
                    "--max-new-tokens", "2"])  # fmt: skip
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["run"] for r in rows] == ["cold", "warm"]
    assert rows[0]["cached_tokens"] == 0 and rows[1]["cached_tokens"] >= 192


def test_rag_chain_says_when_its_first_run_was_not_cold(tiny_model_dir, tmp_path, capsys):
    """A persistent store still holds the chunks of an earlier run: the demo must not call that run cold silently."""
    argv = ["--model", tiny_model_dir, "--store", str(tmp_path / "store"), "--doc-tokens", "200", "--chunk-tokens", "64",
            "--max-new-tokens", "2"]  # fmt: skip
    rag_chain.main(argv)
    assert "was not cold" not in capsys.readouterr().out
    rag_chain.main(argv)
    assert "note: the first run was not cold" in capsys.readouterr().out


def test_a_typo_in_an_example_s_store_is_an_error_not_a_new_store(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="did you mean 'disk'"):
        rag_chain.make_store("dsik")
    for example in (chat_history, langgraph_chat):  # refused before the model loads
        with pytest.raises(SystemExit):
            example.main(["--store", "dsik"])
        assert "invalid choice: 'dsik'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("index", [True, False])
def test_rag_documents_reuses_passages_retrieved_in_other_orders(tiny_model_dir, tmp_path, monkeypatch, index):
    from cachegen_core.testing import words

    # text off: the rows count passages reused from the store, and on the tiny model a stored piece and its prefill tie
    # (with the link measured slow, as after a fetch timed in a stall, pieces went as text and were not counted)
    load = rag_documents.ChatCacheGen.from_model_id
    monkeypatch.setattr(rag_documents.ChatCacheGen, "from_model_id", lambda *a, **kw: load(*a, engine_kwargs={"allow_text": False}, **kw))
    data = tmp_path / "words.jsonl"  # the tiny tokenizer knows words w0..w127 only: passages of those
    data.write_text("".join(json.dumps({"test_id": i, "prompt": words(90 + i, 360), "label": ["x"]}) + "\n" for i in range(2)))
    passages = words(90, 360).split()  # questions naming words of passages 0-1, 1-2, 0-2 and 1 of record 0
    monkeypatch.setattr(rag_documents, "QUESTIONS", [" ".join(passages[a : a + 8] + passages[b : b + 8])
                                                     for a, b in ((0, 120), (120, 240), (0, 240), (130, 140))])  # fmt: skip
    rows = rag_documents.main(["--model", tiny_model_dir, "--data", str(data), "--doc-tokens", "120", "--k", "3",
                               "--max-new-tokens", "2", *([] if index else ["--no-index"])])  # fmt: skip
    assert len(rows) == len(rag_documents.QUESTIONS)
    seen: set[str] = set()
    firsts: set[str] = set()
    for row in rows:  # indexed: every passage from the store; else every one retrieved before, wherever it lands now
        if index:
            assert row["documents_reused"] == len(row["passages"])
        else:  # a passage first in this prompt and an earlier one is reused exactly, inside the prefix (a stored tail's
            # first tokens through a pointer), not from its document cache; every other one seen comes from its cache
            in_prefix = row["passages"][0] in firsts and row["cached_tokens"] >= 64
            assert row["documents_reused"] == len(seen & set(row["passages"])) - in_prefix
        seen |= set(row["passages"])
        firsts.add(row["passages"][0])
    assert rows[0]["documents_reused"] == (3 if index else 0)


def test_the_bm25_retriever_ranks_the_passage_holding_the_query_words_first():
    from langchain_core.documents import Document

    texts = ["the cat sat on the mat", "art and society in the renaissance", "science and technology of rockets"]
    retriever = rag_documents.BM25Retriever.from_documents([Document(page_content=t, metadata={"id": i}) for i, t in enumerate(texts)], k=2)
    assert [d.metadata["id"] for d in retriever.invoke("what about rockets and technology?")][0] == 2
    assert [d.metadata["id"] for d in retriever.invoke("art in society")][0] == 1
    assert len(retriever.invoke("nothing matches this")) == 2  # k documents, whatever their score


def test_chat_history_reads_another_file_with_data(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"test_id": 0, "prompt": "w7 w8", "label": ["w9 w10", "w11"]}) + "\n")
    chat_history.main(["--model", tiny_model_dir, "--data", str(data), "--turns", "3", "--chunk-tokens", "8",
                       "--max-tokens", "4"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[0].split()[:3] == ["turn", "prompt", "cached"]
    assert int(out[-1].split()[2]) > 0  # the third turn finds the history in the store


def test_langgraph_chat_reuses_the_checkpointed_history(tiny_model_dir, capsys):
    langgraph_chat.main(["--model", tiny_model_dir, "--turns", "4", "--doc-tokens", "100", "--chunk-tokens", "32",
                         "--max-tokens", "4"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["turn", "history", "prompt", "cached"]
    rows = [[int(v) for v in line.split()[:4]] for line in out[1:]]
    assert [r[1] for r in rows] == [2, 4, 6, 8]  # the checkpointer kept each turn's question and answer
    assert rows[0][3] == 0 and all(r[3] >= 96 for r in rows[1:])  # later turns: the document's chunks and more
    assert rows[-1][3] > rows[1][3]  # ... and the earlier turns'
