"""Bandwidth estimators: what the controller believes the link delivers, from measured fetches.

A fetch of ``n`` bytes takes ``fixed + n / bandwidth`` seconds: a read's fixed cost (a lookup, a request, a check's
setup) is paid once per read whatever its size. With ``fixed_cost=True`` (the engine's on a store on this host, where a
read is fast enough for that cost to matter) an estimator fits it to the reads it measured (``fits.fit_read_fixed``:
non-negative least squares, once their sizes span 2x) and estimates the bandwidth from what each read took beyond it,
so small reads (a level's blob, a partial chunk, a tiny model's chunk) no longer make the link look slow and a raw form
of four times their bytes look four times slower to fetch than it is. Without it (a link whose rate changes from read
to read, where a small read at a slow moment would pass for a fixed cost) the fixed cost is 0: the bandwidth alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from .fits import fit_read_fixed

#: Bytes per second no estimate exceeds: reads whose time does not grow with their bytes (all of it fixed cost: a memory
#: store handing back an object it holds) are faster than anything measurable, not infinitely fast.
MAX_BANDWIDTH = 1e13


class Estimator(Protocol):
    """Bandwidth estimate (bytes/s) from measured chunk fetches; ``None`` before any. ``fixed_s``: the seconds every
    read costs on top of its bytes at that bandwidth (0 when not modelled; :func:`read_fixed_s` for any estimator)."""

    def update(self, nbytes: int, seconds: float) -> None: ...

    def estimate(self) -> float | None: ...

    def fixed_s(self) -> float: ...


def read_fixed_s(estimator: object) -> float:
    """``estimator.fixed_s()``; 0 for an estimator without one (bandwidth only)."""
    fixed = getattr(estimator, "fixed_s", None)
    return float(fixed()) if callable(fixed) else 0.0


class _Reads:
    """The last ``window`` reads, ``(bytes, seconds)``, and with ``fixed_cost`` the fixed seconds of a read fitted to
    them (refitted on first use after a read)."""

    def __init__(self, window: int, fixed_cost: bool) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.reads: deque[tuple[int, float]] = deque(maxlen=window)
        self.fixed_cost = fixed_cost
        self._added = 0  # reads added so far: the fit below is of the reads up to that count
        self._fit = (0, 0.0)

    def _add(self, nbytes: int, seconds: float) -> bool:
        if nbytes > 0 and seconds > 0:
            self.reads.append((nbytes, seconds))
            self._added += 1
            return True
        return False

    def fixed_s(self) -> float:
        """Seconds every read costs whatever its bytes (0 without ``fixed_cost``, or while the reads cannot tell)."""
        if not self.fixed_cost:
            return 0.0
        added, fixed = self._fit
        if added != self._added:  # a probe's fetch (another thread) may add a read meanwhile: the fit is of a copy
            added = self._added
            fixed = fit_read_fixed(tuple(self.reads))
            self._fit = (added, fixed)
        return fixed

    @staticmethod
    def _seconds_per_byte(nbytes: int, seconds: float, fixed: float) -> float:
        """What a read took per byte beyond the fixed cost (0: nothing left, a rate above anything measurable)."""
        return max(seconds - fixed, 0.0) / nbytes

    @staticmethod
    def _rate(seconds_per_byte: float) -> float:
        return min(1.0 / seconds_per_byte, MAX_BANDWIDTH) if seconds_per_byte > 0 else MAX_BANDWIDTH


class HarmonicMeanEstimator(_Reads):
    """Harmonic mean of the last ``window`` throughput samples (each read's bytes over its seconds less the fixed cost).

    Dominated by the slow samples, so one fast sample (a small blob served from a warm
    buffer) barely moves it, while a drop shows at once: the safe side for a deadline.
    ``samples``: each read's throughput, its fixed cost included, as measured.
    """

    def __init__(self, window: int = 20, *, fixed_cost: bool = False) -> None:
        super().__init__(window, fixed_cost)
        self.samples: deque[float] = deque(maxlen=window)

    def update(self, nbytes: int, seconds: float) -> None:
        if self._add(nbytes, seconds):
            self.samples.append(nbytes / seconds)

    def estimate(self) -> float | None:
        reads = tuple(self.reads)
        if not reads:
            return None
        fixed = self.fixed_s()
        return self._rate(sum(self._seconds_per_byte(n, s, fixed) for n, s in reads) / len(reads))


class LastSampleEstimator(_Reads):
    """The original paper's estimator: the throughput of the last fetch (its fixed cost taken off, with ``fixed_cost``:
    fitted to the last ``window`` reads)."""

    def __init__(self, window: int = 20, *, fixed_cost: bool = False) -> None:
        super().__init__(window, fixed_cost)  # the window only serves the fit

    @property
    def last(self) -> float | None:
        """The last read's throughput as measured, its fixed cost included."""
        return self.reads[-1][0] / self.reads[-1][1] if self.reads else None

    def update(self, nbytes: int, seconds: float) -> None:
        self._add(nbytes, seconds)

    def estimate(self) -> float | None:
        if not self.reads:
            return None
        return self._rate(self._seconds_per_byte(*self.reads[-1], self.fixed_s()))


ESTIMATORS: dict[str, Callable[..., Estimator]] = {"harmonic": HarmonicMeanEstimator, "last": LastSampleEstimator}


def make_estimator(name: str = "harmonic", *, fixed_cost: bool = False) -> Estimator:
    """A fresh estimator by name: ``"harmonic"`` (default) or ``"last"``; ``fixed_cost``: a read's fixed cost fitted
    apart from the bandwidth (see the module docstring)."""
    try:
        factory = ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; choose from {sorted(ESTIMATORS)}") from None
    return factory(fixed_cost=fixed_cost)
