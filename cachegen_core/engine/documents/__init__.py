"""Documents in any order: :mod:`.documents` (:class:`DocumentCaches`: document caches looked up by content, streamed,
moved, blended, stored) and :mod:`.blend` (CacheBlend's selective recompute).

May import: the core layers below the engine and the engine's :mod:`..model`, :mod:`..serving`, :mod:`..costs` and
:mod:`..chunks`.
"""
