"""The engine: a model, a codec and a store answering prompts with their contexts' KV reused.

The facade at the top: :mod:`.engine` (:class:`KVEngine`: lookup, stream, generate, batch), :mod:`.loading`
(``KVEngine.from_pretrained``), :mod:`.profiles` (the profile an engine codes with, fitted in the background) and
:mod:`.aio` (requests from asyncio). Below it, one subpackage per job, each importing only those before it:

- :mod:`.model`: the model and its attention (transformers glue, prefill, generation, RoPE shifts, positions);
- :mod:`.serving`: what a request is and reports, its KV's memory, background work giving way to requests;
- :mod:`.costs`: what the streaming controller plans with, measured (the cost model, probes);
- :mod:`.chunks`: reading and writing stored chunks (reader, writer and its worker, hot tier);
- :mod:`.documents`: document caches and CacheBlend.

May import: every layer below it (base, data, keys, coders, codec, stores, ops, streaming); nothing
in the core imports the engine but the entry points (``cli``, the package root) and ``testing``.
"""

from .costs.cost import CostModel
from .engine import KVEngine
from .model.hf import UnsupportedModel
from .serving.info import GenerationInfo
from .chunks.reader import ChunkReader
from .chunks.writer import ChunkWriter, StoreHealth

__all__ = ["ChunkReader", "ChunkWriter", "CostModel", "GenerationInfo", "KVEngine", "StoreHealth", "UnsupportedModel"]
