"""Configuration from CACHEGEN_* variables: parsed, applied by the engine, and beaten by arguments."""

from __future__ import annotations

import pytest

from cachegen_core.engine import KVEngine
from cachegen_core.codec.limits import BoundedKVCodec, DecodeLimits
from cachegen_core.ops.settings import CacheGenSettings, engine_options, resolve_store
from cachegen_core.stores import DiskCacheStore, MemoryStore
from cachegen_core.stores.signed import SignedStore
from cachegen_core.stores.url import describe, open_store
from cachegen_core.testing import words

KEY = "0123456789abcdef0123456789abcdef"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    import os

    for name in list(os.environ):
        if name.startswith("CACHEGEN_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))


def test_every_setting_is_read_from_the_environment(monkeypatch):
    env = {"STORE": "memory", "NAMESPACE": "app1:", "CHUNK_TOKENS": "64", "LEVEL": "1", "STORE_OPTIONS": "0,1, 3",
           "SLO_S": "0.5", "HMAC_KEY": KEY, "MAX_ELEMENTS_PER_BYTE": "512", "MAX_BLOB_BYTES": "1000000",
           "MAX_ELEMENTS": "9999999", "MAX_TOKENS": "4096", "PROGRESS": "0"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(f"CACHEGEN_{k}", v)
    s = CacheGenSettings()
    assert (s.store, s.namespace, s.chunk_tokens, s.level, s.store_options, s.slo_s) == ("memory", "app1:", 64, 1, (0, 1, 3), 0.5)
    assert s.key_bytes() == KEY.encode() and KEY not in repr(s)
    assert s.decode_limits == DecodeLimits(512, 1_000_000, 9_999_999, 4096)
    assert s.progress is False
    monkeypatch.setenv("CACHEGEN_STORE_OPTIONS", "[0, 2]")
    assert CacheGenSettings().store_options == (0, 2)
    monkeypatch.setenv("CACHEGEN_STORE_OPTIONS", "raw, 1,lossless")
    monkeypatch.setenv("CACHEGEN_LEVEL", "raw")
    assert (CacheGenSettings().store_options, CacheGenSettings().level) == (("raw", 1, "lossless"), "raw")


def test_unset_and_empty_settings_leave_the_defaults(monkeypatch):
    monkeypatch.setenv("CACHEGEN_SLO_S", "")
    s = CacheGenSettings()
    assert s.store == "disk" and s.chunk_tokens is None and s.slo_s is None and s.hmac_key is None
    kwargs, limits = engine_options({"background": False, "level": None}, s)
    assert kwargs == {"background": False} and limits == DecodeLimits()


def test_bad_settings_are_refused(monkeypatch):
    monkeypatch.setenv("CACHEGEN_CHUNK_TOKENS", "0")
    with pytest.raises(ValueError, match="chunk_tokens"):
        CacheGenSettings()


def test_arguments_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("CACHEGEN_CHUNK_TOKENS", "64")
    monkeypatch.setenv("CACHEGEN_SLO_S", "2")
    kwargs, _ = engine_options({"chunk_tokens": 32, "slo_s": None})
    assert kwargs == {"chunk_tokens": 32, "slo_s": 2.0}
    own = DecodeLimits(max_tokens=100)
    monkeypatch.setenv("CACHEGEN_MAX_TOKENS", "5000")
    assert engine_options({"decode_limits": own})[1] is own


def test_engine_from_pretrained_applies_the_environment(monkeypatch, tiny_llama, tiny_tokenizer):
    monkeypatch.setenv("CACHEGEN_STORE", "memory")
    monkeypatch.setenv("CACHEGEN_CHUNK_TOKENS", "64")
    monkeypatch.setenv("CACHEGEN_STORE_OPTIONS", "0,1")
    monkeypatch.setenv("CACHEGEN_LEVEL", "0")
    monkeypatch.setenv("CACHEGEN_SLO_S", "3")
    monkeypatch.setenv("CACHEGEN_HMAC_KEY", KEY)
    monkeypatch.setenv("CACHEGEN_MAX_ELEMENTS_PER_BYTE", "1024")
    monkeypatch.setenv("CACHEGEN_MAX_TOKENS", "2048")
    # text off (no setting names it): the levels are asserted, and under the SLO a link measured slow (a fetch timed in
    # a stall) made the second chunk text
    eng = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, profile=None, background=False, allow_text=False)
    assert (eng.chunk_tokens, eng.store_options, eng.level, eng.slo_s) == (64, [0, 1], 0, 3.0)
    assert isinstance(eng.store, SignedStore) and isinstance(eng.store.inner, MemoryStore)
    assert isinstance(eng.codec, BoundedKVCodec) and eng.codec.max_elements_per_byte == 1024
    assert eng.codec.max_tokens == 2048
    prompt = words(3, 150)
    first, _ = eng.generate(prompt, max_new_tokens=3)
    again, info = eng.generate(prompt, max_new_tokens=3)
    # reused at the stored levels; with an SLO a blind first chunk streams the medium one (lossy: a random tiny
    # model's greedy answer may then differ, so the answers are not compared)
    assert info.cached_tokens == 128 and not info.errors and info.levels and set(info.levels) <= {0, 1} and again

    own = MemoryStore()
    eng = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, profile=None, store=own, chunk_tokens=32)
    assert eng.chunk_tokens == 32 and eng.store.inner is own  # arguments win; the key still signs what is given


