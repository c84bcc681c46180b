"""RawCodec: a chunk's KV as plain floats in the checksummed container: the ``raw`` and ``lossless`` options.

Next to the compression levels, a chunk can be stored as its KV itself:

- ``"lossless"``: in the model's own dtype, bit for bit (the answer is the no-cache answer);
- ``"raw"``: as 16-bit floats: the model's dtype when it is 16-bit (then equal to lossless),
  else float16, or bfloat16 for a chunk with values beyond float16's range.

On a link fast enough that these bytes arrive before a compressed chunk would decode (a
memory or disk store, a fast network), they start the answer sooner than any level; the
streaming controller weighs both. The blob is the container of ``format.py`` with header
``{"codec": "cachegen-raw", "option", "dtype", "shape", "model_fingerprint"}`` and one
substream per (kind, layer): that layer's keys or values, ``(kv_heads, tokens, head_dim)``
little endian, each with its CRC-32. Decoding checks the header, lengths and checksums, then
copies (converting) straight into the caller's buffer: no pass over the values.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CacheGenFormatError
from .format import Container, Limits, first_bad_stream, frame, frame_bound, pack, unpack
from ..kv import KVCache, KVShapeError, side_stream, upload
from ..pinned import hold_until

CODEC = "cachegen-raw"
RAW, LOSSLESS = "raw", "lossless"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FP16_MAX = torch.finfo(torch.float16).max
_MAX_DIM = 1 << 14


def raw_dtype(kv: KVCache) -> torch.dtype:
    """The dtype ``raw`` stores ``kv`` in: its own when 16-bit, else float16 (bfloat16 past float16's range)."""
    if kv.dtype in (torch.float16, torch.bfloat16):
        return kv.dtype
    big = max(float(kv.keys.abs().amax()), float(kv.values.abs().amax())) if kv.num_tokens else 0.0
    return torch.float16 if big <= _FP16_MAX else torch.bfloat16


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Payloads:
    """The substreams of a raw blob whose checksums are still to be checked (``RawCodec.check(payloads=False)``):
    checked once, by ``verify``, beside their copy to a GPU."""

    def __init__(self, container: Container) -> None:
        self.container = container
        self.bad: int | None = -1  # -1: not checked yet; None: every checksum matched

    def verify(self) -> None:
        """Raise ``CacheGenFormatError`` unless every substream matches its checksum (hashed the first time only)."""
        if self.bad == -1:
            self.bad = first_bad_stream(self.container)
        if self.bad is not None:
            raise CacheGenFormatError(f"substream {self.bad} checksum mismatch (corrupted)")


@dataclass(frozen=True)
class RawChecked:
    """A raw blob whose container and header ``RawCodec.check`` verified (its payloads' checksums too, unless
    ``pending`` holds them: then decoding checks them)."""

    blob: Any  # bytes, or a view of a read buffer a stream reuses (DiskCacheStore.read_into) or of a pinned block
    option: str
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    pending: Payloads | None = None

    def __len__(self) -> int:
        return len(self.blob)


class Staged:
    """A raw blob being made in one host buffer (``RawCodec.stage``): its payloads, copied from a GPU while
    ``event`` is pending, then the frame written before them by ``finish``."""

    def __init__(self, block: np.ndarray, room: int, per_stream: int, header: dict[str, Any], kv: KVCache, event: Any) -> None:
        self.block, self.room, self.per_stream, self.header, self.event = block, room, per_stream, header, event
        self.kv = kv  # the payloads as ``(layers, heads, tokens, dim)`` keys and values, in the blob's dtype
        self._blob: memoryview | None = None

    def ready(self) -> KVCache:
        """The payloads (``kv``) once the copy into them is done."""
        if self.event is not None:
            self.event.synchronize()
        return self.kv

    def finish(self) -> memoryview:
        """The blob: the copy waited for, the payloads hashed, the frame written before them (once)."""
        if self._blob is None:
            self.ready()
            mv = memoryview(self.block)
            n = 2 * self.kv.num_layers
            streams = [mv[self.room + i * self.per_stream : self.room + (i + 1) * self.per_stream] for i in range(n)]
            prefix = frame(self.header, {}, streams)
            start = self.room - len(prefix)
            self.block[start : self.room] = np.frombuffer(prefix, dtype=np.uint8)
            self._blob = mv[start : self.room + n * self.per_stream]
        return self._blob


class RawCodec:
    """Encode and decode raw KV chunks of one model (``fingerprint``; required of every blob when set)."""

    def __init__(self, fingerprint: str = "", *, limits: Limits = Limits(), max_tokens: int = 1 << 17) -> None:
        self.fingerprint = fingerprint
        self.limits = limits
        self.max_tokens = max_tokens

    def encode(self, kv: KVCache, option: str = RAW) -> bytes:
        """The blob of ``kv`` stored as ``option`` (``"raw"`` or ``"lossless"``)."""
        header, dtype = self._header(kv, option)
        streams = []
        for x in (kv.keys, kv.values):
            a = x.detach().to(device="cpu", dtype=dtype).contiguous()
            b = a.view(torch.int16 if a.element_size() == 2 else torch.int32).numpy()
            if sys.byteorder != "little":
                b = b.byteswap()
            streams += [memoryview(b[layer]).cast("B") for layer in range(kv.num_layers)]
        return pack(header, {}, streams)

    def stage(self, kv: KVCache, option: str = RAW, alloc: Callable[[int], np.ndarray | None] | None = None) -> Staged:
        """``encode`` in two steps, for a chunk on a GPU: its KV is copied (asynchronously, on the current stream)
        straight to where the payloads end a host buffer (``alloc(n)``: a pinned block; None: plain memory); then
        :meth:`Staged.finish` waits for the copy, hashes the payloads and writes the header before them, giving
        the very bytes ``encode`` gives. Little-endian hosts only (``encode`` elsewhere)."""
        header, dtype = self._header(kv, option)
        layers, heads, tokens, dim = kv.shape
        per = heads * tokens * dim * dtype.itemsize
        room = -(-frame_bound(header, 2 * layers) // 64) * 64
        size = room + 2 * layers * per
        block = alloc(size) if alloc is not None else None
        if block is None:
            block = np.empty(size, dtype=np.uint8)
        payload = torch.from_numpy(block[room:]).view(dtype).view(2, *kv.shape)
        for dst, x in zip(payload, (kv.keys, kv.values)):
            dst.copy_(x.detach().to(dtype), non_blocking=True)
        event = None
        if kv.keys.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(kv.keys.device))
            hold_until(block, event)
        return Staged(block, room, per, header, KVCache(payload[0], payload[1]), event)

    def _header(self, kv: KVCache, option: str) -> tuple[dict[str, Any], torch.dtype]:
        if option not in (RAW, LOSSLESS):
            raise ValueError(f"not a raw option: {option!r}")
        if kv.num_tokens < 1:
            raise KVShapeError("cannot encode an empty KV cache (0 tokens)")
        if kv.dtype not in _DTYPES.values():
            raise KVShapeError(f"unsupported KV dtype {kv.dtype}")
        dtype = kv.dtype if option == LOSSLESS else raw_dtype(kv)
        header = {"codec": CODEC, "option": option, "dtype": _name(dtype), "shape": list(kv.shape), "model_fingerprint": self.fingerprint}
        return header, dtype

    def check(self, blob: Any, option: str = RAW, *, payloads: bool = True) -> RawChecked:
        """Verify a raw blob's container (every checksum) and header: all of ``decode`` but the copy,
        which a fetch thread can do while the previous chunk decodes. ``payloads=False``: every length and
        the header, the payloads' checksums left to ``decode`` (which runs them beside the copy to a GPU)."""
        c = unpack(blob, self.limits, views=True, hashes=payloads)
        shape, dtype = self._check(c.header, option, len(c.streams))
        layers, heads, tokens, dim = shape
        per_layer = heads * tokens * dim * dtype.itemsize
        if any(len(s) != per_layer for s in c.streams):
            raise CacheGenFormatError(f"raw substreams must hold {per_layer} bytes each for shape {list(shape)}")
        return RawChecked(blob, option, shape, dtype, None if payloads else Payloads(c))

    def decode(self, blob: bytes | memoryview | RawChecked, option: str = RAW, *, out: KVCache | None = None) -> KVCache:
        """The KV of a raw blob stored as ``option``, written into ``out`` (same shape) when given.

        ``CacheGenFormatError`` for anything but a well-formed blob of this model and option.
        """
        checked = blob if isinstance(blob, RawChecked) else self.check(blob, option)
        if checked.option != option:
            raise CacheGenFormatError(f"blob is stored as {checked.option!r}, expected {option!r}")
        layers, heads, tokens, dim = shape = checked.shape
        if out is not None and (out.shape != tuple(shape)):
            raise KVShapeError(f"raw blob of shape {list(shape)} does not fit a buffer of shape {out.shape}")
        n = layers * heads * tokens * dim
        start = len(checked.blob) - 2 * n * checked.dtype.itemsize  # the payloads, contiguous, end the blob
        if out is not None and out.keys.is_cuda:  # to a GPU in one asynchronous copy, from pinned memory
            staged = _to_device(np.frombuffer(checked.blob, dtype=np.uint8)[start:], out.keys.device, checked.pending)
            both = staged.view(checked.dtype).view(2, layers, heads, tokens, dim)
            out.keys.copy_(both[0])
            out.values.copy_(both[1])
            return out
        if checked.pending is not None:
            checked.pending.verify()
        parts = []
        for kind in range(2):
            with warnings.catch_warnings():  # a bytes blob is read-only: it is only ever read from here
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(checked.blob, dtype=checked.dtype, count=n, offset=start + kind * n * checked.dtype.itemsize)
            src = src.view(layers, heads, tokens, dim)
            if out is None:
                parts.append(src.clone())
            else:
                (out.keys if kind == 0 else out.values).copy_(src)
        return out if out is not None else KVCache(parts[0], parts[1])

    def _check(self, h: dict[str, Any], option: str, n_streams: int) -> tuple[tuple[int, int, int, int], torch.dtype]:
        if h.get("codec") != CODEC:
            raise CacheGenFormatError(f"not a raw KV blob (codec {h.get('codec')!r})")
        if h.get("option") != option:
            raise CacheGenFormatError(f"blob is stored as {h.get('option')!r}, expected {option!r}")
        if self.fingerprint and h.get("model_fingerprint") != self.fingerprint:
            raise CacheGenFormatError("blob belongs to another model (fingerprint mismatch)")
        dtype = _DTYPES.get(h.get("dtype")) if isinstance(h.get("dtype"), str) else None
        if dtype is None or (option == RAW and dtype == torch.float32):
            raise CacheGenFormatError(f"bad dtype {h.get('dtype')!r} for a {option} blob")
        shape = h.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) != 4
            or any(not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= _MAX_DIM for d in shape)
            or shape[2] > self.max_tokens
        ):
            raise CacheGenFormatError(f"bad shape {shape!r} (tokens limited to max_tokens={self.max_tokens})")
        if 2 * int(np.prod(shape)) > self.limits.max_section_elements:
            raise CacheGenFormatError(f"shape {shape} claims too many elements")
        if n_streams != 2 * shape[0]:
            raise CacheGenFormatError(f"raw blob has {n_streams} substreams, shape {shape} needs {2 * shape[0]}")
        return tuple(shape), dtype  # type: ignore[return-value]


def _to_device(payload: np.ndarray, device: torch.device, pending: Payloads | None) -> torch.Tensor:
    """``payload`` on ``device`` (``kv.upload``: straight from pinned memory when it is there). With ``pending``
    checksums, the copy runs on a side stream while they are checked here, and the current stream waits for it
    only once they match: a corrupted blob raises before anything reads the copy."""
    if pending is None or pending.bad != -1:
        if pending is not None:
            pending.verify()
        (staged,) = upload(payload, device=device)
        return staged
    current = torch.cuda.current_stream(device)
    side = side_stream(device)  # a copy from host memory into new device memory: nothing on ``current`` to wait for
    with torch.cuda.stream(side):
        (staged,) = upload(payload, device=device)
    pending.verify()  # beside the copy
    current.wait_stream(side)
    staged.record_stream(current)  # made on the side stream, read on this one
    return staged
