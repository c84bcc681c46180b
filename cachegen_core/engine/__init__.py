"""The engine: a model, a codec and a store answering prompts with their contexts' KV reused.

- :mod:`.engine`: :class:`KVEngine` (lookup, stream, generate, batch);
- :mod:`.reader`: :class:`ChunkReader` (manifest lookup, fetch, checked decode, the batched stream);
- :mod:`.writer`: :class:`ChunkWriter` (encode every stored level, write, manifest last; background worker);
- :mod:`.cost`: :class:`CostModel` (the per-token costs the streaming controller plans with);
- :mod:`.attention`: SDPA attention reading grouped KV heads in place (for models the engine loads);
- :mod:`.hf`: the transformers side (prefill, generation on a reused KV, stop strings, first-token time;
  :class:`UnsupportedModel` for a model whose KV cache it cannot hold exactly);
- :mod:`.info`: :class:`GenerationInfo` (what one request did).

May import: every layer below it (base, data, keys, coders, codec, stores, ops, streaming); nothing
in the core imports the engine but the entry points (``cli``, the package root) and ``testing``.
"""

from .cost import CostModel
from .engine import KVEngine
from .hf import UnsupportedModel
from .info import GenerationInfo
from .reader import ChunkReader
from .writer import ChunkWriter, StoreHealth

__all__ = ["ChunkReader", "ChunkWriter", "CostModel", "GenerationInfo", "KVEngine", "StoreHealth", "UnsupportedModel"]