def test_the_default_store_is_the_disk_store_in_the_cache_dir(tmp_path, tiny_llama, tiny_tokenizer):
    eng = KVEngine(tiny_llama, tiny_tokenizer, background=False)
    assert isinstance(eng.store, DiskCacheStore) and eng.store.directory == tmp_path / "cache" / "kv"


def test_a_signed_store_is_not_signed_twice(monkeypatch):
    monkeypatch.setenv("CACHEGEN_HMAC_KEY", KEY)
    signed = SignedStore(MemoryStore(), "another key of 16+ bytes")
    assert resolve_store(signed) is signed
    with pytest.raises(TypeError):
        SignedStore(signed, KEY)


def test_store_urls(tmp_path, redis_server):
    assert isinstance(open_store("memory", namespace="a:"), MemoryStore)
    d = open_store("disk", cache_dir=tmp_path / "c")
    assert isinstance(d, DiskCacheStore) and d.directory == tmp_path / "c" / "kv"
    assert open_store(str(tmp_path / "dir")).directory == tmp_path / "dir"
    assert open_store(f"disk://{tmp_path}/d2", size_limit=1 << 20).size_limit == 1 << 20
    r = open_store(redis_server.url, namespace="urls:")
    r.put("k", b"v")
    assert r.get("k") == b"v" and r.namespace == "urls:"
    for bad in ("s3://bucket", "", "disk://"):
        with pytest.raises(ValueError):
            open_store(bad)


def test_store_urls_carry_the_budget(tmp_path, redis_server):
    d = open_store("disk?size_limit=2G&raw_share=0.3", cache_dir=tmp_path / "c")
    assert (d.size_limit, d.raw_share, d.directory) == (2 << 30, 0.3, tmp_path / "c" / "kv")
    d = open_store(f"disk://{tmp_path}/d3?size_limit=512MiB&raw_share=none")
    assert (d.size_limit, d.raw_share, d.directory) == (512 << 20, None, tmp_path / "d3")
    m = open_store("memory?max_bytes=1.5k")
    assert (m.max_bytes, m.raw_share) == (1536, 0.0)
    assert open_store("memory?max_bytes=1k", max_bytes=10).max_bytes == 10  # code wins over the URL
    r = open_store(redis_server.url + "?ttl_s=600&raw_ttl_s=none&socket_timeout=1.5", namespace="urls:")
    assert (r.ttl_ms, r.raw_ttl_ms) == (600_000, None)
    assert r.client.connection_pool.connection_kwargs["socket_timeout"] == 1.5  # redis-py's own options still ride along
    r.put("k", b"v")
    assert r.get("k") == b"v" and 0 < r.client.pttl("urls:k") <= 600_000
    assert open_store(redis_server.url).raw_ttl_ms == 3600_000  # raw forms expire after an hour unused by default
    assert open_store(redis_server.url).same_host  # 127.0.0.1: this machine's cores serve it
    assert not open_store(redis_server.url + "?same_host=0").same_host  # e.g. behind a proxy that stands for a remote one
    assert open_store("redis://10.1.2.3:6379/0?same_host=yes").same_host  # this machine's own LAN address
    with pytest.raises(ValueError, match="same_host='maybe'"):
        open_store(redis_server.url + "?same_host=maybe")
    for bad in ("disk?size_limit=lots", "memory?colour=blue", "disk?raw_share=2"):
        with pytest.raises(ValueError):
            open_store(bad, cache_dir=tmp_path / "c")


def test_describe_hides_passwords():
    assert describe("rediss://app1:p@ss@host:6380/0") == "rediss://app1:***@host:6380/0"
    assert describe("redis://:pw@h/0") == "redis://:***@h/0"
    assert describe("redis://h:1/0") == "redis://h:1/0"


def test_from_model_id_takes_the_chunk_size_from_the_environment(monkeypatch, tmp_path, tiny_llama, tiny_tokenizer):
    from langchain_cachegen import CacheGenLLM

    tiny_llama.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    monkeypatch.setenv("CACHEGEN_CHUNK_TOKENS", "48")
    monkeypatch.setenv("CACHEGEN_STORE", "memory")
    llm = CacheGenLLM.from_model_id(tmp_path / "m", profile=None, background=False)
    assert llm.engine.chunk_tokens == 48 and isinstance(llm.engine.store, MemoryStore)
    assert CacheGenLLM.from_model_id(tmp_path / "m", profile=None, chunk_tokens=96).engine.chunk_tokens == 96
    monkeypatch.delenv("CACHEGEN_CHUNK_TOKENS")
    assert CacheGenLLM.from_model_id(tmp_path / "m", profile=None).engine.chunk_tokens == 1536
