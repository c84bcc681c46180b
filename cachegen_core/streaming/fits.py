"""Costs fitted from measurements: non-negative least squares in relative errors, the prefill's cost by position, and a
read's fixed cost.

A prefill of ``tokens`` tokens after ``position`` tokens already in the cache costs
``g + a * tokens + b * tokens * (position + tokens / 2)`` seconds: a per-call overhead ``g`` (kernel launches, a
pass's fixed work), the linear layers' ``a`` per token and attention's ``b`` per token and cached position (a token at
position ``p`` attends to ``p`` keys: summed over the chunk, ``tokens * (position + tokens / 2)``). A chunk late in a
long prompt costs more to recompute than the same chunk at its start (on an H200, a 7B model's 30K-token prompt took
1.25 s, five times its first quarter). Every fit is non-negative (no cost is negative: a plain fit of noisy points gave
the prefill a negative per-token term) and in relative errors (a 20 ms prefill counts as much as a 2 s one), as
``benchmarks.store_budget`` fits its costs.

A read of ``n`` bytes from a store costs ``fixed + n * per_byte`` seconds (:func:`fit_read_fixed`): every read pays a
lookup, a request, a check's setup whatever its size. Read as bandwidth, that fixed cost makes a small read look slow
(a level's blob, a partial chunk, a tiny model's chunk), and a raw form of four times its bytes look four times slower
to fetch than it is. Plain functions over plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def fit_nonnegative(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[list[float], float]:
    """Non-negative least squares of ``ys`` on the columns ``xs`` in relative terms (each point weighted by ``1 / y``);
    the coefficients and the mean relative error. Exact for the few columns a cost has: the best non-negative fit is
    the unconstrained fit on some subset of the columns, and every subset is tried."""
    a, y = np.array(xs, dtype=float), np.array(ys, dtype=float)
    w = 1 / np.maximum(np.abs(y), 1e-9)
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 1 << a.shape[1]):
        cols = [c for c in range(a.shape[1]) if mask >> c & 1]
        sub, *_ = np.linalg.lstsq(a[:, cols] * w[:, None], y * w, rcond=None)
        if (sub < 0).any():
            continue
        coef = np.zeros(a.shape[1])
        coef[cols] = sub
        res = float(np.sum(((a @ coef - y) * w) ** 2))
        if best is None or res < best[0] - 1e-12 * max(res, 1.0):  # a tie keeps the fewer columns found first
            best = (res, coef)
    coef = best[1] if best is not None else np.zeros(a.shape[1])
    err = float(np.mean(np.abs(a @ coef - y) * w))
    return [float(c) for c in coef], err


#: Reads whose sizes span less than this factor cannot tell a fixed cost from bandwidth: none is fitted to them.
READ_SPREAD = 2.0


def fit_read_fixed(reads: Sequence[tuple[int, float]], spread: float = READ_SPREAD) -> float:
    """The seconds every read costs whatever its bytes, fitted to measured ``(bytes, seconds)`` reads as
    ``seconds = fixed + bytes * per_byte`` (non-negative, relative errors): never more than the fastest read took (every
    read pays it), and 0 when the reads' sizes span less than ``spread`` (reads of one size are as well explained by a
    slower link as by a fixed cost: the bandwidth alone then, which predicts reads of that size right)."""
    pts = [(n, s) for n, s in reads if n > 0 and s > 0]
    if len(pts) < 2:
        return 0.0
    sizes = [n for n, _ in pts]
    if max(sizes) < spread * min(sizes):
        return 0.0
    scale = max(sizes)  # bytes in units of the largest read: both columns of order one
    (fixed, _), _ = fit_nonnegative([[1.0, n / scale] for n in sizes], [s for _, s in pts])
    return min(fixed, min(s for _, s in pts))


@dataclass(frozen=True)
class PrefillFit:
    """``seconds(tokens, position) = g + a * tokens + b * tokens * (position + tokens / 2)``."""

    a: float
    b: float = 0.0
    g: float = 0.0

    def seconds(self, tokens: int, position: int = 0, *, overhead: bool = True) -> float:
        """Seconds to prefill ``tokens`` tokens after ``position`` cached ones; ``overhead=False``: without the per-call
        ``g`` (a chunk prefilled in one pass with others, or with the rest of the prompt)."""
        return (self.g if overhead else 0.0) + tokens * (self.a + self.b * (position + tokens / 2))


def _columns(tokens: int, position: int) -> list[float]:
    return [1.0, float(tokens), tokens * (position + tokens / 2)]


def _rank(rows: np.ndarray) -> int:
    """The number of independent columns among ``rows``' (each column scaled to unit size, points in relative terms)."""
    if not len(rows):
        return 0
    scaled = rows / np.maximum(np.abs(rows).max(axis=0), 1e-300)
    s = np.linalg.svd(scaled, compute_uv=False)
    return int(np.sum(s > 1e-3 * s[0]))


def fit_prefill(points: Sequence[tuple[int, int, float]], prior: PrefillFit) -> PrefillFit:
    """The prefill's cost fitted to measured ``(tokens, position, seconds)`` points, as far as they determine it.

    Points of three independent shapes fit ``g``, ``a`` and ``b``; of two (say a cold prompt and the question after a
    cached one) ``a`` and ``b``; points of one shape only scale ``prior`` to them (its ratio of ``b`` to ``a`` kept).
    No point: ``prior``."""
    pts = [(t, p, s) for t, p, s in points if t > 0 and s > 0]
    if not pts:
        return prior
    rows = np.array([_columns(t, p) for t, p, _ in pts])
    ys = [s for *_, s in pts]
    if len(pts) >= 3 and _rank(rows) == 3:
        (g, a, b), _ = fit_nonnegative(rows, ys)
        if a > 0 or b > 0:
            return PrefillFit(a, b, g)
    if _rank(rows[:, 1:]) == 2:
        (a, b), _ = fit_nonnegative(rows[:, 1:], ys)
        if a > 0 or b > 0:
            return PrefillFit(a, b)
    shape = [prior.seconds(t, p, overhead=False) for t, p, _ in pts]
    (scale,), _ = fit_nonnegative([[x] for x in shape], ys)
    return PrefillFit(prior.a * scale, prior.b * scale) if scale > 0 else prior
