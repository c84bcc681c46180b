"""A transform matrix across a layer's heads (``CodecConfig.group_channels``): the components keep the
channels' layout, so grouping is invisible outside ``transform.py``, ``kvstats.py`` and the profile."""

import pytest
import torch

from cachegen_core.codec.config import CodecConfig
from cachegen_core.codec.kvstats import KVStats
from cachegen_core.codec.pipeline import components, dequantise, magnitude_bound, quantise, synthesise
from cachegen_core.codec.profile import Profile
from cachegen_core.codec.transform import fit_transform, group_heads
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.kv import KVCache


@pytest.mark.parametrize(("heads", "dim", "want"), [(3, 64, 3), (8, 128, 2), (32, 128, 2), (2, 64, 2), (5, 64, 1), (4, 512, 1), (1, 64, 1)])
def test_head_group_is_the_largest_divisor_that_fits(heads, dim, want):
    assert CodecConfig().head_group(heads, dim) == want
    assert CodecConfig(group_channels=64).head_group(heads, dim) == 1


def _random_transform(layers: int, heads: int, dim: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = group * dim
    a = torch.randn(2, layers, heads // group, n, n, generator=g, dtype=torch.float64)
    cov = a @ a.transpose(-1, -2) + torch.eye(n, dtype=torch.float64)
    return fit_transform(cov, cov.inverse(), 0.1, group=group)


def test_grouped_analysis_is_one_matrix_over_the_groups_heads_side_by_side():
    L, H, T, D, grp = 2, 4, 5, 3, 2
    tf = _random_transform(L, H, D, grp)
    assert tf.group == grp and tf.shape == (L, H, D) and tf.analysis.shape == (2, L, H // grp, grp * D, grp * D)
    x = torch.randn(L, H, T, D)
    got = tf.analyse(x, 1)
    for lay in range(L):
        for g in range(H // grp):
            heads = x[lay, g * grp : (g + 1) * grp]  # (grp, T, D)
            side = torch.cat(list(heads), dim=-1)  # (T, grp * D): head-major channels
            want = side @ tf.analysis[1, lay, g].T
            assert torch.allclose(torch.cat(list(got[lay, g * grp : (g + 1) * grp]), dim=-1), want, atol=1e-5)
    side_by_side = group_heads(x, grp)  # what the statistics are summed over: the same order as the matrices read
    assert torch.equal(side_by_side[1, 1, 4], torch.cat([x[1, 2, 4], x[1, 3, 4]]))
    assert torch.allclose(tf.synthesise(got, 1), x, atol=1e-4)


def test_grouped_synthesis_into_a_strided_slice_equals_a_fresh_tensor():
    L, H, D, grp = 2, 4, 8, 4  # one group of four heads per layer
    tf = _random_transform(L, H, D, grp, seed=1)
    c = torch.randn(L, H, 6, D)
    buf = torch.zeros(L, H, 10, D)
    out = tf.synthesise(c, 0, out=buf[:, :, 3:9])
    assert torch.equal(out, tf.synthesise(c, 0)) and torch.equal(buf[:, :, 3:9], out)
    assert (buf[:, :, :3] == 0).all() and (buf[:, :, 9:] == 0).all()
    odd = torch.zeros(H, L, 6, D).transpose(0, 1)  # (layer, group) strides that do not merge: through a temporary
    assert torch.equal(tf.synthesise(c, 0, out=odd), out) and torch.equal(odd, out)
    two = _random_transform(L, H, D, 2, seed=2)  # two groups of two heads per layer
    assert torch.equal(two.synthesise(c, 1, out=buf[:, :, 2:8]), two.synthesise(c, 1))
    assert torch.allclose(two.analyse(two.synthesise(c, 1), 1), c, atol=1e-4)


def test_grouped_statistics_hold_the_per_head_ones_on_their_diagonal_blocks():
    torch.manual_seed(2)
    kv = KVCache(torch.randn(2, 4, 40, 8), torch.randn(2, 4, 40, 8))
    per_head, grouped = KVStats.empty(2, 4, 8), KVStats.empty(2, 4, 8, group=2)
    for s in (per_head, grouped):
        s.add_covariance(kv, rotary=None, chunk_tokens=16, sink_tokens=1)
    cov = grouped.covariance
    assert cov.shape == (2, 2, 2, 16, 16)
    for h in range(4):
        g, j = divmod(h, 2)
        assert torch.allclose(cov[:, :, g, j * 8 : (j + 1) * 8, j * 8 : (j + 1) * 8], per_head.covariance[:, :, h], atol=1e-12)
    assert cov[:, :, :, :8, 8:].abs().max() > 0  # across heads: what a per-head transform cannot see
    with pytest.raises(ValueError, match="does not divide"):
        KVStats.empty(2, 3, 8, group=2)


def test_grouped_transform_round_trips_through_the_codec_and_its_bound_holds():
    torch.manual_seed(3)
    L, H, T, D = 2, 2, 48, 8
    src = torch.randn(L, T, 8) @ torch.randn(8, 16)  # both heads project one 8-dim source, as a layer's heads share its hidden state
    keys = src.reshape(L, T, H, D).transpose(1, 2).contiguous()
    kv = KVCache(keys, keys.flip(-1).contiguous() * 0.5)
    cfg = CodecConfig()
    comps = {}
    for group in (1, cfg.head_group(H, D)):
        stats = KVStats.empty(L, H, D, group=group)
        stats.add_covariance(kv, rotary=None, chunk_tokens=T, sink_tokens=1)
        tf = fit_transform(stats.covariance, None, group=group)
        comps[group] = comp = components(kv, tf, start=0, sink_tokens=1, rotary=None)
        coded = quantise(comp, cfg.level_step(1), fitted=True, step_cap=0.0)
        keys_out, values_out = synthesise(dequantise(coded), coded.mean, coded.exact, tf, start=0, encoded_start=0, rotary=None)
        assert (keys_out - kv.keys).abs().max() < 0.1 * kv.keys.abs().max()
        bound = magnitude_bound(tf, coded.mean, coded.step, coded.exact, None)
        assert max(keys_out.abs().max().item(), values_out.abs().max().item()) <= bound
    var = {g: c.values.square().mean(dim=3) for g, c in comps.items()}  # (2, L, H, D)
    assert var[2].amax() > 1 and (var[2][:, :, 1] < 1e-6 * var[2].amax()).all()  # across both heads: the second head's slots carry nothing
    assert (var[1][:, :, :, 0] > 1e-2).all()  # one head at a time: both heads carry the source


def test_a_profile_whose_transform_groups_other_heads_than_its_config_is_refused(tiny_llama):
    cfg = CodecConfig()
    kv = KVCache(torch.randn(3, 2, 64, 16), torch.randn(3, 2, 64, 16))
    stats = KVStats.empty(3, 2, 16)  # one head per matrix, while the config groups two
    stats.add_covariance(kv, rotary=None, chunk_tokens=64, sink_tokens=1)
    with pytest.raises(ValueError, match="heads per matrix"):
        Profile.fit(cfg, [kv], transform=fit_transform(stats.covariance))
    prof = Profile.fit(CodecConfig(group_channels=16), [kv], transform=fit_transform(stats.covariance))
    assert prof.meta["head_group"] == 1
    good = Profile.fit(cfg, [kv], transform=fit_transform(KVStats.empty(3, 2, 16, group=2).covariance + torch.eye(32, dtype=torch.float64), group=2))
    assert Profile.from_bytes(good.to_bytes()).transform.group == 2
    import json

    from safetensors.numpy import save

    meta = dict(good.meta, head_group=1)  # a file whose metadata disagrees with its matrices' shape
    data = save({"classes": good.classes, **good.stored}, metadata={"cachegen_profile": json.dumps(meta)})
    with pytest.raises(CacheGenFormatError, match="transform"):
        Profile.from_bytes(data)


def test_fitting_and_loading_a_wide_group_do_not_hang_after_set_num_threads():
    """torch 2.13's MKL hangs in batched LU of 192 x 192 (and wider) float64 matrices after
    ``torch.set_num_threads(2)``, as an engine's host may call it: the transform's algebra runs in numpy."""
    import subprocess
    import sys

    code = """
import torch
torch.set_num_threads(2)
from cachegen_core.codec.transform import fit_transform, from_stored, to_stored
a = torch.randn(2, 1, 1, 256, 256, dtype=torch.float64)
cov = a @ a.transpose(-1, -2) + torch.eye(256, dtype=torch.float64)
tf = from_stored(**to_stored(fit_transform(cov, cov, 1.0, group=2)))
err = (tf.analysis.double() @ tf.synthesis.double() - torch.eye(256, dtype=torch.float64)).abs().max().item()
print(tf.group, tf.shape, err < 1e-4)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["2", "(1,", "2,", "128)", "True"]
    assert "MKL ERROR" not in out.stderr


def test_the_magnitude_bound_uses_the_cached_abs_matrices_and_matches_float64():
    """The bound's products run in float32 on ``|B|`` made once per transform (a float64 copy per chunk cost a 7B
    model's GPU decode 20 ms): within 2e-5 of the float64 formula, and above every value the synthesis returns."""
    torch.manual_seed(4)
    L, H, T, D = 2, 4, 40, 8
    tf = _random_transform(L, H, D, 2, seed=5)
    assert tf.synthesis_magnitude is tf.synthesis_magnitude and torch.equal(tf.synthesis_magnitude, tf.synthesis.abs())
    assert tf.matrices("synthesis", 1, torch.device("cpu")).data_ptr() == tf.synthesis[1].data_ptr()  # no copy on the CPU
    kv = KVCache(torch.randn(L, H, T, D) * 3, torch.randn(L, H, T, D))
    comp = components(kv, tf, start=0, sink_tokens=1, rotary=None)
    coded = quantise(comp, 0.2, fitted=True, step_cap=0.0)
    got = magnitude_bound(tf, coded.mean, coded.step, coded.exact, None)
    grouped = tf.synthesis.shape[:4]
    body = coded.mean.double().abs().reshape(grouped) + 128 * (tf.synthesis.double().abs() @ coded.step.double().reshape(grouped)[..., None])[..., 0]
    want = max(body.amax().item(), coded.exact.double().abs().amax().item())
    assert abs(got - want) <= 2e-5 * want
    keys, values = synthesise(dequantise(coded), coded.mean, coded.exact, tf, start=0, encoded_start=0, rotary=None)
    assert max(keys.abs().max().item(), values.abs().max().item()) <= got


def test_the_magnitude_bound_of_the_identity_skips_the_products_and_equals_them():
    """Without a profile (the identity) ``|I| step`` is ``step``: the same bound, bit for bit, without the products
    over a 7B model's eye matrices (3-7 ms a chunk on 2 cores)."""
    from cachegen_core.codec.transform import Transform, identity_transform

    torch.manual_seed(6)
    eye = identity_transform(3, 4, 16)
    through_products = Transform(eye.analysis, eye.synthesis, eye.spread)  # the same matrices, not marked identity
    mean, step, exact = torch.randn(2, 3, 4, 16), torch.rand(2, 3, 4, 16) + 0.01, torch.randn(2, 3, 4, 2, 16)
    # exact on any CPU: the products are by 1 and 0 and the sums add zeros, so no operation rounds (FMA or not)
    assert magnitude_bound(eye, mean, step, exact, None) == magnitude_bound(through_products, mean, step, exact, None)
