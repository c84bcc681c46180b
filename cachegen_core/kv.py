"""KVCache: one canonical layout for a context's KV cache, and conversion to transformers.

Keys and values are each one tensor of shape ``(layers, kv_heads, tokens, head_dim)``
for a single sequence. ``kv_heads`` is the model's number of key/value heads, so GQA
and MQA models (fewer KV heads than query heads) need nothing special. The codec works
on ``(layers, tokens, channels)`` views of each (``merge_heads`` / ``split_heads``).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .errors import CacheGenError
from .pinned import hold_until, parallel_copy, pinned_tensor


class KVShapeError(CacheGenError, ValueError):
    """A KV cache has the wrong shape for the operation (or the model)."""


#: CPU tensors from this size on are backed by transparent huge pages (:func:`empty_tensor`).
HUGE_PAGE_MIN_BYTES = 4 << 20


def empty_tensor(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty``, but a big CPU tensor lives in an anonymous mapping advised for transparent huge pages.

    A prompt's KV buffer and a chunk's decoded components are written once, right after they are
    allocated: with 4 KiB pages the first write faults every page in (28 ms of a 3K-token warm
    request's 0.22 s on 2 cores, the same 140 MB written in 12 ms once faulted; 19 ms with huge
    pages). Where the kernel has no huge pages the advice is ignored and this is plain memory.
    """
    dev = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if dev.type != "cpu" or nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(tuple(shape), dtype=dtype, device=dev)
    region = mmap.mmap(-1, nbytes)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass
    return torch.frombuffer(region, dtype=dtype).view(tuple(shape))  # the tensor holds the mapping


class SpareBuffer:
    """One big CPU buffer kept from one call to the next, so that a chunk's scratch (its decoded components)
    is faulted in once, not per chunk (:func:`empty_tensor`: a fresh buffer's first write faults every page
    in; for a 1536-token chunk of the reference model, 70 MB and a third of a warm chunk's decode on 2 cores).
    It holds the largest buffer asked for; a call while another holds it gets a new one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None

    @contextlib.contextmanager
    def take(self, shape: Sequence[int], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """A contiguous tensor of ``shape`` and ``dtype`` (uninitialised), this object's until the block ends."""
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            buf, self._buffer = self._buffer, None
        if buf is None or buf.numel() < nbytes:
            buf = empty_tensor((max(nbytes, 1),), torch.uint8)
        try:
            yield buf[:nbytes].view(dtype).view(tuple(shape))
        finally:
            with self._lock:
                if self._buffer is None or self._buffer.numel() < buf.numel():
                    self._buffer = buf


class _Staging(threading.local):
    """This thread's pinned buffer for copies to a GPU, and the event that follows the last copy out of it."""

    buffer: torch.Tensor | None = None
    copied: Any = None


_staging = _Staging()
_STAGE_ALIGN = 16
#: An array in pinned memory from this size on goes to a GPU straight from there (smaller ones are staged with the rest).
_DIRECT_BYTES = 1 << 16


