"""BufferPool: prompt KV buffers kept between requests, so a warm request writes into memory already mapped.

A prompt's KV buffer is big (142 MB for 3K tokens of the reference model in float32, 355 MB for
7.7K), and the first write into fresh memory faults every page in: on 2 cores that cost 26 ms
of the 35 ms it took to copy a 3K context's cached KV into a new buffer, 9 ms once the pages
were mapped (``docs/history/``). The engine takes each request's buffer from the pool and gives
it back when nothing else can still read it (no chunk of it queued for the writer).
"""

from __future__ import annotations

import threading

import torch

from ...kv import KVCache, empty_tensor


class BufferPool:
    """Spare KV buffers ``(layers, heads, capacity, head_dim)`` of one dtype on one device.

    ``take(tokens)`` returns a buffer of ``tokens`` tokens: a view of the smallest kept buffer
    that holds them, else of a new one (``kv.empty_tensor``). ``give(buffer)`` keeps the memory of
    a buffer ``take`` returned for later requests; at most ``keep`` are kept (the largest). The
    caller gives back only a buffer nothing else holds views of; one it does not give back is
    freed as usual.
    """

    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, keep: int = 2) -> None:
        self.shape, self.dtype, self.device, self.keep = (layers, heads, head_dim), dtype, torch.device(device), keep
        self._spare: list[KVCache] = []
        self._lock = threading.Lock()

    def take(self, tokens: int) -> KVCache:
        """A buffer of ``tokens`` tokens (uninitialised)."""
        with self._lock:
            fits = [b for b in self._spare if b.num_tokens >= tokens]
            whole = min(fits, key=lambda b: b.num_tokens) if fits else None
            if whole is not None:
                self._spare = [b for b in self._spare if b is not whole]  # by identity: KVCache equality compares tensors
        if whole is None:
            layers, heads, dim = self.shape
            shape = (layers, heads, tokens, dim)
            whole = KVCache(empty_tensor(shape, self.dtype, self.device), empty_tensor(shape, self.dtype, self.device))
        return whole.slice(0, tokens)

    def give(self, buffer: KVCache) -> None:
        """Keep the memory of ``buffer`` (a view ``take`` returned) for a later request."""
        whole = self._whole(buffer)
        if whole is None or self.keep < 1:
            return
        with self._lock:
            if any(b.keys.data_ptr() == whole.keys.data_ptr() for b in self._spare):
                return  # given back twice
            self._spare.append(whole)
            self._spare.sort(key=lambda b: b.num_tokens, reverse=True)
            del self._spare[self.keep :]

    def _whole(self, buffer: KVCache) -> KVCache | None:
        """The whole buffer a view of ``take`` belongs to, or None for anything else."""
        layers, heads, dim = self.shape
        parts = []
        for x in (buffer.keys, buffer.values):
            base = x._base if x._base is not None else x
            per_token = layers * heads * dim
            if base.dtype != self.dtype or base.device != x.device or x.device.type != self.device.type or base.numel() % per_token:
                return None
            whole = base.view(layers, heads, base.numel() // per_token, dim)
            if whole.data_ptr() != x.data_ptr() or whole.stride() != x.stride():
                return None  # not the first tokens of a buffer of this geometry
            parts.append(whole)
        return KVCache(parts[0], parts[1])

    def clear(self) -> None:
        """Keep nothing: the spare buffers' memory is freed once no request uses it."""
        with self._lock:
            self._spare.clear()

    @property
    def kept_bytes(self) -> int:
        """Bytes held in spare buffers."""
        with self._lock:
            return sum(b.keys.nbytes + b.values.nbytes for b in self._spare)
