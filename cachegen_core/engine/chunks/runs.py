"""The runs of leading chunks a batch streams, one per prompt: what moves between their buffers.

A chunk streamed once for a batch lands in one prompt's buffer and is copied into the others'
(``copy_chunk``); keys are prefix-chained, so any prompt holding a chunk names the chunks before it
(``keys_before``). Text chunks deferred by the stream are prefilled afterwards, a run of them in one
pass (``prefill_text_runs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...keys.chunks import Chunk
from ...kv import KVCache

#: The text option: compute the KV of ``ids`` into ``buffer[start:]``, on top of ``buffer[:start]``.
PrefillInto = Callable[[list[int], KVCache, int], None]


def prefill_text_runs(run: list[Chunk], deferred: set[str], held: set[str], prompt: tuple[list[int], list[Chunk], KVCache],
                      prefill: PrefillInto) -> list[Chunk]:  # fmt: skip
    """Prefill each run of deferred text chunks that a streamed chunk follows, in one pass; return the run
    that ends the stream (left to the generation), or none."""
    group: list[Chunk] = []
    for c in run:
        if c.key in deferred:
            group.append(c)
            continue
        if c.key not in held:  # not streamed (a failure): nothing after it counts
            break
        if group:
            prefill(prompt[0][group[0].start : group[-1].end], prompt[2], group[0].start)
            held.update(g.key for g in group)
            group = []
    return group


def copy_chunk(src: KVCache, chunk: Chunk, buffer: KVCache) -> None:
    """``src`` (a chunk's KV) into its place in ``buffer``."""
    dst = buffer.slice(chunk.start, chunk.end)
    dst.keys.copy_(src.keys)
    dst.values.copy_(src.values)


def keys_before(chunk: Chunk, runs: Sequence[Sequence[Chunk]]) -> list[str]:
    """Keys of the chunks before ``chunk`` in a prompt holding it (prefix-chained keys: any such prompt will do)."""
    for run in runs:
        if chunk.index < len(run) and run[chunk.index].key == chunk.key:
            return [c.key for c in run[: chunk.index]]
    raise KeyError(chunk.key)
