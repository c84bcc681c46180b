"""What the streaming controller plans with: :mod:`.cost` (:class:`CostModel`, measured per option and per prefill)
and :mod:`.probes` (:class:`Prober`: measurements off the request's path).

May import: the core layers below the engine, :mod:`..model` and :mod:`..serving`.
"""
