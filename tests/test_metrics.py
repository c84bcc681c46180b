"""engine.metrics(): totals of finished requests, thread-safe, per store; the Prometheus exporter scraped for real."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import urllib.request
from pathlib import Path

import pytest

from cachegen_core.engine import GenerationInfo, KVEngine
from cachegen_core.ops.metrics import MetricsRecorder, StoreMetrics, request_metrics
from cachegen_core.stores import MemoryStore, RedisStore
from cachegen_core.stores.signed import SignedStore
from cachegen_core.testing import free_port, words

CHUNK = 64
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def engine(tiny_llama, tiny_tokenizer):
    # text off: the tiny model's prefill ties with fetching, picked by timings (the counts below expect no text chunk)
    return KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(namespace="m:"), chunk_tokens=CHUNK, background=False, allow_text=False)


def test_metrics_add_up_the_requests(engine):
    assert engine.metrics().requests == 0 and engine.metrics().hit_rate == 0.0
    prompt = words(21, 3 * CHUNK + 7)
    infos = [engine.generate(prompt, max_new_tokens=3)[1] for _ in range(3)]
    m = engine.metrics()
    assert (m.requests, m.hits, m.hit_rate) == (3, 2, pytest.approx(2 / 3))
    assert m.prompt_tokens == 3 * len(engine.tokenize(prompt))
    assert m.tokens_reused == 2 * 3 * CHUNK == sum(i.cached_tokens for i in infos)
    assert m.tokens_recomputed == m.prompt_tokens - m.tokens_reused
    assert m.chunks_reused == 6 and m.text_chunks == 0
    assert m.bytes_fetched == sum(i.bytes_fetched for i in infos) > 0
    assert m.fetch_s == pytest.approx(sum(i.fetch_s for i in infos))
    assert m.decode_s == pytest.approx(sum(i.decode_s for i in infos)) and m.decode_s > 0
    assert m.prefill_s == pytest.approx(sum(i.ttft_s - i.fetch_s - i.decode_s for i in infos), rel=1e-6)
    assert m.new_tokens == sum(i.new_tokens for i in infos) and m.errors == 0
    assert list(m.stores) == ["MemoryStore(namespace='m:')"] and m.stores["MemoryStore(namespace='m:')"] == m.total
    assert m.prefill_s_per_token == engine.cost_model.prefill_s_per_token
    d = m.as_dict()
    assert d["hit_rate"] == m.hit_rate and d["stores"]["MemoryStore(namespace='m:')"]["hits"] == 2


def test_a_batch_counts_its_shared_fetch_once(engine):
    """generate_many streams a chunk shared by its prompts once: the metrics count its bytes once."""
    shared = words(22, 2 * CHUNK)
    prompts = [shared + " " + words(23 + i, 5) for i in range(3)]
    engine.generate(prompts[0], max_new_tokens=2)
    engine.metrics_recorder.reset()
    results = engine.generate_many(prompts, max_new_tokens=2)
    infos = [info for _, info in results]
    assert all(i.bytes_fetched == infos[0].bytes_fetched > 0 for i in infos)  # each prompt reports the batch's figures
    m = engine.metrics()
    assert (m.requests, m.hits, m.tokens_reused) == (3, 3, 3 * 2 * CHUNK)
    assert m.bytes_fetched == infos[0].bytes_fetched and m.decode_s == pytest.approx(infos[0].decode_s)


def test_seconds_saved_is_reused_tokens_at_prefill_cost_less_fetch_and_decode():
    info = GenerationInfo(prompt_tokens=300, cached_tokens=256, recomputed_tokens=44, levels=[1, 1, "text", 1],
                          text_chunks=1, fetch_s=0.1, decode_s=0.2, ttft_s=0.5, bytes_fetched=1000)  # fmt: skip
    m = request_metrics(info, chunk_tokens=64, prefill_s_per_token=0.01)
    assert (m.tokens_reused, m.tokens_recomputed, m.chunks_reused) == (192, 108, 3)  # the text chunk was recomputed
    assert m.seconds_saved == pytest.approx(192 * 0.01 - 0.3) and m.prefill_s == pytest.approx(0.2)
    assert request_metrics(GenerationInfo(prompt_tokens=10), 64, 0.01).seconds_saved == 0.0


def test_the_recorder_is_thread_safe():
    rec = MetricsRecorder()
    info = GenerationInfo(prompt_tokens=100, cached_tokens=64, levels=[0], bytes_fetched=10, errors=["store failure: x"])

    def feed():
        for _ in range(500):
            rec.record(info, store="'S'", chunk_tokens=64, prefill_s_per_token=0.001)

    threads = [threading.Thread(target=feed) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m = rec.snapshot()["'S'"]
    assert (m.requests, m.hits, m.tokens_reused, m.bytes_fetched, m.store_errors) == (4000, 4000, 256000, 40000, 4000)
    assert m + StoreMetrics() == m


def test_store_errors_and_rejected_values_are_counted(tiny_llama, tiny_tokenizer):
    dead = KVEngine(tiny_llama, tiny_tokenizer, store=RedisStore(host="127.0.0.1", port=free_port()),
                    chunk_tokens=CHUNK, background=False)  # fmt: skip
    dead.generate(words(22, CHUNK + 5), max_new_tokens=2)
    m = dead.metrics()
    assert m.requests == 1 and m.store_errors >= 1 and m.errors >= m.store_errors

    inner = MemoryStore()
    signed = KVEngine(tiny_llama, tiny_tokenizer, store=SignedStore(inner, b"k" * 32), chunk_tokens=CHUNK, background=True)
    prompt = words(23, CHUNK + 5)
    signed.generate(prompt, max_new_tokens=2)
    assert signed.flush(30)
    for key in list(inner.keys()):
        inner.put(key, b"forged")
    signed.generate(prompt, max_new_tokens=2)
    assert signed.flush(30)
    m = signed.metrics()
    assert m.rejected_values >= 1 and m.hits == 0 and m.writes["written"] == 2  # the forged chunk recomputed and stored again
    signed.generate(prompt, max_new_tokens=2)
    assert signed.metrics().hits == 1  # and found the next time


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_prometheus_exporter_text_and_http(engine):
    from cachegen_core.ops.prometheus import PrometheusExporter

    prompt = words(24, 2 * CHUNK + 3)
    engine.generate(prompt, max_new_tokens=2)
    engine.generate(prompt, max_new_tokens=2)
    exporter = PrometheusExporter(engine)
    m = engine.metrics()
    label = (("store", "MemoryStore(namespace='m:')"),)
    samples = _samples(exporter.text())
    assert samples[("cachegen_requests_total", label)] == 2
    assert samples[("cachegen_cache_hits_total", label)] == 1
    assert samples[("cachegen_tokens_reused_total", label)] == 2 * CHUNK
    assert samples[("cachegen_tokens_recomputed_total", label)] == m.tokens_recomputed
    assert samples[("cachegen_bytes_fetched_total", label)] == m.bytes_fetched
    assert samples[("cachegen_decode_seconds_total", label)] == pytest.approx(m.decode_s)
    assert samples[("cachegen_seconds_saved", label)] == pytest.approx(m.seconds_saved)
    assert samples[("cachegen_hit_ratio", label)] == 0.5
    assert samples[("cachegen_store_errors_total", label)] == 0
    assert samples[("cachegen_rejected_values_total", ())] == 0
    port = exporter.serve(0)
    try:
        engine.generate(prompt, max_new_tokens=2)  # read at scrape time
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            scraped = _samples(resp.read().decode())
        assert scraped[("cachegen_requests_total", label)] == 3
        assert scraped[("cachegen_cache_hits_total", label)] == 2
    finally:
        exporter.close()


def test_the_exporter_without_prometheus_client_names_the_extra():
    code = """
        import sys
        sys.modules["prometheus_client"] = None
        try:
            import cachegen_core.ops.prometheus
        except ImportError as e:
            print(e)
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "pip install 'langchain-cachegen[metrics]'" in proc.stdout, proc.stderr