def upload(*arrays: np.ndarray, device: torch.device | str) -> list[torch.Tensor]:
    """The bytes of each array (C-contiguous) as a uint8 tensor on ``device``, each starting 16-byte aligned.

    To a CUDA device they go asynchronously on the current stream: an array that lies in pinned memory
    (``pinned.py``: a memory store's value, a read buffer) in its own copy straight from there, its block held
    until that copy is done; the others together through this thread's pinned staging buffer (filled by
    several threads, ``pinned.parallel_copy``; reused once that copy is done): a copy from memory that is not
    pinned would wait for it to be staged by the driver. Elsewhere each is a plain copy (its own, writable memory).
    """
    dev = torch.device(device)
    flat = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    if dev.type != "cuda":
        return [torch.from_numpy(a.copy()).to(dev) for a in flat]
    direct = {i: t for i, a in enumerate(flat) if a.size >= _DIRECT_BYTES and (t := pinned_tensor(a)) is not None}
    staged = [a if i not in direct else a[:0] for i, a in enumerate(flat)]
    starts = np.cumsum([0] + [-(-a.size // _STAGE_ALIGN) * _STAGE_ALIGN for a in staged])
    st = _staging
    if st.copied is not None:
        st.copied.synchronize()
    if st.buffer is None or st.buffer.numel() < starts[-1]:
        st.buffer = torch.empty(max(int(starts[-1]), 1 << 20), dtype=torch.uint8, pin_memory=True)
    host = st.buffer.numpy()
    for a, at in zip(staged, starts):
        parallel_copy(host[at : at + a.size], a)
    stream = torch.cuda.current_stream(dev)
    whole = st.buffer[: int(starts[-1])].to(dev, non_blocking=True)
    st.copied = torch.cuda.Event()  # the staging buffer is reused once this copy is done (not the direct ones)
    st.copied.record(stream)
    out = [whole[at : at + a.size] for a, at in zip(staged, starts)]
    for i, t in direct.items():
        out[i] = t.to(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        hold_until(flat[i], done)
    return out


_side_streams: dict[str, Any] = {}


def side_stream(device: torch.device | str) -> Any:
    """This process's second CUDA stream on ``device``, for copies that run beside the current stream's work."""
    key = str(torch.device(device))
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams.setdefault(key, torch.cuda.Stream(device=torch.device(device)))
    return stream


#: The attribute of a ``to_host`` copy's keys tensor holding the CUDA event its copy ends with. Not a dict keyed by
#: tensors: looking up a tensor key compares tensors with ``==``, which raises for any of more than one element.
_COPY_EVENT = "_cachegen_copy_done"


def to_host(kv: KVCache) -> KVCache:
    """``kv`` when it is in host memory; else a copy in pinned host memory, made asynchronously on the
    current CUDA stream (so the device may reuse ``kv``'s memory for work queued after it): read it after
    ``host_ready``."""
    if kv.keys.device.type != "cuda":
        return kv
    host = KVCache(*(torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True) for _ in range(2)))
    host.keys.copy_(kv.keys, non_blocking=True)
    host.values.copy_(kv.values, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(kv.keys.device))
    return copy_pending(host, done)


def copy_pending(kv: KVCache, event: Any) -> KVCache:
    """``kv`` (in host memory), marked as the target of a copy that ends with ``event``: see ``host_ready``."""
    if event is not None:
        setattr(kv.keys, _COPY_EVENT, event)
    return kv


def host_ready(kv: KVCache) -> KVCache:
    """``kv``, once the copy ``to_host`` started into it is done (at once for anything else)."""
    done = kv.keys.__dict__.pop(_COPY_EVENT, None)
    if done is not None:
        done.synchronize()
    return kv


def all_finite(x: torch.Tensor) -> bool:
    """Whether no value of ``x`` is NaN or infinite: its min and max are finite (NaN propagates through
    both), one reduction without a boolean copy (20x faster than ``isfinite(x).all()`` on a chunk)."""
    if not x.numel():
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(layers, kv_heads, tokens, head_dim)`` -> ``(layers, tokens, channels)``, channel = head * head_dim + dim."""
    layers, heads, tokens, dim = x.shape
    return x.permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of ``merge_heads``: ``(layers, tokens, channels)`` -> ``(layers, heads, tokens, channels // heads)``."""
    layers, tokens, channels = x.shape
    return x.reshape(layers, tokens, heads, channels // heads).permute(0, 2, 1, 3)


@dataclass(frozen=True)
class KVCache:
    """Keys and values of one sequence, each ``(layers, kv_heads, tokens, head_dim)``."""

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.values.dim() != 4:
            raise KVShapeError(
                f"keys and values must be 4-D (layers, kv_heads, tokens, head_dim); got {tuple(self.keys.shape)} and {tuple(self.values.shape)}"
            )
        if self.keys.shape != self.values.shape:
            raise KVShapeError(f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} differ in shape")
        if self.keys.dtype != self.values.dtype:
            raise KVShapeError(f"keys ({self.keys.dtype}) and values ({self.values.dtype}) differ in dtype")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(layers, kv_heads, tokens, head_dim)``."""
        return tuple(self.keys.shape)  # type: ignore[return-value]

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def num_elements(self) -> int:
        """Elements in keys and values together."""
        return 2 * self.keys.numel()

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Size in bytes of keys and values as ``dtype`` (default: their own)."""
        itemsize = (dtype or self.dtype).itemsize
        return self.num_elements * itemsize

    def to(self, *args: Any, **kwargs: Any) -> "KVCache":
        """``Tensor.to`` applied to keys and values."""
        return KVCache(self.keys.to(*args, **kwargs), self.values.to(*args, **kwargs))

    def slice(self, start: int, end: int | None = None) -> "KVCache":
        """Tokens ``[start, end)`` (views, no copy)."""
        return KVCache(self.keys[:, :, start:end], self.values[:, :, start:end])

    @staticmethod
    def concat(parts: Sequence["KVCache"]) -> "KVCache":
        """Concatenate caches along the token axis; layers, heads, head_dim and dtype must agree."""
        if not parts:
            raise KVShapeError("cannot concatenate an empty list of KV caches")
        first = parts[0]
        for p in parts[1:]:
            if (p.num_layers, p.num_kv_heads, p.head_dim, p.dtype) != (
                first.num_layers,
                first.num_kv_heads,
                first.head_dim,
                first.dtype,
            ):
                raise KVShapeError(f"cannot concatenate KV of shape {p.shape}/{p.dtype} to {first.shape}/{first.dtype}")
        if len(parts) == 1:
            return first
        return KVCache(torch.cat([p.keys for p in parts], dim=2), torch.cat([p.values for p in parts], dim=2))

    @classmethod
    def from_dynamic_cache(cls, cache: Any, batch_index: int = 0) -> "KVCache":
        """Take sequence ``batch_index`` out of a transformers ``DynamicCache`` (or legacy tuple cache).

        A sliding-window layer that dropped its oldest tokens (transformers' own, past its window) is a
        ``KVShapeError``, never a shorter KV: pass the model a ``DynamicCache()`` built without its config.
        """
        if hasattr(cache, "layers"):
            for i, layer in enumerate(cache.layers):
                if getattr(layer, "is_sliding", False) and layer.keys is not None and layer.get_seq_length() > layer.keys.shape[-2]:
                    raise KVShapeError(f"cache layer {i} holds only the last {layer.keys.shape[-2]} of its "
                                       f"{layer.get_seq_length()} tokens (a sliding window)")  # fmt: skip
            pairs = [(layer.keys, layer.values) for layer in cache.layers]
        else:  # legacy tuple of (key, value) per layer
            pairs = [(k, v) for k, v in cache]
        if not pairs or any(k is None or v is None for k, v in pairs):
            raise KVShapeError("the cache is empty or has uninitialised layers")
        keys = torch.stack([k[batch_index] for k, _ in pairs])
        values = torch.stack([v[batch_index] for _, v in pairs])
        return cls(keys, values)

    def to_dynamic_cache(self, config: Any = None) -> Any:
        """A transformers ``DynamicCache`` with batch size 1 holding this KV.

        ``config`` (the model's config) lets transformers pick the right layer types;
        its layer count must match.
        """
        from transformers import DynamicCache  # noqa: PLC0415

        if config is not None:
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            n = getattr(text, "num_hidden_layers", self.num_layers)
            kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
            if n != self.num_layers:
                raise KVShapeError(f"model has {n} layers but the KV cache has {self.num_layers}")
            if kv_heads is not None and kv_heads != self.num_kv_heads:
                raise KVShapeError(f"model has {kv_heads} KV heads but the KV cache has {self.num_kv_heads}")
        data = [(self.keys[i : i + 1], self.values[i : i + 1]) for i in range(self.num_layers)]
        return DynamicCache(data, config=config)
