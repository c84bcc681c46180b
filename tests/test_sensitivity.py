"""Layer sensitivity: measured per (kind, layer), turned into step multipliers, folded into a profile's transform."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cachegen_core.codec.fitting import FitPlan, fit_profile
from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.codec.pipeline import components, dequantise, quantise
from cachegen_core.codec.rotary import RotarySpec
from cachegen_core.codec.sensitivity import SPREAD, coded_layers, layer_multipliers, layer_sensitivity
from cachegen_core.codec.transform import fit_transform, identity_transform, scale_layers
from cachegen_core.kv import KVCache
from cachegen_core.testing import make_tiny_tokenizer, words

PLAN = FitPlan(texts=2, tokens=300, contexts=(96,), continuation=32, chunk_tokens=128, sensitivity_tokens=32)


def _transform(layers: int = 3, n: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, layers, 1, n, n, generator=g, dtype=torch.float64)
    return fit_transform(a @ a.transpose(-1, -2) + n * torch.eye(n, dtype=torch.float64), group=2)


def test_scaled_layers_code_each_layer_that_many_times_coarser_and_rebuild_the_same_channels():
    t = _transform()
    m = torch.tensor([[1.0, 2.0, 0.5], [4.0, 1.0, 0.25]])
    s = scale_layers(t, m)
    x = torch.randn(3, 2, 50, 16, generator=torch.Generator().manual_seed(1))
    for kind in range(2):
        c, cs = t.analyse(x, kind), s.analyse(x, kind)
        assert torch.allclose(cs * m[kind][:, None, None, None], c, rtol=1e-4, atol=1e-5)  # components shrunk by m
        assert torch.allclose(s.synthesise(cs, kind), x, rtol=1e-4, atol=1e-4)  # the same channels back
    assert torch.allclose(s.spread * m[:, :, None, None], t.spread, rtol=1e-6)
    with pytest.raises(ValueError, match="multipliers"):
        scale_layers(t, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))


def test_multipliers_give_a_layer_four_times_as_sensitive_half_the_step():
    err = torch.ones(2, 3, dtype=torch.float64)
    kl = torch.tensor([[1.0, 4.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    m = layer_multipliers(kl, err)
    assert torch.allclose(m[0, 1] / m[0, 0], torch.tensor(0.5)) and torch.allclose(m.log().mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(layer_multipliers(kl, err, power=0.5)[0, 1] / layer_multipliers(kl, err, power=0.5)[0, 0], torch.tensor(0.5**0.5))
    extreme = layer_multipliers(torch.tensor([[1e-9, 1.0, 1e9], [1.0, 1.0, 1.0]], dtype=torch.float64), err)
    assert extreme.max() <= SPREAD and extreme.min() >= 1 / SPREAD
    unknown = layer_multipliers(torch.tensor([[0.0, 2.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64), err)
    assert unknown[0, 0] == 1.0  # nothing measured there: left alone
    assert torch.equal(layer_multipliers(torch.zeros(2, 3), err), torch.ones(2, 3))


def test_a_layer_coded_finely_costs_nothing_and_coarsely_costs_kl(tiny_llama, tiny_kv):
    spec = RotarySpec.from_model(tiny_llama)
    tok = make_tiny_tokenizer()
    cont = tok(words(5, 40))["input_ids"][:32]
    t = _transform(layers=tiny_kv.num_layers)
    fine_kl, fine_err = layer_sensitivity(tiny_llama, tiny_kv, cont, t, 1e-4, rotary=spec, sink_tokens=1, chunk_tokens=64)
    coarse_kl, coarse_err = layer_sensitivity(tiny_llama, tiny_kv, cont, t, 0.5, rotary=spec, sink_tokens=1, chunk_tokens=64)
    assert fine_kl.shape == coarse_kl.shape == (2, tiny_kv.num_layers)
    assert (coarse_err > 1000 * fine_err).all() and coarse_kl.sum() > 1000 * fine_kl.abs().sum()
    # the error is the chunks' whitened squared error at that step
    err = sum(
        (dequantise(quantise(c, 0.5, fitted=True)) - c.values).square().sum((2, 3, 4))
        for c in (components(tiny_kv.slice(s, s + 64), t, start=s, sink_tokens=1, rotary=spec) for s in range(0, tiny_kv.num_tokens, 64))
    )
    assert torch.allclose(coarse_err.float(), err, rtol=1e-3)


def test_without_a_profile_a_layer_coded_coarser_by_its_weight_costs_more_kl_at_the_same_whitened_error(tiny_llama, tiny_kv):
    spec = RotarySpec.from_model(tiny_llama)
    cont = make_tiny_tokenizer()(words(5, 40))["input_ids"][:32]
    eye = identity_transform(tiny_kv.num_layers, tiny_kv.num_kv_heads, tiny_kv.head_dim)
    w = torch.ones(2, tiny_kv.num_layers, tiny_kv.num_kv_heads, tiny_kv.head_dim)
    args = dict(rotary=spec, sink_tokens=1, chunk_tokens=64)
    kl1, err1 = layer_sensitivity(tiny_llama, tiny_kv, cont, eye, 0.1, weights=w, **args)
    w[1, 0] = 2.0  # layer 0's values: twice the step
    kl2, err2 = layer_sensitivity(tiny_llama, tiny_kv, cont, eye, 0.1, weights=w, **args)
    assert torch.allclose(err2, err1, rtol=0.1)  # in units of each component's own step: about the same
    assert kl2[1, 0] > 2 * kl1[1, 0] and torch.allclose(kl2[0], kl1[0])  # but the model pays several times more for it
    codec = KVCodec(rotary=spec, weights=w)  # what it measures is what the codec codes
    coded, _ = coded_layers(tiny_kv, eye, codec.config.level_step(1, fitted=False, weighted=True), weights=w, **args)
    decoded = KVCache.concat([codec.decode(codec.encode(tiny_kv.slice(s, s + 64), 1, start=s)) for s in range(0, tiny_kv.num_tokens, 64)])
    assert torch.allclose(coded.keys, decoded.keys.float(), atol=1e-5) and torch.allclose(coded.values, decoded.values.float(), atol=1e-5)


def test_a_fit_with_layer_power_scales_each_layer_of_the_same_transform(tiny_llama):
    spec = RotarySpec.from_model(tiny_llama)
    texts = [words(s, 400) for s in (11, 12)]
    tok = make_tiny_tokenizer()
    flat = fit_profile(tiny_llama, tok, texts, plan=PLAN, rotary=spec)
    scaled = fit_profile(tiny_llama, tok, texts, plan=dataclasses.replace(PLAN, layer_power=1.0), rotary=spec)
    ratio = scaled.transform.spread / flat.transform.spread  # stored in float16: a layer's ratio is one number
    per_layer = ratio.flatten(2)
    assert torch.allclose(per_layer, per_layer[..., :1].expand_as(per_layer), rtol=2e-3)
    assert not torch.allclose(per_layer[..., 0], torch.ones_like(per_layer[..., 0]), rtol=1e-2)  # it did scale
    assert scaled.codec_id == flat.codec_id and scaled.id != flat.id  # the same blobs and decoders; another profile
    assert scaled.meta["fitted_on"]["layer_power"] == 1.0 and "layer_power" not in flat.meta["fitted_on"]
    with pytest.raises(ValueError, match="layer_power"):
        FitPlan(layer_power=-1.0)
