"""A store authenticated with a deployment key: forged values are misses, never decoded."""

from __future__ import annotations

import logging

import pytest

from cachegen_core.keys.chunks import blob_key
from cachegen_core.engine import KVEngine
from cachegen_core.kv import KVCache
from cachegen_core.keys.manifest import Manifest, manifest_key
from cachegen_core.stores import MemoryStore, RedisStore
from cachegen_core.stores.signed import OVERHEAD, SignedStore, sign, unwrap
from cachegen_core.testing import words

KEY = b"deployment-key-0123456789abcdef!"
OTHER = b"someone-else's-key-0123456789abc"
CHUNK = 64


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch):
    monkeypatch.delenv("CACHEGEN_HMAC_KEY", raising=False)


def test_round_trip_and_layout():
    inner = MemoryStore(namespace="ns:")
    s = SignedStore(inner, KEY)
    s.put("a", b"value a")
    s.put_many([("b", b"value b"), ("c", b"")])
    assert s.get("a") == b"value a" and s.get_many(["b", "c", "missing"]) == [b"value b", b"", None]
    assert len(inner.get("a")) == len(b"value a") + OVERHEAD and inner.get("a").startswith(b"value a")
    assert sorted(s.keys()) == ["a", "b", "c"] and s.namespace == "ns:" and unwrap(s) is inner
    assert s.local  # a memory store is on this machine: the engine times its fetches as a local store's
    s.delete_many(["a", "b"])
    assert s.get("a") is None and s.contains("c") and s.rejected == 0


def test_short_keys_are_refused():
    with pytest.raises(ValueError, match="16 bytes"):
        SignedStore(MemoryStore(), "short")


def test_untagged_wrong_tag_replayed_and_truncated_values_are_misses_logged_once(caplog):
    inner = MemoryStore()
    s = SignedStore(inner, KEY)
    s.put("good", b"payload")
    inner.put("untagged", b"payload")
    inner.put("wrong", sign(OTHER, "wrong", b"payload"))
    inner.put("replayed", inner.get("good"))  # a valid value of another key
    inner.put("truncated", inner.get("good")[:-1])
    inner.put("flipped", b"Payload" + inner.get("good")[7:])
    with caplog.at_level(logging.WARNING, logger="cachegen_core.stores.signed"):
        for _ in range(3):
            assert s.get_many(["untagged", "wrong", "replayed", "truncated", "flipped"]) == [None] * 5
            assert s.get("good") == b"payload"
    assert s.rejected == 15
    assert len(caplog.records) == 1 and "never decoded" in caplog.records[0].getMessage()


def _plant_forged_chunks(eng: KVEngine, inner: MemoryStore, prompt: str, how: str) -> list[bytes]:
    """What an attacker with write access to the backend does: well-formed blobs of this very model,
    codec and profile, with KV of its choosing, and manifests naming them, under the prompt's chunk keys."""
    planted = []
    for c in eng.chunks(prompt):
        kv = eng.calculate_kv(eng.tokenize(prompt)[: c.end]).slice(c.start, c.end)
        forged = eng.codec.encode(KVCache(kv.keys * -3.0, kv.values.flip(-1)), eng.level, start=0)  # valid CRCs, wrong KV
        manifest = Manifest({eng.level: len(forged)}).to_bytes()
        if how == "wrong tag":
            forged, manifest = sign(OTHER, blob_key(c.key, eng.level), forged), sign(OTHER, manifest_key(c.key), manifest)
        inner.put(blob_key(c.key, eng.level), forged)
        inner.put(manifest_key(c.key), manifest)
        planted.append(forged)
    return planted


def _count_decodes(eng: KVEngine) -> list[bytes]:
    """Every blob handed to the engine's (real) codec from now on."""
    seen: list[bytes] = []
    real = eng.codec.decode

    def decode(blob, *args, **kwargs):
        seen.append(bytes(getattr(blob, "blob", blob)))  # a verified blob (Checked) or its bytes
        return real(blob, *args, **kwargs)

    eng.codec.decode = decode
    return seen


@pytest.mark.parametrize("how", ["no tag", "wrong tag"])
def test_forged_blob_is_never_decoded_with_a_key(tiny_llama, tiny_tokenizer, how, caplog):
    prompt = words(11, 3 * CHUNK + 20)
    plain = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, background=False)
    expected, _ = plain.generate(prompt, max_new_tokens=6)

    inner = MemoryStore()
    # the level alone stored: the chunks it stores are re-forged after each request (a raw form it stored, signed, would hit)
    eng = KVEngine(
        tiny_llama, tiny_tokenizer, store=SignedStore(inner, KEY), chunk_tokens=CHUNK, background=False, level=1, store_options=[1], allow_text=False
    )  # fmt: skip  (on a tiny model text may be faster: it must fetch)
    planted = _plant_forged_chunks(eng, inner, prompt, how)
    decoded = _count_decodes(eng)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            text, info = eng.generate(prompt, max_new_tokens=6)
            assert text == expected and info.cached_tokens == 0 and not info.errors
            # the engine stored the recomputed chunks (signed): forge their blobs again under its manifests
            inner.put_many(list(zip([blob_key(c.key, eng.level) for c in eng.chunks(prompt)], planted)))
    assert not set(decoded) & set(planted), "a forged blob reached the decoder"
    # (the engine's own signed chunks, stored again after each request, may be decoded: its cost probes time them)
    assert eng.store.rejected >= 3
    assert sum("never decoded" in r.getMessage() for r in caplog.records) == 1  # once, not per request


def test_without_a_key_the_same_forgery_is_used(tiny_llama, tiny_tokenizer):
    """The control: the forgery above is well-formed enough that only the key stops it."""
    prompt = words(11, 3 * CHUNK + 20)
    inner = MemoryStore()
    eng = KVEngine(tiny_llama, tiny_tokenizer, store=inner, chunk_tokens=CHUNK, background=False, allow_text=False)
    planted = _plant_forged_chunks(eng, inner, prompt, "no tag")
    decoded = _count_decodes(eng)
    _, info = eng.generate(prompt, max_new_tokens=6)
    assert info.cached_tokens == 3 * CHUNK and set(planted) <= set(decoded)


def test_signed_engine_reuses_its_own_chunks(tiny_llama, tiny_tokenizer):
    prompt = words(12, 2 * CHUNK + 9)
    answers = []
    for store in (MemoryStore(), SignedStore(MemoryStore(), KEY)):
        # one stored form, never text: which of raw, a level or text the controller takes per chunk follows timings, and
        # their KV differ
        eng = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, background=False, level=1, store_options=[1],
                       allow_text=False)  # fmt: skip
        eng.generate(prompt, max_new_tokens=5)
        text, info = eng.generate(prompt, max_new_tokens=5)
        assert info.cached_tokens == 2 * CHUNK and not info.errors
        answers.append(text)
    assert answers[0] == answers[1] and eng.store.rejected == 0  # the same KV reused, signed or not


def test_signed_redis_store(redis_server):
    redis_server.flushall()
    s = SignedStore(RedisStore(redis_server.url, namespace="signed:"), KEY)
    s.put_many({"a": b"1", "b": b"2"})
    assert s.get_many(["a", "b"]) == [b"1", b"2"] and not s.local
    raw = redis_server.client()
    raw.set("signed:a", b"1")
    raw.close()
    assert s.get("a") is None and s.rejected == 1
