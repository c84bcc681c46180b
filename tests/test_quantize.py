import pytest
import torch
from hypothesis import given, settings, strategies as st

from cachegen_core.codec.config import CodecConfig
from cachegen_core.codec.quantize import RADIUS, bf16_round, dequantize, quantize, steps


def _check_bound(c, base, cap=0.0):
    step = steps(c, base, cap)
    s = quantize(c, step)
    y = dequantize(s, step)
    # Half a step, plus a few float32 ulps of the value itself (the arithmetic's resolution).
    err = (c - y).abs() - 4 * c.abs() * 2.0**-23
    assert (err <= step[:, :, None, :] / 2).all()
    assert s.numel() == 0 or (s.min() >= 128 - RADIUS and s.max() <= 128 + RADIUS)
    assert torch.equal(step, step.to(torch.bfloat16).float())  # what the blob stores is what was used
    return step, s


def test_error_within_half_step_on_wild_scales():
    torch.manual_seed(0)
    c = torch.randn(3, 2, 57, 16) * torch.logspace(-3, 3, 16)
    c[:, :, 5, 3] += 1000  # an outlier must not be clipped
    c[:, :, 0, 7] -= 500
    step, _ = _check_bound(c, torch.tensor(0.3))
    assert (step[:, :, 3] >= 1000 / RADIUS).all()


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 4),
    heads=st.integers(1, 3),
    tokens=st.integers(0, 45),
    dim=st.integers(1, 9),
    base=st.floats(1e-4, 1e2),
    cap=st.sampled_from([0.0, 0.5, 2.0]),
    scale=st.floats(1e-4, 1e4),
    seed=st.integers(0, 1000),
)
def test_error_bound_property(layers, heads, tokens, dim, base, cap, scale, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(layers, heads, tokens, dim, generator=g) * scale * torch.logspace(-2, 2, dim)
    _check_bound(c, torch.tensor(base), cap)


def test_cap_bounds_the_step_by_the_component_rms():
    torch.manual_seed(1)
    c = torch.randn(2, 1, 500, 4) * torch.tensor([1.0, 0.1, 0.01, 0.001])
    step = steps(c, torch.tensor(10.0), cap=1.5)
    rms = c.square().mean(2).sqrt()
    assert (step <= 1.5 * rms * 1.01).all()  # bfloat16 rounding up, within 1 %
    assert (steps(c, torch.tensor(10.0), cap=0.0) == 10.0).all()  # no cap: the level's step


def test_zero_component_is_exact():
    c = torch.zeros(2, 1, 23, 3)
    c[:, :, :, 1] = torch.linspace(-1, 1, 23)
    step, s = _check_bound(c, torch.tensor(1.0))
    assert torch.equal(dequantize(s, step)[..., 0], c[..., 0]) and (s[..., 0] == 128).all()


def test_bf16_rounding_is_directed():
    x = torch.tensor([1.0001, -1.0001, 3.14159, 1e-20])
    assert (bf16_round(x, +1.0) >= x).all() and (bf16_round(x, -1.0) <= x).all()


def test_levels_get_coarser():
    cfg = CodecConfig()
    assert [cfg.level_step(lv) for lv in range(cfg.n_levels)] == sorted(cfg.levels)
    assert 0 <= cfg.default_level < cfg.n_levels
    unprofiled = [cfg.level_step(lv, fitted=False) for lv in range(cfg.n_levels)]
    assert unprofiled == sorted(unprofiled) and unprofiled[0] == cfg.levels[0]  # level 0 stays near-lossless
    assert unprofiled[1:] == [s * cfg.unprofiled_scale for s in cfg.levels[1:]]
    weighted = [cfg.level_step(lv, fitted=False, weighted=True) for lv in range(cfg.n_levels)]
    assert weighted[0] == cfg.levels[0] and weighted[1:] == [s * cfg.weighted_scale for s in cfg.levels[1:]]
    assert cfg.level_step(1, weighted=True) == cfg.levels[1]  # a profile's steps are never scaled
    # Without a profile the default level keeps the steps its quality was measured at (docs/results.md, "Without a
    # profile"), set when level 1 (step 0.085) was the default, scaled 2.356x plain and 3.176x weighted.
    assert cfg.level_step(cfg.default_level, fitted=False) == pytest.approx(0.085 * 2.356, rel=1e-12)
    assert cfg.level_step(cfg.default_level, fitted=False, weighted=True) == pytest.approx(0.085 * 3.176, rel=1e-12)
    for bad in (dict(unprofiled_scale=0.0), dict(weighted_scale=-1.0), dict(weighted_scale=float("inf"))):
        with pytest.raises(ValueError, match="unprofiled_scale and weighted_scale"):
            CodecConfig(**bad)
    assert CodecConfig(weighted_scale=3.0).codec_id != cfg.codec_id  # part of the codec id
