"""The model and its attention: everything that calls into transformers.

- :mod:`.hf`: prefill, generation on a reused KV (transformers' ``generate``), stop strings, the cache layers the engine
  holds exactly (:class:`UnsupportedModel` for any other);
- :mod:`.attention`: SDPA reading grouped KV heads in place (for models the engine loads);
- :mod:`.rope`: moving post-RoPE keys by a position delta;
- :mod:`.positions`: the model's range of positions and the error for a request past it.

May import: the core layers below the engine (base, data, keys, coders, codec, stores, ops, streaming); nothing of
the engine.
"""
