"""Step weights: coding without a profile with steps set by the model's measured sensitivity."""

from __future__ import annotations

import logging

import pytest
import torch

from cachegen_core.codec.config import CodecConfig
from cachegen_core.codec import fitting
from cachegen_core.codec.fitting import fit_weights
from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.codec.profile import Profile
from cachegen_core.codec.rotary import RotarySpec
from cachegen_core.codec.weights import SPREAD, check_weights, step_weights
from cachegen_core.engine import KVEngine
from cachegen_core.kv import KVShapeError
from cachegen_core.stores import MemoryStore
from cachegen_core.testing import words


@pytest.fixture(autouse=True)
def isolated_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))


def test_weights_follow_the_inverse_square_root_of_the_fisher():
    g = torch.Generator().manual_seed(0)
    fisher = torch.exp(torch.randn(2, 3, 2, 8, generator=g))
    var = torch.exp(torch.randn(2, 3, 2, 8, generator=g))
    w = step_weights(fisher, var, eps=0.0)
    assert w.shape == (2, 3, 2, 8) and w.dtype == torch.float32
    assert abs(w.double().log().mean().item()) < 1e-6  # geometric mean 1
    # within a layer (one RMS), a component four times as sensitive gets half the step
    f = torch.ones(2, 3, 2, 8)
    f[0, 1, 0, 3] = 4.0
    w = step_weights(f, torch.ones(2, 3, 2, 8), eps=0.0)
    assert w[0, 1, 0, 3].item() == pytest.approx(w[0, 1, 0, 4].item() / 2, rel=1e-6)
    # divided by the layer's RMS the statistics saw: the codec multiplies by the chunk's
    v = torch.ones(2, 3, 2, 8)
    v[1, 2] = 16.0
    w = step_weights(torch.ones(2, 3, 2, 8), v, eps=0.0)
    assert w[1, 2, 0, 0].item() == pytest.approx(w[1, 1, 0, 0].item() / 4, rel=1e-6)


def test_weights_stay_within_their_spread_and_reject_bad_statistics():
    f = torch.ones(2, 2, 1, 4)
    f[0, 0, 0, 0], f[1, 1, 0, 2] = 1e-12, 1e12  # one short draw's outliers
    w = step_weights(f, torch.ones(2, 2, 1, 4), eps=0.0)
    assert w.max().item() <= SPREAD and w.min().item() >= 1 / SPREAD
    for bad in (torch.full((2, 2, 1, 4), float("nan")), -torch.ones(2, 2, 1, 4)):
        with pytest.raises(ValueError, match="finite and non-negative"):
            step_weights(bad, torch.ones(2, 2, 1, 4))
    with pytest.raises(ValueError, match=r"\(2, layers, heads, dim\)"):
        step_weights(torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 4))
    for bad in (torch.zeros(2, 1, 1, 4), torch.full((2, 1, 1, 4), float("inf")), torch.ones(1, 4)):
        with pytest.raises(ValueError, match="step weights"):
            check_weights(bad)


def test_a_weighted_blob_decodes_with_any_codec_without_a_profile(tiny_kv, tiny_llama):
    rot = RotarySpec.from_model(tiny_llama)
    w = torch.ones(2, tiny_kv.num_layers, tiny_kv.num_kv_heads, tiny_kv.head_dim)
    w[0, 1] = 1 / 8  # layer 1's keys: eight times finer steps
    plain, weighted = KVCodec(rotary=rot), KVCodec(rotary=rot, weights=w)
    kv = tiny_kv.slice(0, 100)
    for level in (1, 2):
        blob = weighted.encode(kv, level, start=0)
        assert plain.decode(blob).keys.equal(weighted.decode(blob).keys)  # steps travel in the blob: nothing else to know
        err_plain = (plain.decode(plain.encode(kv, level, start=0)).keys[1] - kv.keys[1]).abs().max()
        err_weighted = (weighted.decode(blob).keys[1] - kv.keys[1]).abs().max()
        assert err_weighted < err_plain / 2
        assert weighted.codec_id == plain.codec_id  # not part of what a key or a blob binds
    with pytest.raises(KVShapeError, match="step weights"):
        KVCodec(weights=w[:, :2]).encode(kv, 1, start=0)


