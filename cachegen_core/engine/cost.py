"""CostModel: what the streaming controller plans with, measured as the engine runs.

Per option, the decode seconds and blob bytes per token seen so far (running averages),
and the model's prefill seconds per token (the cost of sending a chunk as text). Before
any measurement the prefill cost is a prior and decoding is assumed free; the first
prefill measurement replaces the prior outright (a blend kept plans off by 2x for the
first requests), later ones move the estimate smoothly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..streaming import ChunkCost

#: Prefill seconds per token assumed before the first measurement.
PREFILL_PRIOR_S_PER_TOKEN = 2e-3
#: Weight of a new measurement in the running averages.
WEIGHT = 0.3


class CostModel:
    """Running per-token costs: ``bytes_per_token[level]``, ``decode_s_per_token[level]``,
    ``prefill_s_per_token`` (``prefill_measured`` once it is no longer the prior)."""

    def __init__(self, prefill_prior_s_per_token: float = PREFILL_PRIOR_S_PER_TOKEN, weight: float = WEIGHT) -> None:
        if prefill_prior_s_per_token <= 0 or not 0 < weight <= 1:
            raise ValueError("the prefill prior must be > 0 and the weight in (0, 1]")
        self.weight = weight
        self.bytes_per_token: dict[int, float] = {}
        self.decode_s_per_token: dict[int, float] = {}
        self.prefill_s_per_token = prefill_prior_s_per_token
        self.prefill_measured = False

    def _observe(self, table: dict[int, float], key: int, value: float) -> None:
        table[key] = value if key not in table else (1 - self.weight) * table[key] + self.weight * value

    def observe_decode(self, level: int, nbytes: int, seconds: float, tokens: int) -> None:
        """One blob of ``nbytes`` decoded in ``seconds`` into ``tokens`` tokens."""
        if tokens > 0:
            self._observe(self.decode_s_per_token, level, seconds / tokens)
            self._observe(self.bytes_per_token, level, nbytes / tokens)

    def observe_prefill(self, s_per_token: float) -> None:
        """A measured prefill speed; the first one replaces the prior."""
        w = self.weight if self.prefill_measured else 1.0
        self.prefill_s_per_token = (1 - w) * self.prefill_s_per_token + w * s_per_token
        self.prefill_measured = True

    def chunk_cost(self, tokens: int, sizes: Mapping[int, int]) -> ChunkCost:
        """The controller's view of one chunk stored at ``sizes`` (level -> blob bytes)."""
        decode = {lv: self.decode_s_per_token.get(lv, 0.0) * tokens for lv in sizes}
        return ChunkCost(dict(sizes), decode, tokens)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_token": dict(self.bytes_per_token),
            "decode_s_per_token": dict(self.decode_s_per_token),
            "prefill_s_per_token": self.prefill_s_per_token,
            "prefill_measured": self.prefill_measured,
        }
