"""Bandwidth estimators: what the controller believes the link delivers, from measured fetches."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol


class Estimator(Protocol):
    """Bandwidth estimate (bytes/s) from measured chunk fetches; ``None`` before any."""

    def update(self, nbytes: int, seconds: float) -> None: ...

    def estimate(self) -> float | None: ...


class HarmonicMeanEstimator:
    """Harmonic mean of the last ``window`` throughput samples.

    Dominated by the slow samples, so one fast sample (a small blob served from a warm
    buffer) barely moves it, while a drop shows at once: the safe side for a deadline.
    """

    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.samples: deque[float] = deque(maxlen=window)

    def update(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.samples.append(nbytes / seconds)

    def estimate(self) -> float | None:
        if not self.samples:
            return None
        return len(self.samples) / sum(1.0 / s for s in self.samples)


class LastSampleEstimator:
    """The original paper's estimator: the throughput of the last fetch."""

    def __init__(self) -> None:
        self.last: float | None = None

    def update(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.last = nbytes / seconds

    def estimate(self) -> float | None:
        return self.last


ESTIMATORS: dict[str, Callable[[], Estimator]] = {"harmonic": HarmonicMeanEstimator, "last": LastSampleEstimator}


def make_estimator(name: str = "harmonic") -> Estimator:
    """A fresh estimator by name: ``"harmonic"`` (default) or ``"last"``."""
    try:
        return ESTIMATORS[name]()
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; choose from {sorted(ESTIMATORS)}") from None
