"""CostModel: what the streaming controller plans with, measured as the engine runs.

Per stored option (a level, ``raw``, ``lossless``), the decode seconds and blob bytes per
token seen so far (running averages), and the model's prefill seconds per token (the cost
of sending a chunk as text). Until an option's decode has been measured it is assumed to
cost a prior (a compressed level: ``elements_per_token`` symbols at
``PRIOR_SYMBOLS_PER_S``; a raw form: its bytes at ``PRIOR_COPY_BYTES_PER_S``); the first
measurement replaces a prior outright (a blend kept plans off by 2x for the first
requests), later ones move the estimate smoothly.

An option the controller stops choosing is never measured again, so one slow measurement
could rule it out for good: on the memory store a raw chunk decoded beside another engine's
work measured 0.10 s instead of 0.008 s, and every later request fetched level 1 (1.7x slower).
After each stream the estimates of the options it offered but did not use (:meth:`relax`)
move a step back towards their prior when they are above it, so such an option is tried again
once its prior says it might win, and measured.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..streaming import RAW_OPTIONS, ChunkCost, Option

#: Prefill seconds per token assumed before the first measurement.
PREFILL_PRIOR_S_PER_TOKEN = 2e-3
#: Entropy-decoded symbols per second assumed for a level before its first measurement.
PRIOR_SYMBOLS_PER_S = 100e6
#: Bytes per second a raw form is assumed to be checked and copied at before its first measurement.
PRIOR_COPY_BYTES_PER_S = 2e9
#: Weight of a new measurement in the running averages.
WEIGHT = 0.3


class CostModel:
    """Running per-token costs: ``bytes_per_token[option]``, ``decode_s_per_token[option]``,
    ``prefill_s_per_token`` (``prefill_measured`` once it is no longer the prior).

    ``elements_per_token``: KV elements per token of the model (2 x layers x KV heads x head
    dim), for the decode priors (0: decoding assumed free until measured).
    """

    def __init__(self, elements_per_token: int = 0, prefill_prior_s_per_token: float = PREFILL_PRIOR_S_PER_TOKEN,
                 weight: float = WEIGHT) -> None:  # fmt: skip
        if prefill_prior_s_per_token <= 0 or not 0 < weight <= 1:
            raise ValueError("the prefill prior must be > 0 and the weight in (0, 1]")
        self.elements_per_token = elements_per_token
        self.weight = weight
        self.bytes_per_token: dict[Option, float] = {}
        self.decode_s_per_token: dict[Option, float] = {}
        self.prefill_s_per_token = prefill_prior_s_per_token
        self.prefill_measured = False

    def _observe(self, table: dict[Option, float], key: Option, value: float) -> None:
        table[key] = value if key not in table else (1 - self.weight) * table[key] + self.weight * value

    def observe_decode(self, option: Option, nbytes: int, seconds: float, tokens: int) -> None:
        """One blob of ``nbytes`` decoded in ``seconds`` into ``tokens`` tokens."""
        if tokens > 0:
            self._observe(self.decode_s_per_token, option, seconds / tokens)
            self._observe(self.bytes_per_token, option, nbytes / tokens)

    def observe_prefill(self, s_per_token: float) -> None:
        """A measured prefill speed; the first one replaces the prior."""
        w = self.weight if self.prefill_measured else 1.0
        self.prefill_s_per_token = (1 - w) * self.prefill_s_per_token + w * s_per_token
        self.prefill_measured = True

    def prior_s_per_token(self, option: Option) -> float:
        """The decode seconds per token assumed for ``option`` before it is measured."""
        if option in RAW_OPTIONS:
            return self.bytes_per_token.get(option, 0.0) / PRIOR_COPY_BYTES_PER_S
        return self.elements_per_token / PRIOR_SYMBOLS_PER_S

    def relax(self, options: Iterable[Option]) -> None:
        """``options`` were offered to a stream that did not decode them: each measured estimate above
        its prior moves one step (``weight``) towards it."""
        for option in options:
            measured = self.decode_s_per_token.get(option)
            prior = self.prior_s_per_token(option)
            if measured is not None and measured > prior:
                self.decode_s_per_token[option] = (1 - self.weight) * measured + self.weight * prior

    def decode_seconds(self, option: Option, tokens: int, nbytes: int) -> float:
        """Expected seconds to decode a blob of ``nbytes`` holding ``tokens`` tokens stored as ``option``."""
        measured = self.decode_s_per_token.get(option)
        if measured is not None:
            return measured * tokens
        if option in RAW_OPTIONS:
            return nbytes / PRIOR_COPY_BYTES_PER_S
        return self.prior_s_per_token(option) * tokens

    def chunk_cost(self, tokens: int, sizes: Mapping[Option, int]) -> ChunkCost:
        """The controller's view of one chunk stored at ``sizes`` (option -> blob bytes)."""
        return ChunkCost(dict(sizes), {o: self.decode_seconds(o, tokens, n) for o, n in sizes.items()}, tokens)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_token": dict(self.bytes_per_token),
            "decode_s_per_token": dict(self.decode_s_per_token),
            "prefill_s_per_token": self.prefill_s_per_token,
            "prefill_measured": self.prefill_measured,
        }
