"""benchmarks.after_cold runs end to end on a tiny shaped model (as the GPU run's 7B-shaped one): a request two seconds
after a cold answer finds its chunks."""

from __future__ import annotations

import json

import pytest

from benchmarks import common, after_cold
from cachegen_core.testing import words

SHAPE = "llama-shaped:layers=2,hidden=64,heads=4,kv_heads=2,intermediate=128"


@pytest.fixture(autouse=True)
def tiny_tokenizer_for_shaped_models(tiny_model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "DEFAULT_MODEL", tiny_model_dir)
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))


def test_after_cold_rows(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": words(300 + i, 400), "label": ["x"]}) + "\n" for i in range(20)))
    out = tmp_path / "fresh.jsonl"
    after_cold.main(["--model", SHAPE, "--data", str(data), "--contexts", "600", "--chunk-tokens", "256",
                       "--after-s", "2", "--out", str(out)])  # fmt: skip
    rows = {r["policy"]: r for r in map(json.loads, out.read_text().splitlines()) if "policy" in r}
    after = rows["after-cold"]
    assert after["cached_tokens"] >= 512 and len(after["options"]) >= 2  # both complete chunks found, 2 s after the answer
    assert after["chunks_queued"] >= 2 and after["random_init"]
