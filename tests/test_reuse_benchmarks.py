"""benchmarks.rag_reuse, benchmarks.chat_reuse and benchmarks.plain_reuse run end to end (a tiny random model stands in) and report what they say."""

from __future__ import annotations

import json

import pytest

from benchmarks import chat_reuse, common, plain_reuse, rag_reuse
from cachegen_core.testing import words

RAG_KEYS = {"method", "recompute_ratio", "docs", "context_tokens", "ttft_s", "ppl_rel_delta", "top1_agreement", "cached_tokens"}
CHAT_KEYS = {"turn", "prompt_tokens", "cached_tokens", "recomputed_tokens", "new_tokens", "ttft_s"}


@pytest.fixture
def data(tmp_path) -> str:
    path = tmp_path / "words.jsonl"  # transcripts of the words the tiny tokenizer knows
    path.write_text("".join(json.dumps({"test_id": i, "prompt": words(120 + i, 2600), "label": ["x"]}) + "\n" for i in range(2)))
    return str(path)


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))


def _rows(path) -> list[dict]:
    return common.results(path)  # the rows, without the meta row --out starts with


def test_rag_reuse_rows(tiny_model_dir, data, tmp_path):
    out = tmp_path / "rag.jsonl"
    rag_reuse.main(["--model", tiny_model_dir, "--data", data, "--docs", "3", "--doc-tokens", "100", "--pool", "6",
                    "--prompts", "2", "--continuation", "24", "--ratios", "1", "--epic", "--out", str(out)])  # fmt: skip
    rows = {r["method"]: r for r in _rows(out)}
    assert list(rows) == ["full-prefill", "prefix-cache", "concat", "blend-1", "epic-1"] and all(RAG_KEYS <= set(r) for r in rows.values())
    assert rows["full-prefill"]["top1_agreement"] == 1 and rows["full-prefill"]["cached_tokens"] == 0
    assert rows["prefix-cache"]["cached_tokens"] == 0  # the same documents, another order: no prefix hit
    assert rows["concat"]["cached_tokens"] == 300 and rows["blend-1"]["cached_tokens"] == 0  # ratio 1 recomputes them all
    assert rows["blend-1"]["top1_agreement"] == 1 and abs(rows["blend-1"]["ppl_rel_delta"]) < 1e-2  # 16-bit raw form
    assert rows["epic-1"]["cached_tokens"] == 0 and rows["epic-1"]["top1_agreement"] == 1  # EPIC's pick at 1: every token too


def test_chat_reuse_rows(tiny_model_dir, data, tmp_path):
    out = tmp_path / "chat.jsonl"
    chat_reuse.main(["--model", tiny_model_dir, "--data", data, "--quick", "--system-tokens", "1600", "--out", str(out)])
    rows, branch = _rows(out)[:-1], _rows(out)[-1]
    assert [r["turn"] for r in rows] == [1, 2, 3, 4] and all(CHAT_KEYS <= set(r) and not r["branch"] for r in rows)
    assert branch["branch"] and branch["turn"] == 1 and branch["prompt_tokens"] != rows[0]["prompt_tokens"]
    assert rows[0]["cached_tokens"] == 0 and rows[0]["partial_bytes"] > 0
    for r in rows[1:]:
        assert r["recomputed_tokens"] <= r["added_tokens"] + 64 and r["store_requests"] >= 2


def test_plain_reuse_rows(tiny_model_dir, data, tmp_path, monkeypatch):
    """A plain prompt's next question reuses its context to the last 64-token step it agrees with the first to, or to
    where the first one's partial chunk ends: at 1143, inside its last 64 tokens."""
    monkeypatch.setattr(plain_reuse, "QUESTIONS", ["w5 w6 w7 w8 w9 w10 w11 w12 w13 w14", "w15 w16"])  # words the tokenizer knows
    out = tmp_path / "plain.jsonl"
    plain_reuse.main(["--model", tiny_model_dir, "--data", data, "--contexts", "1100", "1143", "--store", "memory", "--transcript", "0",
                     "--out", str(out)])  # fmt: skip
    rows = _rows(out)
    assert [(r["context_tokens"], r["question"]) for r in rows] == [(1100, 0), (1100, 1), (1143, 0), (1143, 1)]
    for first, second in zip(rows[::2], rows[1::2]):  # each context on an empty store
        assert first["cached_tokens"] == 0 and first["pointer_bytes"] > 0 and first["tail_level_bytes"] > 0
        assert second["cached_tokens"] == min(second["agree_tokens"] // 64 * 64, first["tail_tokens"]) > 0
        assert second["store_pointer_bytes"] >= first["pointer_bytes"] and second["store_bytes"] > first["tail_level_bytes"]
    assert rows[3]["cached_tokens"] < rows[2]["tail_tokens"]  # found through a pointer


def test_blend_ablation_rows(tiny_model_dir, data, tmp_path):
    """The ablation runs end to end: concatenation recomputes nothing, a ratio of 1 is full prefill."""
    from benchmarks import blend_ablation

    out = tmp_path / "ablation.jsonl"
    blend_ablation.main(["--model", tiny_model_dir, "--data", data, "--docs", "3", "--doc-tokens", "100", "--pool", "6",
                         "--prompts", "2", "--continuation", "24", "--variants", "concat", "all:ratio=1",
                         "epic:engine=1,select=document_starts,ratio=0.5", "--out", str(out)])  # fmt: skip
    summary = {r["variant"]: r for r in _rows(out) if r["row"] == "summary"}
    per_prompt = [r for r in _rows(out) if r["row"] == "prompt"]
    assert set(summary) == {"concat", "all", "epic"} and len(per_prompt) == 6
    assert summary["epic"]["recompute_share"] == 0.5 and summary["epic"]["spec"]["select"] == "document_starts"
    assert all(r["recompute_share"] == 0 for r in per_prompt if r["variant"] == "concat")
    assert summary["all"]["top1_agreement"] == 1 and abs(summary["all"]["ppl_rel_delta"]) < 1e-2
