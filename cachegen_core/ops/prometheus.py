"""Prometheus export of ``engine.metrics()`` (needs prometheus-client: ``pip install 'langchain-cachegen[metrics]'``).

::

    exporter = PrometheusExporter(engine)     # a KVEngine (anything with .metrics()); its own registry (or registry=REGISTRY)
    exporter.serve(9464)                       # http://127.0.0.1:9464/metrics
    exporter.text()                            # the same page as a string

Every sample is read from ``engine.metrics()`` at scrape time (a collector, no
per-request cost). Per-store series carry a ``store`` label (the store's repr: address
and namespace, never a password).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

try:
    from prometheus_client import CollectorRegistry, generate_latest, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ModuleNotFoundError as e:  # pragma: no cover - exercised by test_optional_dependencies
    raise ImportError("the Prometheus exporter needs prometheus-client: pip install 'langchain-cachegen[metrics]'",
                      name=e.name) from e  # fmt: skip

if TYPE_CHECKING:
    from .metrics import MetricsSource

#: (name, StoreMetrics field, help) of the per-store counters.
COUNTERS = [
    ("requests", "requests", "requests answered"),
    ("cache_hits", "hits", "requests that reused stored KV"),
    ("prompt_tokens", "prompt_tokens", "prompt tokens"),
    ("tokens_reused", "tokens_reused", "prompt tokens whose KV came from the store"),
    ("tokens_recomputed", "tokens_recomputed", "prompt tokens prefilled by the model"),
    ("chunks_reused", "chunks_reused", "chunks streamed from the store as KV"),
    ("text_chunks", "text_chunks", "stored chunks sent as text by the streaming controller"),
    ("bytes_fetched", "bytes_fetched", "blob bytes fetched from the store"),
    ("fetch_seconds", "fetch_s", "seconds spent fetching blobs"),
    ("decode_seconds", "decode_s", "seconds spent decoding blobs"),
    ("prefill_seconds", "prefill_s", "seconds to first token less fetch and decode"),
    ("new_tokens", "new_tokens", "tokens generated"),
    ("request_errors", "errors", "problems reported in requests (each recovered by recomputing)"),
    ("store_errors", "store_errors", "store failures reported in requests"),
]


class PrometheusCollector:
    """A prometheus-client collector reading ``engine.metrics()`` at every scrape; ``prefix`` starts every name."""

    def __init__(self, engine: MetricsSource, prefix: str = "cachegen") -> None:
        self.engine = engine
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        m = self.engine.metrics()
        p = self.prefix
        for name, attr, text in COUNTERS:
            c = CounterMetricFamily(f"{p}_{name}", text[0].upper() + text[1:] + ".", labels=["store"])
            for store, sm in m.stores.items():
                c.add_metric([store], getattr(sm, attr))
            yield c
        saved = GaugeMetricFamily(f"{p}_seconds_saved", "Estimated seconds saved by reuse (prefill cost of the "
                                  "reused tokens less fetch and decode).", labels=["store"])  # fmt: skip
        rate = GaugeMetricFamily(f"{p}_hit_ratio", "Share of requests that reused stored KV.", labels=["store"])
        for store, sm in m.stores.items():
            saved.add_metric([store], sm.seconds_saved)
            rate.add_metric([store], sm.hit_rate)
        yield saved
        yield rate
        writes = CounterMetricFamily(f"{p}_store_writes", "Chunks the background writer wrote, failed or dropped.",
                                     labels=["result"])  # fmt: skip
        for result in ("written", "failed", "dropped"):
            writes.add_metric([result], m.writes.get(result, 0))
        yield writes
        yield GaugeMetricFamily(f"{p}_store_queue", "Chunks queued for the background writer.", value=m.writes.get("queued", 0))
        yield CounterMetricFamily(f"{p}_rejected_values", "Stored values refused by the HMAC check (no tag or a wrong one).",
                                  value=m.rejected_values)  # fmt: skip
        yield GaugeMetricFamily(f"{p}_prefill_seconds_per_token", "The cost model's prefill seconds per token.",
                                value=m.prefill_s_per_token)  # fmt: skip


class PrometheusExporter:
    """``engine``'s metrics in a registry (a new one unless ``registry`` is given), as text or over HTTP."""

    def __init__(self, engine: MetricsSource, *, registry: CollectorRegistry | None = None, prefix: str = "cachegen") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.collector = PrometheusCollector(engine, prefix)
        self.registry.register(self.collector)
        self._server: Any = None

    def text(self) -> str:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry).decode("utf-8")

    def serve(self, port: int = 9464, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread (port 0: a free one); returns the port."""
        self._server, _ = start_http_server(port, addr, registry=self.registry)
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stop serving and unregister the collector."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.registry.unregister(self.collector)
