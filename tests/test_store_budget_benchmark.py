"""benchmarks.store_budget: its traces replayed against real disk stores do what the engine does, and the whole
script runs end to end on a shaped random-init model."""

from __future__ import annotations

import json

import pytest

from benchmarks import common, store_budget
from benchmarks.budget_traces import CHUNK, LEVEL, RAW, Costs, Replay, chat_trace, rag_trace, summarise, zipf_trace
from cachegen_core.codec import fitting
from cachegen_core.stores import DiskCacheStore
from cachegen_core.testing import words

FP16 = 1000  # bytes a token
COSTS = Costs(prefill=(0.05, 1e-3, 0.0), stream={RAW: (0.0, 1e-5), LEVEL: (0.0, 5e-5)},
              size={RAW: (100.0, FP16), LEVEL: (100.0, FP16 / 4)}, probe_s=1e-4, rag=(4.0, 0.5), fp16_bytes_per_token=FP16)  # fmt: skip
Q = 20


def replay(tmp_path, trace, policy: str, fraction: float) -> Replay:
    spec = dict(store_budget.POLICIES[policy])
    forms = spec.pop("forms")
    store = DiskCacheStore(tmp_path / f"{trace.name}-{policy}-{fraction}", size_limit=round(fraction * trace.working_set_tokens * FP16),
                           disk_min_file_size=0, **spec)  # fmt: skip
    r = Replay(store, forms, COSTS, scale=1.0)
    for req in trace.requests:
        r.run(req)
    return r


def test_a_zipf_trace_with_room_for_every_level_misses_each_context_once(tmp_path):
    lengths = [3072, 4096, 5120, 8192]
    trace = zipf_trace(lengths, 40, Q, seed=3)
    r = replay(tmp_path, trace, "levels-only", 1.0)
    seen, want = set(), []
    for req in trace.requests:
        first = req.units[0].key not in seen
        seen.add(req.units[0].key)
        n = req.context_tokens
        want.append(COSTS.prefill_s(0, n + Q) if first else COSTS.prefill_s(n, n + Q) + COSTS.stream_s(LEVEL, 1) * n)
    assert r.tally.ttft == pytest.approx(want)
    row = summarise(r.tally, len(trace.requests))
    assert row["hit_rate"] == (40 - len(seen)) / 40 and row["units_streamed"]["raw"] == 0 and row["lost_form_probes"] == 0
    assert r.held()[0] <= trace.working_set_tokens * FP16 / 4 + 10_000


def test_tiers_keep_every_level_and_the_raw_forms_that_fit(tmp_path):
    trace = zipf_trace([3072 + 512 * i for i in range(10)], 120, Q, seed=1)
    tiered = replay(tmp_path, trace, "tiered", 0.5)
    fp16 = replay(tmp_path, trace, "fp16-only", 0.5)
    levels = replay(tmp_path, trace, "levels-only", 0.5)
    t, f, lv = (summarise(x.tally, 120) for x in (tiered, fp16, levels))
    assert t["hit_rate"] == lv["hit_rate"] > f["hit_rate"]  # every level fits at half the fp16 bytes, not every fp16 form
    assert t["units_streamed"]["raw"] > 0 and t["units_streamed"][str(LEVEL)] > 0 and t["lost_form_probes"] > 0  # raw forms went first
    assert t["mean_ttft_s"] < lv["mean_ttft_s"] < f["mean_ttft_s"]
    total, raw = tiered.held()
    assert 0 < raw and total <= 0.5 * trace.working_set_tokens * FP16


def test_a_chat_reuses_its_last_turn_and_keeps_raw_only_for_its_newest_partial(tmp_path):
    trace = chat_trace(3, 6, 1024, 448, Q, seed=2)
    r = replay(tmp_path, trace, "tiered", 1.0)
    last: dict[object, int] = {}
    reused = []
    for req in trace.requests:
        reused.append(last.get(req.context, 0))
        last[req.context] = req.context_tokens
    assert r.tally.reused_tokens == sum(reused) > 0  # every turn but a chat's first reuses all of the turn before
    raw_partials = [k for k in r.store.keys() if k.endswith("-Lraw")]
    assert len(raw_partials) <= 3 * (1 + 4)  # per chat: its newest partial chunk and its complete chunks
    assert r.tally.write_failures == 0


def test_rag_questions_reuse_documents_wherever_they_are(tmp_path):
    trace = rag_trace(8, 1024, 4, 30, 40, seed=0)
    r = replay(tmp_path, trace, "levels-only", 1.0)
    row = summarise(r.tally, 30)
    assert row["hit_rate"] > 0.8 and row["units_streamed"][str(LEVEL)] == round(row["token_hit_rate"] * 30 * 4)
    assert min(r.tally.ttft) == pytest.approx(0.5 + 4 * 1024 * 5e-5)  # every document cached: the measured hit
    assert max(r.tally.ttft) == pytest.approx(4.0)  # none: the measured miss


def test_the_script_runs_end_to_end_on_a_shaped_model(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "DEFAULT_MODEL", tiny_model_dir)  # the tokenizer a shaped model takes
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fitting, "calibration_texts", lambda: [words(7, 700)])  # the tiny tokenizer knows these words only
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": words(300 + i, 3000), "label": ["x"]}) + "\n" for i in range(4)))
    out, png = tmp_path / "out.jsonl", tmp_path / "budget.png"
    store_budget.main(["--model", "llama-shaped:layers=2,hidden=64,heads=4,kv_heads=2,intermediate=128", "--data", str(data),
                       "--measure", "2", "--lengths", "1600", "2400", "--contexts", "5", "--requests", "12", "--chats", "2", "--turns", "3", "--docs", "5",
                       "--budgets", "0.25", "1.0", "--reps", "1", "--scale", "1", "--tmp", str(tmp_path),
                       "--out", str(out), "--plot", str(png)])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["row"] == "meta" and rows[0]["cores"] and rows[1]["kind"] == "costs"
    # coded as a user's engine codes this model (no profile anywhere): steps weighted by its measured sensitivity
    assert rows[1]["profile"] is None and rows[1]["step_weights"] is True and rows[1]["codec"].startswith("cachegen-v3-")
    table = [r for r in rows if "policy" in r]
    assert len(table) == 3 * len(store_budget.POLICIES) * 2
    for r in table:
        assert {"policy", "budget_fraction", "hit_rate", "mean_ttft_s", "p95_ttft_s", "bytes_held"} <= set(r)
    assert [r["trace"] for r in rows if r.get("kind") == "targets"] == ["zipf", "chat", "rag"]
    assert png.stat().st_size > 1000
    again = tmp_path / "again.jsonl"  # the costs of that run replayed again: the same rows (the replay is deterministic)
    store_budget.main(["--model", "llama-shaped:layers=2,hidden=64,heads=4,kv_heads=2,intermediate=128", "--data", str(data),
                       "--costs", str(out), "--lengths", "1600", "2400", "--contexts", "5", "--requests", "12", "--chats", "2",
                       "--turns", "3", "--docs", "5", "--budgets", "0.25", "1.0", "--scale", "1", "--tmp", str(tmp_path),
                       "--out", str(again)])  # fmt: skip
    assert [r for r in map(json.loads, again.read_text().splitlines()) if "policy" in r] == table
    assert {a % CHUNK for a, _, _ in rows[1]["prefill"]} >= {0}  # measured with whole chunks reused (and partial chunks)
