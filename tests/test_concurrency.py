"""``benchmarks.concurrency`` end to end on a tiny random model: every workload's rows, every answer the sequential
run's, nothing lost; ``benchmarks.ceiling`` measures plain transformers' batched step."""

from __future__ import annotations

import json

import pytest

from benchmarks import ceiling, common
from benchmarks import concurrency as C
from cachegen_core.testing import words

KEYS = {"workload", "mode", "users", "requests", "requests_per_min", "tokens_per_s", "speedup", "ttft_p50_s", "ttft_p95_s",
        "mismatches", "near_ties", "errors", "lost", "failed"}  # fmt: skip


@pytest.fixture
def data(tmp_path) -> str:
    path = tmp_path / "words.jsonl"  # transcripts of the words the tiny tokenizer knows
    path.write_text("".join(json.dumps({"test_id": i, "prompt": words(140 + i, 700), "label": ["x"]}) + "\n" for i in range(6)))
    return str(path)


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(C, "WORKLOADS", dict(C.WORKLOADS))  # --context-scale and --context-tokens change them


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_every_workload_answers_as_the_sequential_run_with_nothing_lost(tiny_model_dir, data, tmp_path, store):
    out = tmp_path / "c.jsonl"
    C.main(["--model", tiny_model_dir, "--data", data, "--store", store, "--users", "1", "2", "4", "--new-tokens", "6",
            "--modes", "threads", "asyncio", "--context-scale", "0.05", "--join", "200", "--out", str(out), "--plot", str(tmp_path / "c.png")])  # fmt: skip
    rows = [r for r in common.results(out) if "workload" in r]
    join = [r for r in common.results(out) if "join" in r]
    assert [r["baseline_requests"] for r in common.results(out) if "baseline_requests" in r] == [6]  # what the 1-user rows sent
    assert len(join) == 1 and join[0]["cold_prompt_tokens"] > 200 and join[0]["decode_step_s"] > 0
    assert {(r["workload"], r["mode"], r["users"]) for r in rows} == {
        (w, m, u) for w in C.WORKLOADS for m in ("threads", "asyncio") for u in (1, 2, 4)
    }
    for r in rows:
        assert KEYS <= set(r)
        # 2 requests a user; the one user of the baseline sends 6 (--baseline-requests): the prompts of 3 users
        assert r["requests"] == (6 if r["users"] == 1 else 2 * r["users"]) and r["lost"] == r["failed"] == r["errors"] == 0
        # a mixed-up KV would change answers at will; batching's rounding only where the top two logits nearly tie
        assert r["mismatches"] == r["near_ties"] <= r["requests"] // 4
    shared = [r for r in rows if r["workload"] == "shared" and r["users"] > 1]
    assert any(r["shared_tokens_mean"] > 0 for r in shared)  # users of one context read it in place
    assert all(r["cold_requests"] == round(0.25 * r["requests"]) for r in rows if r["workload"] == "mixed")
    assert all(r["ceiling"] > 0 and "of_ceiling" in r for r in rows if r["workload"] != "mixed")
    assert (tmp_path / "c.png").stat().st_size > 0 and (tmp_path / "c-ttft.png").stat().st_size > 0


def test_a_failed_request_is_reported_not_lost(tiny_llama, tiny_tokenizer):
    from cachegen_core.engine import KVEngine
    from cachegen_core.stores.memory import MemoryStore

    eng = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=64, background=False)
    answers, failures = C.run_threads(eng, [[words(1, 70), ""], [words(2, 50)]], {"max_new_tokens": 2})  # "" is refused
    assert len(answers) == 2 and len(failures) == 1 and "empty" in str(failures[0])


def test_the_ceiling_is_plain_transformers_batched_step(tiny_model_dir, tmp_path):
    out = tmp_path / "ceiling.jsonl"
    ceiling.main(["--model", tiny_model_dir, "--users", "1", "4", "--tokens", "64", "--out", str(out)])
    rows = common.results(out)
    assert {(r["shared"], r["users"]) for r in rows} == {(False, 1), (False, 4), (True, 1), (True, 4)}
    assert all(r["step_s"] > 0 and r["speedup"] > 0 for r in rows)


