"""A stream's reads: the blobs its fetches verified and the buffers a store reads into (``ChunkReader.fetch``)."""

from __future__ import annotations

from typing import Any

from ...codec.kvcodec import Checked
from ...codec.raw import RawChecked
from ...pinned import HostArena, settle


class StreamReads:
    """What one stream's fetches share: the blobs they verified (kept for the next stream when the store shares
    its objects, see ``ChunkReader.fetch``) and two read buffers, used in turn by a store that can read into one
    (``read_into``): the driver holds at most the blob being decoded and the one being fetched. With a GPU
    (``arena``) they are pinned blocks (``pinned.py``), each written again once the copy out of it is done."""

    def __init__(self, buffers: list[Any], arena: HostArena | None = None) -> None:
        self.seen: dict[str, tuple[Any, Checked | RawChecked]] = {}
        self.buffers, self.arena, self._turn = buffers, arena, 0

    def buffer(self, size: int) -> Any:
        """The next read buffer, at least ``size`` bytes (a new one when the one in turn is smaller)."""
        i = self._turn % len(self.buffers)
        self._turn += 1
        settle(self.buffers[i])  # a copy to a GPU out of it still running
        if len(self.buffers[i]) < size:
            block = self.arena.alloc(size) if self.arena is not None else None
            self.buffers[i] = block if block is not None else bytearray(size)
        return self.buffers[i]
