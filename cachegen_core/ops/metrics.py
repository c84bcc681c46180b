"""What an engine's requests did, in aggregate: what ``engine.metrics()`` returns.

:class:`MetricsRecorder` is fed every finished request's figures by the engine (thread-safe,
with the store label, chunk size and prefill cost to count them with) and keeps running totals
per store; :func:`summarise` adds the background writer's counters and the values a signed
store refused, as an immutable :class:`EngineMetrics`. The engine is never imported here: a
request is read through :class:`RequestFigures` (the engine's ``GenerationInfo`` is one) and an
engine through :class:`MetricsSource`. ``prometheus.PrometheusExporter`` (extra ``metrics``)
serves them in Prometheus' text format.

Definitions (per request, summed): a *hit* reused at least one stored chunk; tokens
*reused* came from the store as KV (chunks the controller sent as text count as
recomputed); *prefill_s* is the time to first token less fetch and decode;
*seconds_saved* estimates reused tokens x the cost model's prefill seconds per token,
less the fetch and decode time spent on them (negative when the store was slower than
the model). ``generate_many`` reports the batch's fetch figures on each of its requests.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Protocol

TEXT = "text"


class RequestFigures(Protocol):
    """What one finished request reports (the engine's ``GenerationInfo``)."""

    prompt_tokens: int
    cached_tokens: int
    text_chunks: int
    levels: Sequence[Any]
    bytes_fetched: int
    fetch_s: float
    decode_s: float
    ttft_s: float
    total_s: float
    new_tokens: int
    errors: Sequence[str]


@dataclass(frozen=True)
class StoreMetrics:
    """Totals over the requests served from one store (or all of them)."""

    requests: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    tokens_reused: int = 0
    tokens_recomputed: int = 0
    chunks_reused: int = 0
    text_chunks: int = 0
    bytes_fetched: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    seconds_saved: float = 0.0
    new_tokens: int = 0
    errors: int = 0
    store_errors: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of requests that reused stored KV (0 before any request)."""
        return self.hits / self.requests if self.requests else 0.0

    @property
    def token_reuse_rate(self) -> float:
        """Share of prompt tokens whose KV came from the store."""
        return self.tokens_reused / self.prompt_tokens if self.prompt_tokens else 0.0

    def __add__(self, other: StoreMetrics) -> StoreMetrics:
        return StoreMetrics(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate, "token_reuse_rate": self.token_reuse_rate}


def request_metrics(info: RequestFigures, chunk_tokens: int, prefill_s_per_token: float, *, fetch_counted: bool = False) -> StoreMetrics:
    """One finished request as a ``StoreMetrics`` of one request.

    ``fetch_counted``: the request's fetch figures are its batch's, already added with another
    request of the batch (``generate_many`` streams shared chunks once): they count as zero.
    """
    text_tokens = info.text_chunks * chunk_tokens
    reused = max(0, min(info.cached_tokens, info.prompt_tokens) - text_tokens)
    fetched, fetch_s, decode_s = (0, 0.0, 0.0) if fetch_counted else (info.bytes_fetched, info.fetch_s, info.decode_s)
    spent = fetch_s + decode_s
    return StoreMetrics(
        requests=1,
        hits=int(reused > 0),
        prompt_tokens=info.prompt_tokens,
        tokens_reused=reused,
        tokens_recomputed=info.prompt_tokens - reused,
        chunks_reused=sum(1 for lv in info.levels if lv != TEXT),
        text_chunks=info.text_chunks,
        bytes_fetched=fetched,
        fetch_s=fetch_s,
        decode_s=decode_s,
        prefill_s=max(0.0, info.ttft_s - spent),
        ttft_s=info.ttft_s,
        total_s=info.total_s,
        seconds_saved=reused * prefill_s_per_token - spent if reused else 0.0,
        new_tokens=info.new_tokens,
        errors=len(info.errors),
        store_errors=sum(1 for e in info.errors if "store" in e.lower()),
    )


class MetricsRecorder:
    """Running totals per store label, fed one request at a time from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_store: dict[str, StoreMetrics] = {}

    def record(self, info: RequestFigures, *, store: str, chunk_tokens: int, prefill_s_per_token: float,
               fetch_counted: bool = False) -> None:  # fmt: skip
        """Add a finished request served from the store labelled ``store`` (see :func:`request_metrics`)."""
        one = request_metrics(info, chunk_tokens, prefill_s_per_token, fetch_counted=fetch_counted)
        label = store
        with self._lock:
            self._by_store[label] = self._by_store.get(label, StoreMetrics()) + one

    def snapshot(self) -> dict[str, StoreMetrics]:
        with self._lock:
            return dict(self._by_store)

    def reset(self) -> None:
        with self._lock:
            self._by_store.clear()


@dataclass(frozen=True)
class EngineMetrics:
    """An engine's metrics: ``total`` and per store (by the store's repr), the writer's counters,
    values a signed store refused, and the cost model's prefill seconds per token."""

    total: StoreMetrics = StoreMetrics()
    stores: Mapping[str, StoreMetrics] = field(default_factory=dict)
    writes: Mapping[str, int] = field(default_factory=dict)
    rejected_values: int = 0
    prefill_s_per_token: float = 0.0

    def __getattr__(self, name: str) -> Any:  # engine.metrics().hit_rate: the total's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.total, name)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.total.as_dict(),
            "stores": {k: v.as_dict() for k, v in self.stores.items()},
            "writes": dict(self.writes),
            "rejected_values": self.rejected_values,
            "prefill_s_per_token": self.prefill_s_per_token,
        }


def summarise(by_store: Mapping[str, StoreMetrics], writes: Mapping[str, int], rejected_values: int,
              prefill_s_per_token: float) -> EngineMetrics:  # fmt: skip
    """An :class:`EngineMetrics` from the recorder's totals per store and the engine's other counters."""
    total = StoreMetrics()
    for m in by_store.values():
        total = total + m
    return EngineMetrics(total, dict(by_store), dict(writes), int(rejected_values), prefill_s_per_token)


class MetricsSource(Protocol):
    """Anything whose metrics can be read now (a ``KVEngine``), for the exporter."""

    def metrics(self) -> EngineMetrics: ...
