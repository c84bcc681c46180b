"""Operations: how a deployment configures, watches and waits on the engine.

``settings``: the ``CACHEGEN_*`` configuration (``docs/configuration.md``); ``progress``: progress
bars on long cold work; ``metrics``: per-store totals of finished requests (fed by the engine,
which it never imports); ``prometheus``: their Prometheus exporter (extra ``metrics``).

May import: ``errors``, ``paths``, ``codec`` (decode limits) and ``stores``; never the engine
(metrics read it through the small ``MetricsSource`` protocol).
"""