def test_weights_leave_a_profiled_codec_alone(tiny_kv):
    config = CodecConfig()
    profile = Profile.fit(config, [tiny_kv], chunk_tokens=64)
    w = torch.full((2, tiny_kv.num_layers, tiny_kv.num_kv_heads, tiny_kv.head_dim), 0.25)
    assert KVCodec(config, profile, weights=w).encode(tiny_kv, 1, start=0) == KVCodec(config, profile).encode(tiny_kv, 1, start=0)


def test_fit_weights_measures_the_model(tiny_llama, tiny_tokenizer):
    rot = RotarySpec.from_model(tiny_llama)
    text = words(5, 400)
    w = fit_weights(tiny_llama, tiny_tokenizer, text, rotary=rot, context=128, continuation=32)
    assert w.shape == (2, tiny_llama.config.num_hidden_layers, tiny_llama.config.num_key_value_heads, w.shape[3])
    assert (w > 0).all() and torch.isfinite(w).all() and not torch.equal(w, torch.ones_like(w))
    assert torch.equal(w, fit_weights(tiny_llama, tiny_tokenizer, text, rotary=rot, context=128, continuation=32))  # seeded
    with pytest.raises(ValueError, match="at least"):
        fit_weights(tiny_llama, tiny_tokenizer, words(5, 20), rotary=rot, context=128, continuation=32)
    with pytest.raises(ValueError, match="repeated"):  # words it does not know: all one token, the KV only rounding noise
        fit_weights(tiny_llama, tiny_tokenizer, "the calibration text " * 100, rotary=rot, context=128, continuation=32)


def test_an_engine_without_a_profile_codes_with_weights_measured_at_load(tiny_llama, tiny_tokenizer, caplog, monkeypatch):
    monkeypatch.setattr(fitting, "calibration_texts", lambda: [words(7, 700)])  # the tiny tokenizer knows these words only
    with caplog.at_level(logging.WARNING, logger="cachegen_core.engine"):
        eng = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, store=MemoryStore(), background=False, chunk_tokens=64)
    try:
        assert eng.codec.profile is None and eng.codec.step_weights is not None
        assert any("weighted by the model's measured sensitivity" in r.getMessage() for r in caplog.records)
        eng.profile_fitter.stop()
        text, _ = eng.generate(words(3, 200), max_new_tokens=2)
        again, info = eng.generate(words(3, 200), max_new_tokens=2)
        assert info.cached_tokens > 0 and again == text
    finally:
        eng.close()
    quiet = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, store=MemoryStore(), auto_profile=False)
    assert quiet.codec.step_weights is None  # CACHEGEN_AUTO_PROFILE=0: plain steps, nothing measured
    quiet.close()


def test_a_sensitivity_that_cannot_be_measured_leaves_plain_steps(tiny_llama, tiny_tokenizer, caplog):
    """The calibration text is all unknown words to the tiny tokenizer: every token the same, no variance to weigh by."""
    with caplog.at_level(logging.WARNING, logger="cachegen_core.engine"):
        eng = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, store=MemoryStore(), background=False, chunk_tokens=64)
    try:
        assert eng.codec.step_weights is None
        assert any("could not measure the sensitivity" in r.getMessage() and "plain steps" in r.getMessage() for r in caplog.records)
        eng.profile_fitter.stop()
        eng.generate(words(3, 200), max_new_tokens=2)
        assert eng.generate(words(3, 200), max_new_tokens=2)[1].cached_tokens > 0
    finally:
        eng.close()
    with pytest.raises(ValueError, match="no sensitivity"):
        step_weights(torch.ones(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))
    w = step_weights(torch.ones(2, 2, 1, 4), torch.cat([torch.zeros(2, 1, 1, 4), torch.ones(2, 1, 1, 4)], 1))
    assert torch.equal(w[:, 0], torch.ones(2, 1, 4))  # a layer with no variance: weight 1
