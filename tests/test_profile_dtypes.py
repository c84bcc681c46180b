"""A profile serves its model in any floating dtype (the profile records the model's identity: family and a sample of
its weights), while chunk keys stay dtype-bound: KV computed in another dtype is never served for this one."""

from __future__ import annotations

import logging

import pytest
import torch

from cachegen_core.codec.config import CodecConfig
from cachegen_core.codec.fitting import FitPlan, fit_profile
from cachegen_core.codec.profile import IDENTITY_KEY, Profile
from cachegen_core.codec.profiles import SHIPPED, default_profile_path
from cachegen_core.engine import KVEngine
from cachegen_core.keys.fingerprint import model_family, model_fingerprint, model_identity, same_model
from cachegen_core.kv import KVCache
from cachegen_core.stores import MemoryStore
from cachegen_core.testing import make_tiny_llama, words
from tests.test_engine import plain_greedy

PLAN = FitPlan(texts=2, tokens=300, contexts=(96,), continuation=32, chunk_tokens=128)
CHUNK = 32


@pytest.fixture(autouse=True)
def isolated_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CACHEGEN_HMAC_KEY", raising=False)


@pytest.fixture(scope="module")
def fitted(tiny_tokenizer) -> Profile:
    """A profile of the tiny model (seed 0) fitted in float32, saved in the user cache by its fingerprint."""
    model = make_tiny_llama()
    fp = model_fingerprint(model, tiny_tokenizer)
    return fit_profile(model, tiny_tokenizer, [words(s, 400) for s in (11, 12)], plan=PLAN, fingerprint=fp,
                       identity=model_identity(model, tiny_tokenizer))  # fmt: skip


def engine(model, tokenizer, store=None, **kw) -> KVEngine:
    kw.setdefault("auto_profile", False)
    kw.setdefault("allow_text", False)  # tiny model: prefilling a chunk ties with fetching it
    return KVEngine.from_pretrained(
        model, tokenizer=tokenizer, store=MemoryStore() if store is None else store, chunk_tokens=CHUNK, background=False, **kw
    )


def test_the_identity_is_the_models_in_every_dtype(tiny_tokenizer):
    ref = model_identity(make_tiny_llama(), tiny_tokenizer)
    assert ref["dtype"] == "torch.float32" and len(ref["weights"]) == 8 * len(list(make_tiny_llama().parameters()))
    for dtype in (torch.bfloat16, torch.float16):
        other = make_tiny_llama(dtype=dtype)
        assert model_fingerprint(other, tiny_tokenizer) != model_fingerprint(make_tiny_llama(), tiny_tokenizer)
        assert model_family(other, tiny_tokenizer) == ref["family"] and same_model(ref, model_identity(other, tiny_tokenizer))
    assert not same_model(ref, model_identity(make_tiny_llama(seed=1), tiny_tokenizer))  # another initialisation
    tuned = make_tiny_llama()
    with torch.no_grad():
        for p in tuned.parameters():
            p.mul_(1 + 0.01 * torch.randn_like(p))  # a fine-tune's worth of change: another model
    assert not same_model(ref, model_identity(tuned, tiny_tokenizer))
    assert model_family(make_tiny_llama(layers=2), tiny_tokenizer) != ref["family"]
    assert not same_model(None, ref) and not same_model({**ref, "weights": ref["weights"][:-1]}, ref)


def test_the_identity_is_not_part_of_the_profile_id():
    kv = KVCache(torch.randn(2, 2, 64, 8), torch.randn(2, 2, 64, 8))
    plain = Profile.fit(CodecConfig(), [kv], chunk_tokens=32, model_fingerprint="f" * 32)
    named = Profile.fit(CodecConfig(), [kv], chunk_tokens=32, model_fingerprint="f" * 32, identity={"family": "x", "weights": [1.0]})
    assert named.id == plain.id and Profile.from_bytes(named.to_bytes()).meta[IDENTITY_KEY]["family"] == "x"


