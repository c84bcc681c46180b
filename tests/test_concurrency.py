"""Concurrent warm requests on one engine: every answer is the sequential run's, nothing lost, no error.

Runs ``benchmarks/concurrency.py`` on the tiny model: 6 prompts of 3 stored chunks each,
answered by 1, 4 and 8 threads; each thread's answer must equal the sequential answer
for its prompt (a mixed-up KV would change it) and reuse every stored chunk.
"""

from __future__ import annotations

import pytest

from benchmarks import concurrency as C
from cachegen_core.engine import KVEngine
from cachegen_core.stores import DiskCacheStore, MemoryStore
from cachegen_core.testing import words

CHUNK = 64


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_concurrent_answers_equal_the_sequential_run(kind, tmp_path, tiny_llama, tiny_tokenizer):
    store = MemoryStore() if kind == "memory" else DiskCacheStore(tmp_path / "kv")
    # one stored form, never text: every request streams the same KV, so any difference is a mix-up
    eng = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=[1], allow_text=False, background=False)
    prompts = [words(100 + i, 3 * CHUNK + 10) for i in range(6)]
    rows = C.run(eng, prompts, [1, 4, 8], requests=24, max_new_tokens=5)
    for row in rows:
        assert row["requests"] == 24 and row["lost"] == 0
        assert row["mismatches"] == 0 and row["errors"] == 0
        assert row["cached_tokens_mean"] == 3 * CHUNK  # every request reused all its chunks
        assert row["model_s"] > 0 and row["overlap"] > 0
    m = eng.metrics()
    assert m.requests == 2 * 6 + 3 * 24 and m.errors == 0


def test_a_failed_request_is_reported_not_lost(tiny_llama, tiny_tokenizer):
    eng = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, background=False)
    with pytest.raises(RuntimeError, match="1 request"):
        C.answer_all(eng, [words(1, 70), ""], [0, 1, 0], threads=3, max_new_tokens=2)  # "" is refused by the engine
