"""``cachegen stats`` and ``cachegen gc`` on real stores filled by a real engine (disk and redis-server)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachegen_core.cli import main
from cachegen_core.engine import KVEngine
from cachegen_core.stores import DiskCacheStore, MemoryStore, RedisStore
from cachegen_core.stores.admin import GcPolicy, gc, scan, stats
from cachegen_core.stores.signed import SignedStore
from cachegen_core.testing import make_tiny_llama, words

CHUNK = 32
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("CACHEGEN_STORE", "CACHEGEN_NAMESPACE", "CACHEGEN_HMAC_KEY"):
        monkeypatch.delenv(name, raising=False)


def fill(store, tiny_llama, tiny_tokenizer, seed: int, chunks: int, model=None) -> KVEngine:
    eng = KVEngine(model or tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=[0, 1, 3],
                   level=1, background=False)  # fmt: skip
    eng.generate(words(seed, chunks * CHUNK + 5), max_new_tokens=1)
    return eng


def run_cli(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_stats_of_a_disk_store(tmp_path, capsys, tiny_llama, tiny_tokenizer):
    store = DiskCacheStore(tmp_path / "kv")
    eng = fill(store, tiny_llama, tiny_tokenizer, 1, 3)
    other = make_tiny_llama(seed=7)
    other_eng = fill(store, tiny_llama, tiny_tokenizer, 2, 2, model=other)
    store.put("not-a-chunk", b"x" * 10)
    store.put("f" * 64 + "-L0", eng.codec.encode(eng.calculate_kv(words(3, CHUNK)), 0, start=0))  # a blob without manifest
    s = run_cli(capsys, "stats", str(tmp_path / "kv"))
    assert (s["chunks"], s["manifests"], s["blobs"], s["chunks_without_manifest"], s["other_keys"]) == (6, 5, 16, 1, 1)
    assert s["entries"] == 5 + 16 + 1
    assert s["levels"]["0"]["blobs"] == 6 and s["levels"]["3"]["blobs"] == 5 and "2" not in s["levels"]
    assert s["levels"]["0"]["bytes"] > s["levels"]["3"]["bytes"] > 0
    assert s["bytes"] == sum(len(store.get(k)) for k in store.keys())  # on disk: exact value bytes
    assert s["models"] == {eng.fingerprint: {"chunks": 4, "bytes": s["models"][eng.fingerprint]["bytes"]},
                           other_eng.fingerprint: {"chunks": 2, "bytes": s["models"][other_eng.fingerprint]["bytes"]}}  # fmt: skip
    assert "models" not in run_cli(capsys, "stats", str(tmp_path / "kv"), "--no-headers")


def test_raw_forms_belong_to_their_chunk(tmp_path, capsys, tiny_llama, tiny_tokenizer):
    store = DiskCacheStore(tmp_path / "kv")
    eng = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=["raw", 1], background=False)
    eng.generate(words(4, 2 * CHUNK + 5), max_new_tokens=1)
    s = run_cli(capsys, "stats", str(tmp_path / "kv"))
    assert (s["chunks"], s["blobs"], s["other_keys"]) == (2, 4, 0)
    assert list(s["levels"]) == ["1", "raw"] and s["levels"]["raw"]["bytes"] > s["levels"]["1"]["bytes"] > 0
    assert s["models"] == {eng.fingerprint: {"chunks": 2, "bytes": s["bytes"]}}
    g = run_cli(capsys, "gc", str(tmp_path / "kv"), "--max-bytes", "0")
    assert (g["chunks_deleted"], g["keys_deleted"], g["bytes_left"]) == (2, 6, 0) and not list(store.keys())


def test_stats_and_gc_per_tier(tmp_path, capsys, tiny_llama, tiny_tokenizer):
    d = str(tmp_path / "kv")
    store = DiskCacheStore(d)
    eng = KVEngine(
        tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=["raw", 1], background=False, allow_text=False
    )  # tiny model: text and fetching tie, picked by timings
    prompt = words(4, 2 * CHUNK + 5)
    eng.generate(prompt, max_new_tokens=1)
    s = run_cli(capsys, "stats", d)
    assert s["tiers"]["raw"] == {"entries": 2, "bytes": s["levels"]["raw"]["bytes"]}
    assert s["tiers"]["capacity"] == {"entries": 4, "bytes": s["bytes"] - s["levels"]["raw"]["bytes"]}  # manifests, levels
    assert s["budget"] == {"limit": 10 << 30, "raw_share": 0.0}
    with pytest.raises(ValueError, match="orphans"):
        GcPolicy(orphans=True, tier="raw")
    g = run_cli(capsys, "gc", d, "--tier", "raw", "--max-bytes", "0", "--dry-run")
    assert (g["blobs_deleted"], g["raw_bytes_left"]) == (2, 0) and len(list(store.keys())) == 6
    g = run_cli(capsys, "gc", d, "--tier", "raw", "--max-bytes", "0")
    assert (g["blobs_deleted"], g["by_reason"], g["bytes_freed"]) == (2, {"size": 2}, s["tiers"]["raw"]["bytes"])
    s = run_cli(capsys, "stats", d)
    assert s["tiers"]["raw"] == {"entries": 0, "bytes": 0} and s["chunks"] == 2
    _, info = eng.generate(prompt, max_new_tokens=1)
    assert info.cached_tokens == 2 * CHUNK and info.levels == [1, 1] and not info.errors  # hits at their level


def test_gc_by_model_age_and_size_on_disk(tmp_path, capsys, tiny_llama, tiny_tokenizer):
    d = str(tmp_path / "kv")
    store = DiskCacheStore(d)
    old = fill(store, tiny_llama, tiny_tokenizer, 1, 3)
    other = fill(store, tiny_llama, tiny_tokenizer, 2, 2, model=make_tiny_llama(seed=7))
    store.put("not-a-chunk", b"x")
    before = sorted(store.keys())

    r = run_cli(capsys, "gc", d, "--model", other.fingerprint[:12], "--dry-run")
    assert (r["chunks_deleted"], r["by_reason"], r["dry_run"]) == (2, {"model": 2}, True)
    assert sorted(store.keys()) == before
    r = run_cli(capsys, "gc", d, "--model", other.fingerprint[:12])
    assert r["chunks_deleted"] == 2 and r["keys_deleted"] == 2 * 4 and r["chunks_left"] == 3
    assert set(stats(store)["models"]) == {old.fingerprint}

    time.sleep(2.5)
    fresh = fill(store, tiny_llama, tiny_tokenizer, 3, 2)
    r = run_cli(capsys, "gc", d, "--older-than", "2s")
    assert r["by_reason"] == {"age": 3} and r["chunks_left"] == 2
    assert fresh.generate(words(3, 2 * CHUNK + 5), max_new_tokens=1)[1].cached_tokens == 2 * CHUNK  # kept
    assert old.generate(words(1, 3 * CHUNK + 5), max_new_tokens=1)[1].cached_tokens == 0  # evicted: recomputed (and stored)

    s = stats(store)
    r = run_cli(capsys, "gc", d, "--max-bytes", str(s["bytes"] // 2))
    assert r["by_reason"]["size"] >= 1 and r["bytes_left"] <= s["bytes"] // 2
    assert stats(store, headers=False)["bytes"] == r["bytes_left"]
    assert "not-a-chunk" in set(store.keys())  # keys of another shape are never touched
    assert main(["gc", d]) == 2  # no policy: refused


def test_gc_orphans_after_a_grace_period(tiny_llama, tiny_tokenizer):
    store = MemoryStore()
    eng = fill(store, tiny_llama, tiny_tokenizer, 1, 2)
    chunk = next(iter(scan(store).chunks))
    store.delete(f"{chunk}-M")
    assert gc(store, GcPolicy(orphans=True))["chunks_deleted"] == 0  # MemoryStore keeps no times: never an orphan by age
    disk_like = [(k, n, 1000.0) for k, n, _ in store.entries()]
    store.entries = lambda prefix="": iter(disk_like)  # the same entries, all 1000 s old
    r = gc(store, GcPolicy(orphans=True, orphan_grace_s=600))
    assert r["by_reason"] == {"orphan": 1} and not any(k.startswith(chunk) for k in store.keys())
    assert eng.generate(words(1, 2 * CHUNK + 5), max_new_tokens=1)[1].cached_tokens == 0


def test_stats_and_gc_on_redis_with_a_signed_store(redis_server, capsys, tiny_llama, tiny_tokenizer):
    redis_server.flushall()
    url = redis_server.url
    store = SignedStore(RedisStore(url, namespace="adm:"), b"k" * 32)
    eng = fill(store, tiny_llama, tiny_tokenizer, 1, 2)
    RedisStore(url, namespace="else:").put("x", b"y")  # another namespace: not counted
    time.sleep(2.2)
    s = run_cli(capsys, "stats", url, "--namespace", "adm:")
    assert (s["chunks"], s["manifests"], s["blobs"]) == (2, 2, 6)
    assert s["models"] == {eng.fingerprint: {"chunks": 2, "bytes": s["bytes"]}}  # signed blobs: headers read without the key
    assert s["oldest_chunk_age_s"] >= 2
    # stats read blob headers, but a chunk's age is its manifest's idle time: still old
    assert run_cli(capsys, "gc", url, "--namespace", "adm:", "--older-than", "2s", "--dry-run")["chunks_deleted"] == 2
    fill(store, tiny_llama, tiny_tokenizer, 2, 1)
    assert eng.generate(words(1, 2 * CHUNK + 5), max_new_tokens=1)[1].cached_tokens == 2 * CHUNK  # used: young again
    time.sleep(1.1)
    r = run_cli(capsys, "gc", url, "--namespace", "adm:", "--older-than", "1s", "--dry-run")
    assert r["chunks_deleted"] == 3  # all idle for >= 1 s
    r = run_cli(capsys, "gc", url, "--namespace", "adm:", "--max-bytes", "1")
    assert r["chunks_left"] == 0 and r["by_reason"] == {"size": 3}
    assert list(RedisStore(url, namespace="adm:").keys()) == []
    assert RedisStore(url, namespace="else:").get("x") == b"y"


def test_the_console_script_runs(tmp_path):
    DiskCacheStore(tmp_path / "kv").put("k", b"v")
    proc = subprocess.run([sys.executable, "-m", "cachegen_core.cli", "stats", str(tmp_path / "kv")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["other_keys"] == 1
