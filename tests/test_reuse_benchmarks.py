"""benchmarks.rag_reuse and benchmarks.chat_reuse run end to end (a tiny random model stands in) and report what they say."""

from __future__ import annotations

import json

import pytest

from benchmarks import chat_reuse, common, rag_reuse
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
                    "--prompts", "2", "--continuation", "24", "--ratios", "1", "--out", str(out)])  # fmt: skip
    rows = {r["method"]: r for r in _rows(out)}
    assert list(rows) == ["full-prefill", "prefix-cache", "concat", "blend-1"] and all(RAG_KEYS <= set(r) for r in rows.values())
    assert rows["full-prefill"]["top1_agreement"] == 1 and rows["full-prefill"]["cached_tokens"] == 0
    assert rows["prefix-cache"]["cached_tokens"] == 0  # the same documents, another order: no prefix hit
    assert rows["concat"]["cached_tokens"] == 300 and rows["blend-1"]["cached_tokens"] == 0  # ratio 1 recomputes them all
    assert rows["blend-1"]["top1_agreement"] == 1 and abs(rows["blend-1"]["ppl_rel_delta"]) < 1e-2  # 16-bit raw form


def test_chat_reuse_rows(tiny_model_dir, data, tmp_path):
    out = tmp_path / "chat.jsonl"
    chat_reuse.main(["--model", tiny_model_dir, "--data", data, "--quick", "--system-tokens", "1600", "--out", str(out)])
    rows, branch = _rows(out)[:-1], _rows(out)[-1]
    assert [r["turn"] for r in rows] == [1, 2, 3, 4] and all(CHAT_KEYS <= set(r) and not r["branch"] for r in rows)
    assert branch["branch"] and branch["turn"] == 1 and branch["prompt_tokens"] != rows[0]["prompt_tokens"]
    assert rows[0]["cached_tokens"] == 0 and rows[0]["partial_bytes"] > 0
    for r in rows[1:]:
        assert r["recomputed_tokens"] <= r["added_tokens"] + 64 and r["store_requests"] >= 2


def test_blend_ablation_rows(tiny_model_dir, data, tmp_path):
    """The ablation runs end to end: concatenation recomputes nothing, a ratio of 1 is full prefill."""
    from benchmarks import blend_ablation

    out = tmp_path / "ablation.jsonl"
    blend_ablation.main(["--model", tiny_model_dir, "--data", data, "--docs", "3", "--doc-tokens", "100", "--pool", "6",
                         "--prompts", "2", "--continuation", "24", "--variants", "concat", "all:ratio=1", "--out", str(out)])  # fmt: skip
    summary = {r["variant"]: r for r in _rows(out) if r["row"] == "summary"}
    per_prompt = [r for r in _rows(out) if r["row"] == "prompt"]
    assert set(summary) == {"concat", "all"} and len(per_prompt) == 4
    assert all(r["recompute_share"] == 0 for r in per_prompt if r["variant"] == "concat")
    assert summary["all"]["top1_agreement"] == 1 and abs(summary["all"]["ppl_rel_delta"]) < 1e-2
