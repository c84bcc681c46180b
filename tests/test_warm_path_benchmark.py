"""benchmarks.warm_path runs end to end on a shaped random-init model (as the GPU run's 7B-shaped one) and says so."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import common, warm_path
from cachegen_core.testing import words

SHAPE = "llama-shaped:layers=2,hidden=64,heads=4,kv_heads=2,intermediate=128"


@pytest.fixture(autouse=True)
def tiny_tokenizer_for_shaped_models(tiny_model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "DEFAULT_MODEL", tiny_model_dir)  # the tokenizer a shaped model takes
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))


def test_a_shaped_model_has_the_shape_asked_random_weights_and_the_reference_tokenizer():
    model, tok = common.load(SHAPE)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (2, 64, 4, 2, 128)
    assert model.dtype == torch.bfloat16 and c.vocab_size == len(tok)
    again, _ = common.load(SHAPE, dtype=torch.float32)
    assert again.dtype == torch.float32 and torch.allclose(again.model.embed_tokens.weight.bfloat16(), model.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="unknown shape key 'width'"):
        common.load("llama-shaped:width=3")


def test_warm_path_rows_of_a_shaped_model_are_labelled_timing_only(tmp_path):
    data = tmp_path / "t.jsonl"  # warm_path reads transcripts 12 on (held out)
    data.write_text("".join(json.dumps({"prompt": words(200 + i, 700), "label": ["x"]}) + "\n" for i in range(14)))
    out = tmp_path / "warm.jsonl"
    warm_path.main(["--model", SHAPE, "--data", str(data), "--contexts", "512", "--chunk-tokens", "256", "--stores", "memory",
                    "--transcripts", "1", "--reps", "1", "--runs", "1", "--miss-contexts", "0", "--out", str(out)])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    policies = {r["policy"]: r for r in rows if "policy" in r}
    assert {"text", "fp16", "uniform8", "cachegen-auto"} <= set(policies)
    assert all(r["random_init"] and r["model"] == SHAPE and r["dtype"] == "bfloat16" for r in policies.values())
    assert policies["fp16"]["bytes"] == 2 * 2 * 2 * 2 * 16 * 512  # layers x (K, V) x KV heads x 2 bytes x head_dim x tokens
    assert [r["summary"] for r in rows if "summary" in r] == ["auto_vs_fp16"] + ["vs_fp16_over_runs"] * (len(policies) - 1)


def test_warm_path_times_only_the_policies_asked(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": words(200 + i, 700), "label": ["x"]}) + "\n" for i in range(14)))
    out = tmp_path / "warm.jsonl"
    warm_path.main(["--model", SHAPE, "--data", str(data), "--contexts", "512", "--chunk-tokens", "256", "--stores", "memory",
                    "--transcripts", "1", "--reps", "1", "--runs", "2", "--miss-contexts", "0", "--policies", "fp16", "cachegen-auto",
                    "cachegen-1", "--out", str(out), "--plot", str(tmp_path / "warm.png")])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["policy"], r["run"]) for r in rows if "policy" in r] == [(p, run) for run in (0, 1) for p in ("fp16", "cachegen-auto", "cachegen-1")]
    assert (tmp_path / "warm.png").read_bytes().startswith(b"\x89PNG")  # the rows it timed, drawn
    assert [r["options"] for r in rows if r.get("policy") == "cachegen-1"] == [[[1, 1]]] * 2  # pinned to its level, each run
    ttft = {(r["policy"], r["run"]): r["ttft_s"] for r in rows if "policy" in r}
    per_run = [r for r in rows if r.get("summary") == "auto_vs_fp16"]
    assert [r["run"] for r in per_run] == [0, 1]
    over = {r["compared"]: r for r in rows if r.get("summary") == "vs_fp16_over_runs"}
    assert set(over) == {"cachegen-auto", "cachegen-1"}  # fp16 against itself says nothing
    for policy, r in over.items():  # each run's ratio against the fp16 of the same run and store
        ratios = [ttft["fp16", run] / ttft[policy, run] for run in (0, 1)]
        assert r["runs"] == 2 and r["per_run"] == [round(x, 3) for x in ratios] and r["store"] == "memory"
        assert r["min"] == round(min(ratios), 3) and r["max"] == round(max(ratios), 3)
        assert r["fp16_over_policy_median"] == round((ratios[0] + ratios[1]) / 2, 3)


def test_warm_path_over_an_emulated_link_with_the_pinned_floor_and_the_raw_engine(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": words(200 + i, 700), "label": ["x"]}) + "\n" for i in range(14)))
    out = tmp_path / "warm.jsonl"
    warm_path.main(["--model", SHAPE, "--data", str(data), "--contexts", "512", "--chunk-tokens", "256", "--stores",
                    "emulated@100gbps", "--transcripts", "1", "--reps", "1", "--runs", "1", "--miss-contexts", "0", "--policies", "fp16-pinned",
                    "cachegen-raw", "cachegen-auto", "--out", str(out)])  # fmt: skip
    rows = {r["policy"]: r for r in map(json.loads, out.read_text().splitlines()) if "policy" in r}
    assert set(rows) == {"fp16-pinned", "cachegen-raw", "cachegen-auto"}
    assert all(r["store"] == "emulated@100gbps" and r["link_gbps"] == 100.0 for r in rows.values())
    assert rows["fp16-pinned"]["bytes"] == 2 * 2 * 2 * 2 * 16 * 512  # the context's bf16 KV, copied whole
    raw = rows["cachegen-raw"]
    assert raw["options"] == [["lossless", "lossless"]] and raw["fetch_s"] > 0 and raw["bytes"] > 2 * 2 * 2 * 2 * 16 * 512
    assert [set(q) for q in raw["requests"]] == [{"ttft_s", "bytes", "fetch_s", "decode_s", "options"}]
