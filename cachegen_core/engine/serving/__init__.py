"""Serving requests: what a request is and reports, its KV's memory, and background work that gives way to requests.

- :mod:`.info`: :class:`GenerationInfo` (what one request did);
- :mod:`.buffers`: :class:`BufferPool` (prompts' KV buffers kept between requests);
- :mod:`.yielding`: :class:`Yielding` (background torch work pausing before each op while a request computes);
- :mod:`.background`: :class:`JobQueue` (background jobs run one at a time: the probes, the document caches).

May import: the core layers below the engine and :mod:`..model`.
"""
