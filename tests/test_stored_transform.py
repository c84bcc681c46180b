"""A profile's transform as stored (format v5): synthesis columns in 3-8 bits by their component's spread."""

import numpy as np
import pytest
import torch

from cachegen_core.codec.transform import COLUMN_BITS, MEDIAN_COLUMN_BITS, column_widths, fit_transform, from_stored, to_stored


def _transform(n=24, group=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, 3, 1, n, n, generator=g, dtype=torch.float64) * torch.logspace(0, -3, n, dtype=torch.float64)
    cov = a @ a.transpose(-1, -2) + 1e-6 * torch.eye(n, dtype=torch.float64)
    return fit_transform(cov, group=group)


def test_widths_follow_the_spread_one_bit_per_doubling_within_range():
    spread = np.array([[[[8.0, 4.0, 2.0, 1.0, 0.5, 1e-9, 1000.0]]]])  # median 2: 6 bits
    w = column_widths(spread)
    assert w.dtype == np.uint8 and w.tolist() == [[[[8, 7, 6, 5, 4, COLUMN_BITS[0], COLUMN_BITS[1]]]]]
    assert column_widths(np.ones((1, 1, 1, 5))).tolist() == [[[[MEDIAN_COLUMN_BITS] * 5]]]


def test_stored_round_trip_is_within_half_a_step_per_column_and_deterministic():
    tf = _transform()
    stored = to_stored(tf)
    assert set(stored) == {"synthesis", "widths", "column_scale", "spread"}
    w = stored["widths"].astype(np.int64)
    assert stored["synthesis"].dtype == np.uint8 and stored["synthesis"].size == (int(w.sum()) * w.shape[-1] + 7) // 8
    back = from_stored(**stored)
    again = from_stored(**{k: v.copy() for k, v in stored.items()})
    assert torch.equal(back.synthesis, again.synthesis) and torch.equal(back.analysis, again.analysis)
    m = torch.from_numpy((1 << w) // 2 - 1).double()[..., None, :]
    half_step = torch.from_numpy(stored["column_scale"]).double()[..., None, :] / (2 * m)
    assert ((back.synthesis.double() - tf.synthesis.double()).abs() <= half_step * (1 + 1e-6)).all()
    eye = torch.eye(24, dtype=torch.float64)
    assert ((back.analysis.double() @ back.synthesis.double()) - eye).abs().max() < 1e-4  # A is the stored B's inverse
    assert np.array_equal(to_stored(back)["widths"], stored["widths"])  # storing the stored form again keeps its widths


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda s: s.update(widths=np.full_like(s["widths"], 9)), "widths must be in \\[2, 8\\]"),
        (lambda s: s.update(widths=np.full_like(s["widths"], 1)), "widths must be in \\[2, 8\\]"),
        (lambda s: s.update(column_scale=-s["column_scale"]), "column scales finite and positive"),
        (lambda s: s.update(column_scale=s["column_scale"][..., :-1]), "must be \\(2, layers, groups, n\\)"),
        (lambda s: s.update(synthesis=s["synthesis"][:-1]), "packed data must be"),
        (lambda s: s.update(synthesis=np.full_like(s["synthesis"], 255)), "out of its column's range"),
        (lambda s: s.update(synthesis=np.zeros_like(s["synthesis"])), "not invertible"),
    ],
)
def test_a_damaged_stored_transform_is_refused(damage, match):
    stored = to_stored(_transform())
    damage(stored)
    with pytest.raises(ValueError, match=match):
        from_stored(**stored)
