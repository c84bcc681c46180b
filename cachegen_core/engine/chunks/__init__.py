"""Reading and writing stored chunks.

- :mod:`.reader`: :class:`ChunkReader` (manifest lookup, fetch, checked decode, the batched stream), with
  :mod:`.reads` (a stream's verified blobs and read buffers), :mod:`.runs` (a batch's runs of chunks),
  :mod:`.tails` (a prompt's partial chunk, by its own key or through a pointer) and :mod:`.placement` (where levels
  decode);
- :mod:`.writer`: :class:`ChunkWriter` (encode every stored option, write, manifest last), its background
  :mod:`.worker` and :mod:`.hot` tier (first stages not yet stored); :mod:`.options` (what a miss stores).

May import: the core layers below the engine, :mod:`..model`, :mod:`..serving` and :mod:`..costs`.
"""