def test_the_engines_step_is_timed_beside_plain_transformers(tiny_model_dir, tmp_path):
    out = tmp_path / "ceiling.jsonl"
    ceiling.main(["--model", tiny_model_dir, "--users", "1", "3", "--tokens", "64", "--engine", "--pairs", "2", "--out", str(out)])
    rows = common.results(out)
    assert {(r["shared"], r["users"]) for r in rows} == {(False, 1), (False, 3), (True, 1), (True, 3)}
    for r in rows:
        assert r["engine_step_s"] > 0 and r["engine_of_plain"] == pytest.approx(r["step_s"] / r["engine_step_s"], rel=0.05)  # of rounded seconds
        assert r["engine_speedup"] == 1.0 if r["users"] == 1 else r["engine_speedup"] > 0


def test_staggered_users_start_a_gap_apart_and_answer_as_the_sequential_run(tiny_model_dir, data, tmp_path):
    out = tmp_path / "c.jsonl"
    C.main(["--model", tiny_model_dir, "--data", data, "--users", "1", "3", "--new-tokens", "4", "--modes", "threads", "asyncio",
            "--workloads", "shared", "--arrivals", "together", "staggered", "--context-tokens", "230", "--no-ceiling",
            "--join", "0", "--out", str(out)])  # fmt: skip
    rows = [r for r in common.results(out) if "workload" in r]
    assert {(r["mode"], r["arrivals"], r["users"]) for r in rows} == {
        (m, a, u) for m in ("threads", "asyncio") for a, u in (("together", 1), ("together", 3), ("staggered", 3))
    }
    for r in rows:
        assert r["context_tokens"] == 230  # --context-tokens: the context of every workload
        assert r["requests"] == 6 and r["lost"] == r["failed"] == 0  # 1 user: the baseline's 6; 3 users: 2 each
        assert r["mismatches"] == r["near_ties"] <= 1
    for m in ("threads", "asyncio"):  # users a third of a lone request's time apart
        lone = next(r for r in rows if r["mode"] == m and r["users"] == 1)
        assert [r["start_gap_s"] for r in rows if r["mode"] == m] == [0.0, 0.0, round(lone["total_p50_s"] / 3, 4)]
    with pytest.raises(SystemExit) as refused:  # no lone request's time to set the gap
        C.main(["--model", tiny_model_dir, "--data", data, "--users", "2", "--arrivals", "staggered", "--out", str(out)])
    assert refused.value.code == 2  # argparse's usage error
    with pytest.raises(SystemExit) as refused:
        C.main(["--model", tiny_model_dir, "--data", data, "--context-tokens", "8", "--out", str(out)])
    assert refused.value.code == 2


@pytest.mark.parametrize("mode", ["threads", "asyncio"])
def test_user_u_starts_u_gaps_after_the_first(tiny_llama, tiny_tokenizer, mode):
    import time

    from cachegen_core.engine import KVEngine
    from cachegen_core.stores.memory import MemoryStore
    from langchain_cachegen import CacheGenLLM

    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=64, background=False)
    llm, starts = CacheGenLLM(engine=engine), {}

    class Starts:  # the real engine and LLM, each call's start time noted
        def generate(self, prompt, **kw):
            starts[prompt] = time.perf_counter()
            return engine.generate(prompt, **kw)

        async def agenerate(self, prompts, **kw):
            starts[prompts[0]] = time.perf_counter()
            return await llm.agenerate(prompts, **kw)

    prompts = [words(i, 30) for i in range(3)]
    if mode == "threads":
        answers, failures = C.run_threads(Starts(), [[p] for p in prompts], {"max_new_tokens": 1}, gap=0.25)
    else:
        answers, failures = C.run_asyncio(Starts(), [[p] for p in prompts], 1, gap=0.25)
    assert len(answers) == 3 and not failures
    t = [starts[p] for p in prompts]
    assert t[1] - t[0] >= 0.24 and t[2] - t[0] >= 0.49
