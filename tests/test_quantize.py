import torch
from hypothesis import given, settings, strategies as st

from cachegen_core.config import CodecConfig
from cachegen_core.quantize import anchor_mask, dequantize, layer_groups, quantize


def _check_bound(x, group, **modes):
    q = quantize(x, group, torch.linspace(0.5, 3.0, x.shape[0]), **modes)
    y = dequantize(q, group, x.shape[1])
    mask = anchor_mask(x.shape[1], group)
    # Half a step, plus a few float32 ulps of the value itself (the arithmetic's resolution).
    err = (x - y).abs() - 4 * x.abs() * 2.0**-23
    assert (err[:, mask] <= q.anchor_step[:, None] / 2).all()
    assert (err[:, ~mask] <= q.delta_step[:, None] / 2).all()
    return q


def test_error_within_half_step_on_wild_scales():
    torch.manual_seed(0)
    x = torch.randn(3, 57, 16) * torch.logspace(-3, 3, 16)
    x[:, 5, 3] += 1000  # an outlier delta must not be clipped
    x[:, 0, 7] -= 500  # an outlier anchor
    q = _check_bound(x, 10)
    assert q.deltas.min() >= 1 and q.anchors.max() <= 255


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 4),
    tokens=st.integers(1, 45),
    channels=st.integers(1, 9),
    group=st.integers(1, 12),
    scale=st.floats(1e-4, 1e4),
    seed=st.integers(0, 1000),
    anchor_mode=st.sampled_from(["8bit", "level"]),
    delta_scale=st.sampled_from(["layer", "channel"]),
)
def test_error_bound_property(layers, tokens, channels, group, scale, seed, anchor_mode, delta_scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, tokens, channels, generator=g) * scale * torch.logspace(-2, 2, channels)
    q = _check_bound(x, group, anchor_mode=anchor_mode, delta_scale=delta_scale)
    assert q.deltas.numel() == 0 or q.deltas.min() >= 1


def test_constant_channel_is_exact():
    x = torch.full((2, 23, 3), 1.5)
    q = quantize(x, 10, torch.ones(2))
    assert torch.equal(dequantize(q, 10, 23), x)


def test_layer_groups_and_levels_order():
    assert layer_groups(30).tolist() == [0] * 10 + [1] * 10 + [2] * 10
    cfg = CodecConfig()
    for lvl in range(cfg.n_levels):
        s = cfg.delta_steps(lvl, 30, 0)
        assert s[0] <= s[15] <= s[29]  # early layers finest
        if lvl:
            assert (s > cfg.delta_steps(lvl - 1, 30, 0)).all()  # higher level = coarser