def test_a_profile_serves_its_model_in_another_dtype(fitted, tiny_tokenizer, caplog):
    fitted.save(default_profile_path(fitted.model_fingerprint, CodecConfig()))
    assert engine(make_tiny_llama(), tiny_tokenizer).codec.profile_id == fitted.id  # its own fingerprint
    for dtype in (torch.bfloat16, torch.float16):
        with caplog.at_level(logging.INFO, logger="cachegen_core.engine"):
            e = engine(make_tiny_llama(dtype=dtype), tiny_tokenizer, auto_profile=True)
        assert e.codec.profile_id == fitted.id and e.profile_fitter is None
        assert e.codec.profile.origin == "the user cache, fitted on the model in torch.float32"
        assert not any("no codec profile" in r.getMessage() for r in caplog.records)
    for other in (make_tiny_llama(seed=1), make_tiny_llama(seed=1, dtype=torch.bfloat16)):  # same family, other weights
        assert engine(other, tiny_tokenizer).codec.profile is None
    unnamed = Profile(fitted.classes, {k: v for k, v in fitted.meta.items() if k != IDENTITY_KEY}, fitted.stored, fitted.rotary)
    unnamed.save(default_profile_path(fitted.model_fingerprint, CodecConfig()))  # a profile fitted before identities
    assert engine(make_tiny_llama(dtype=torch.bfloat16), tiny_tokenizer).codec.profile is None


def test_kv_of_another_dtype_is_never_served(fitted, tiny_tokenizer):
    """One profile, one store, two dtypes: each engine's chunks are its own (keys bind the fingerprint, dtype included),
    and each answers as its own model does without a cache."""
    fitted.save(default_profile_path(fitted.model_fingerprint, CodecConfig()))
    store = MemoryStore()
    f32, b16 = make_tiny_llama(), make_tiny_llama(dtype=torch.bfloat16)
    e32 = engine(f32, tiny_tokenizer, store, level="lossless", store_options=["lossless", 1])
    e16 = engine(b16, tiny_tokenizer, store, level="lossless", store_options=["lossless", 1])
    assert e32.codec.profile_id == e16.codec.profile_id == fitted.id
    prompt = words(21, 3 * CHUNK + 5)
    assert e32.chunks(prompt)[0].key != e16.chunks(prompt)[0].key
    assert e32.generate(prompt, max_new_tokens=4)[1].chunks_queued == 3 and len(store) == 9  # 3 manifests, 6 blobs
    text, info = e16.generate(prompt, max_new_tokens=4)  # the float32 chunks are there: not this model's
    assert info.cached_tokens == 0 and info.chunks_queued == 3 and text == plain_greedy(b16, tiny_tokenizer, prompt, 4)
    text, info = e16.generate(prompt, max_new_tokens=4)
    assert info.cached_tokens == 3 * CHUNK and text == plain_greedy(b16, tiny_tokenizer, prompt, 4)  # its own, lossless
    e1 = engine(b16, tiny_tokenizer, store, level=1, store_options=[1])  # streams level 1 alone
    _, info = e1.generate(prompt, max_new_tokens=4)
    assert info.cached_tokens == 3 * CHUNK and info.levels == [1, 1, 1] and not info.errors  # its level, coded with the profile


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_shipped_profile_serves_the_reference_model_in_16_bits(dtype, caplog):
    from cachegen_core import models

    shipped = Profile.load(next(SHIPPED.glob("*.safetensors")))
    with caplog.at_level(logging.WARNING, logger="cachegen_core.engine"):
        eng = KVEngine.from_pretrained(models.REFERENCE_MODEL, store=MemoryStore(), background=False, dtype=dtype)
    assert eng.model.dtype == getattr(torch, dtype) and eng.fingerprint != shipped.model_fingerprint
    assert eng.codec.profile_id == shipped.id and eng.profile_fitter is None
    assert eng.codec.profile.origin == "shipped with the package, fitted on the model in torch.float32"
    assert not any("no codec profile" in r.getMessage() for r in caplog.records)
