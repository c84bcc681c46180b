"""The GPU decoder of ``native-rans16-v1``: Triton kernels (``triton_kernels.py``), compiled at first use.

Triton ships with torch's CUDA wheels on Linux and compiles its kernels at run time: nothing is built
when the package installs, and no CUDA compiler is needed. ``TritonDecoder`` is the ``SymbolDecoder``
of ``cuda`` devices (``registry.DEVICE_DECODERS``); beyond symbols it decodes a chunk straight into
its KV (``decode_kv``) or into the float32 components a profile's transform turns into KV
(``decode_components``). Under Triton's interpreter (``TRITON_INTERPRET=1``) the same kernels run on
CPU tensors: that is how the test suite runs them on machines without a GPU, and then a
``TritonDecoder("cpu")`` may be made too.

Before a launch the host checks everything that bounds a read: the layout and table ids
(``StreamLayout.validate``), the tables (``base.validate_freqs``), every payload's length (even:
16-bit words). A call's inputs go to the device in one copy through pinned memory (``kv.upload``): the
payloads straight from where they are when that is pinned memory (a store's block, a pinned read buffer),
never joined when they follow each other in one blob, else staged by several threads; the layout, steps
and means with them; the tables once per table set and device. Each call waits for the kernel and reads
back one status per substream, so a bad payload is an error of this call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import CacheGenFormatError, CoderError
from ..kv import upload
from .base import BackendUnavailable, StreamLayout, validate_freqs
from .native_lib import CODER_NAME, describe

#: Substreams one program decodes on a GPU (``CACHEGEN_TRITON_STREAMS`` overrides; a power of two); the
#: interpreter takes them all in one program (its cost is per operation, whatever the block's size).
GPU_STREAMS_PER_PROGRAM = 2
_INTERPRETER_STREAMS = 256
#: Head dims whose rotary pairs ``decode_kv`` joins: dividing 16 (one round) or multiples of 32 up to this.
MAX_ROTARY_DIM = 512


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter here (``TRITON_INTERPRET=1``, read when they are first made)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@lru_cache(maxsize=1)
def _triton_error() -> str | None:
    try:
        import triton  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001  ImportError, or a broken install
        return f"Triton is not importable ({type(e).__name__}: {e}); it comes with torch's CUDA wheels, or pip install triton"
    return None


def unavailable_reason(device: Any = "cuda") -> str | None:
    """Why the Triton decoder cannot run on ``device`` here, or None. Cheap: compiles nothing."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"no CUDA device {dev.index} (torch sees {torch.cuda.device_count()})"
    elif not (dev.type == "cpu" and interpreting()):
        return f"the Triton decoder runs on CUDA devices (on CPU tensors only under TRITON_INTERPRET=1), not {dev}"
    return _triton_error()


@lru_cache(maxsize=1)
def _kernels() -> Any:
    from . import triton_kernels  # noqa: PLC0415  (imports triton: only when a decoder is made)

    return triton_kernels


# Device copies of table sets: (id of the freqs array, device) -> (weakref to it, info tensor).
_tables: dict[tuple[int, str], tuple[weakref.ref, torch.Tensor]] = {}
_tables_lock = threading.Lock()


def device_tables(freqs: np.ndarray, device: torch.device) -> torch.Tensor:
    """``info`` (uint32 ``start | freq << 16`` per symbol, ``(n_tables, alphabet)``) on ``device``: validated
    and copied once per table set (by identity of ``freqs``, which must not change in place) and device."""
    key = (id(freqs), str(device))
    with _tables_lock:
        hit = _tables.get(key)
        if hit is not None and hit[0]() is freqs:
            return hit[1]
    validate_freqs(freqs)
    f = freqs.astype(np.uint32)
    info = (np.cumsum(f, axis=1, dtype=np.uint32) - f) | (f << 16)
    tensor = torch.from_numpy(np.ascontiguousarray(info)).to(device)
    with _tables_lock:
        for k in [k for k, (ref, _) in _tables.items() if ref() is None]:
            del _tables[k]
        _tables[key] = (weakref.ref(freqs), tensor)
    return tensor


def _table_rows(layout: StreamLayout) -> np.ndarray:
    """The table ids to send: one row when every substream's is the same view (``stream_layout``'s), else all."""
    tid = layout.table_ids
    return tid[:1] if tid.shape[0] > 1 and tid.strides[0] == 0 else tid


class TritonDecoder:
    """Decodes ``native-rans16-v1`` substreams on one device with Triton kernels.

    Construction raises ``BackendUnavailable`` (saying why) when it cannot run there, and so does a call
    whose kernel fails to compile or launch. The time of the last call's kernel (CUDA events; the
    whole launch under the interpreter) is kept in ``last_kernel_s``.
    """

    name = CODER_NAME

    def __init__(self, device: Any = "cuda") -> None:
        reason = unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailable(f"cannot decode {CODER_NAME} on {device}: {reason}")
        self.device = torch.device(device)
        self.last_kernel_s: float | None = None
        self._k = _kernels()

    # ------------------------------------------------------------------ what callers use
    def decode_symbols(self, payloads: Sequence[bytes | memoryview], layout: StreamLayout, freqs: np.ndarray) -> torch.Tensor:
        """The flat uint8 symbols on this decoder's device, equal to the CPU decoder's; ``CoderError`` on bad input."""
        data, offsets = _joined(payloads, layout.n_streams)
        out = torch.empty(max(1, layout.n_symbols), dtype=torch.uint8, device=self.device)
        self._run(self._k.decode_symbols_kernel, data, offsets, layout, freqs, (out,), {})
        return out[: layout.n_symbols]

    @staticmethod
    def fuses(head_dim: int, rotary: bool) -> bool:
        """Whether ``decode_kv`` writes head vectors of ``head_dim`` (keys rotated or not): a rotary pair must lie
        in one round of 16 symbols or in one lane (``triton_kernels``)."""
        return head_dim >= 1 and (not rotary or (head_dim % 2 == 0 and (16 % head_dim == 0 or (head_dim % 32 == 0 and head_dim <= MAX_ROTARY_DIM))))

    def decode_kv(self, data: np.ndarray, offsets: np.ndarray, layout: StreamLayout, freqs: np.ndarray, *, heads: int,
                  head_dim: int, min_symbol: int, step: torch.Tensor, mean: torch.Tensor,
                  cos_sin: tuple[torch.Tensor, torch.Tensor] | None, keys: torch.Tensor, values: torch.Tensor,
                  first_token: int) -> None:  # fmt: skip
        """Decode substreams of whole tokens (payload ``s``: ``data[offsets[s]:offsets[s + 1]]``) and write their KV
        into ``keys`` and ``values`` (tensors on this device of one float dtype and one stride, ``(layers, heads,
        tokens, head_dim)``, head vectors contiguous) from token ``first_token``: ``csrc/kv_core.h``'s reconstruction.
        ``step``, ``mean``: ``(2, layers, heads, head_dim)``; ``cos_sin``: ``(coded tokens, head_dim)`` each, or None
        (keys stored as they are). A symbol below ``min_symbol`` is a ``CacheGenFormatError``."""
        if not self.fuses(head_dim, cos_sin is not None) or keys.stride() != values.stride() or keys.stride(3) != 1:
            raise CoderError(f"the Triton KV decoder cannot write head vectors of {head_dim} into these tensors")
        here = keys.device.type == self.device.type and (self.device.index is None or keys.device == self.device)
        if keys.device != values.device or not here or keys.dtype != values.dtype:
            raise CoderError("keys and values must be tensors of one dtype on the decoder's device")
        self._kv(data, offsets, layout, freqs, keys, values, heads, head_dim, min_symbol, step, mean, cos_sin, first_token)

    def decode_components(self, data: np.ndarray, offsets: np.ndarray, layout: StreamLayout, freqs: np.ndarray, *,
                          layers: int, heads: int, head_dim: int, coded_tokens: int, min_symbol: int,
                          step: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Decode substreams of whole tokens into float32 components ``(s - 128) * step``, ``(2, layers, heads,
        coded_tokens, head_dim)`` on this device (what ``fused.decode_components`` gives on the CPU)."""
        out = torch.empty((2, layers, heads, coded_tokens, head_dim), dtype=torch.float32, device=self.device)
        self._kv(data, offsets, layout, freqs, out[0], out[1], heads, head_dim, min_symbol, step, None, None, 0)
        return out

    # ------------------------------------------------------------------ launching
    def _kv(self, data: np.ndarray, offsets: np.ndarray, layout: StreamLayout, freqs: np.ndarray, keys: torch.Tensor,
            values: torch.Tensor, heads: int, head_dim: int, min_symbol: int, step: torch.Tensor, mean: torch.Tensor | None,
            cos_sin: tuple[torch.Tensor, torch.Tensor] | None, first_token: int) -> None:  # fmt: skip
        layers, tokens = keys.shape[0], layout.n_symbols // max(layout.period, 1)
        period = 2 * layers * heads * head_dim
        off = layout.offsets
        if keys.dim() != 4 or keys.shape[1] != heads or keys.shape[3] != head_dim or layout.period != period:
            raise CoderError(f"a chunk of {layers} layers, {heads} heads of {head_dim} cannot go into KV of shape {tuple(keys.shape)}")
        if off[-1] != tokens * period or np.any(off % period) or not 0 <= first_token <= keys.shape[2] - tokens:
            raise CoderError("substreams must hold whole tokens that fit the output")
        dev = self.device
        params = [x for x in (step, mean if mean is not None else step)]
        if any(x.numel() != period for x in params):
            raise CoderError(f"steps and means must hold {period} values")
        if cos_sin is not None:
            cs = [x.to(device=dev, dtype=torch.float32).contiguous() for x in cos_sin]
            if any(tuple(x.shape) != (tokens, head_dim) for x in cs):
                raise CoderError(f"cos and sin must be ({tokens}, {head_dim})")
        if keys.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise CoderError(f"the Triton KV decoder writes float32, float16 or bfloat16, not {keys.dtype}")
        bf16 = keys.dtype == torch.bfloat16
        k, v = (x.view(torch.int16) if bf16 else x for x in (keys, values))  # bfloat16 rounded by the kernel itself
        meta = kv_meta(head_dim, rotary=cos_sin is not None, add_mean=mean is not None, bf16=bf16)

        def outputs(f32: list[torch.Tensor]) -> tuple[Any, ...]:
            rot = cs if cos_sin is not None else [f32[0], f32[0]]  # never read without a rotation
            return (*f32, *rot, k, v, keys.stride(0), keys.stride(1), keys.stride(2), first_token, layers, heads, min_symbol)

        self._run(self._k.decode_kv_kernel, data, offsets, layout, freqs, outputs, meta, params)

    def _run(self, kernel: Any, data: np.ndarray, offsets: np.ndarray, layout: StreamLayout, freqs: np.ndarray,
             outputs: Any, meta: dict[str, Any], params: Sequence[torch.Tensor] = ()) -> None:  # fmt: skip
        """Check the inputs, copy them to the device, launch ``kernel`` and raise for the first bad substream.

        One copy per call carries the payloads (straight from pinned memory when they are there: a store's block or
        a read buffer, ``pinned.py``), the layout and the float32 ``params`` (steps, means) given in host memory;
        ``outputs`` is the tuple of the kernel's remaining arguments, or a function of the params on the device."""
        info = device_tables(freqs, self.device)
        layout.validate(info.shape[0])
        n = layout.n_streams
        if offsets.shape != (n + 1,) or offsets[0] != 0 or np.any(np.diff(offsets) < 0) or offsets[-1] > data.size:
            raise CoderError("payload offsets do not fit the payloads")
        odd = np.flatnonzero(np.diff(offsets) % 2)
        if odd.size:
            raise CoderError(f"substream {int(odd[0])}: {describe(-3)} (a payload of an odd number of bytes)")
        if n == 0:
            return
        dev = self.device
        counts = layout.counts()
        order = np.argsort(-counts, kind="stable")
        per = min(_INTERPRETER_STREAMS, 1 << (n - 1).bit_length()) if dev.type == "cpu" else _gpu_streams()
        programs = -(-n // per)
        rounds = -(-counts[order[::per]] // 16)
        rows = _table_rows(layout)
        region = data[: int(offsets[-1])] if offsets[-1] else np.zeros(2, np.uint8)
        small = np.concatenate([offsets // 2, layout.offsets, order, rounds]).astype(np.int64)
        on_host = [p.device.type == "cpu" for p in params]
        host = [np.ascontiguousarray(p.detach().reshape(-1).float().numpy()) for p, h in zip(params, on_host) if h]
        words, packed, ids, *sent = upload(region, small, np.ascontiguousarray(rows, dtype=np.int32), *host, device=dev)
        f32 = [sent.pop(0).view(torch.float32) if h else p.to(device=dev, dtype=torch.float32).contiguous().reshape(-1)
               for p, h in zip(params, on_host)]  # fmt: skip
        words, packed, ids = words.view(torch.int16), packed.view(torch.int64), ids.view(torch.int32)
        word_off, sym_off = packed[: n + 1], packed[n + 1 : 2 * n + 2]
        order_t, rounds_t = packed[2 * n + 2 : 3 * n + 2], packed[3 * n + 2 :]
        status = torch.zeros(n, dtype=torch.int32, device=dev)
        alphabet = int(info.shape[1])
        steps = max(1, (alphabet - 1).bit_length())
        launch: dict[str, Any] = {"S": per, "STEPS": steps, "POW2": alphabet == 1 << steps, **meta}
        if dev.type == "cuda":
            launch.update(gpu_options(per))
        args = outputs(f32) if callable(outputs) else outputs
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else []
        t = time.perf_counter()
        try:
            with torch.cuda.device(dev) if events else contextlib.nullcontext():  # Triton launches on the current device
                if events:
                    events[0].record(torch.cuda.current_stream(dev))
                kernel[(programs,)](words, word_off, sym_off, order_t, rounds_t, n, ids, layout.period if rows.shape[0] > 1 else 0,
                                    layout.period, info, alphabet, *args, status, **launch)  # fmt: skip
                if events:
                    events[1].record(torch.cuda.current_stream(dev))
            codes = status.cpu().numpy()  # waits for the kernel
        except Exception as e:  # a compile or launch failure: this decoder cannot run here
            raise BackendUnavailable(f"the Triton decoder failed on {dev}: {type(e).__name__}: {e}") from e
        self.last_kernel_s = events[0].elapsed_time(events[1]) / 1000 if events else time.perf_counter() - t
        bad = np.flatnonzero(codes)
        if bad.size:
            code = int(codes[bad[0]])
            if code == -6:
                raise CacheGenFormatError(f"substream {int(bad[0])}: symbol out of range")
            raise CoderError(f"Triton decode failed: substream {int(bad[0])}: {describe(code)}")


def kv_meta(head_dim: int, *, rotary: bool, add_mean: bool, bf16: bool) -> dict[str, Any]:
    """``decode_kv_kernel``'s compile-time parameters (``triton_kernels.py``): the rotary pairing (``ROT`` 1: a
    pair in one round of 16, 2: ``R`` rounds apart in one lane), the mean, bfloat16 rounding."""
    r = max(1, head_dim // 32)
    rot = 0 if not rotary else (1 if 16 % head_dim == 0 else 2)
    return {"HEAD_DIM": head_dim, "ROT": rot, "R": 1 << (r - 1).bit_length(), "ADD_MEAN": add_mean, "BF16": bf16}


def gpu_options(streams_per_program: int) -> dict[str, Any]:
    """Compiler options of a GPU launch: a warp per two substreams of 16 lanes, no fused multiply-adds
    (``kv_core.h``: one rounding per operation)."""
    return {"num_warps": max(1, streams_per_program * 16 // 32), "enable_fp_fusion": False}


def _gpu_streams() -> int:
    value = int(os.environ.get("CACHEGEN_TRITON_STREAMS", GPU_STREAMS_PER_PROGRAM))
    if value < 1 or value & (value - 1):
        raise ValueError(f"CACHEGEN_TRITON_STREAMS must be a power of two, got {value}")
    return value


def _joined(payloads: Sequence[bytes | memoryview], n_streams: int) -> tuple[np.ndarray, np.ndarray]:
    """The payloads as one uint8 array and their offsets: a view when they lie one after the other in one buffer
    (a blob's substreams), else joined."""
    if len(payloads) != n_streams:
        raise CoderError(f"expected {n_streams} substreams, got {len(payloads)}")
    offsets = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum([len(p) for p in payloads], out=offsets[1:])
    arrays = [np.frombuffer(p, dtype=np.uint8) for p in payloads]
    at = [a.__array_interface__["data"][0] for a in arrays]
    if arrays and isinstance(payloads[0], memoryview) and all(at[i] + arrays[i].size == at[i + 1] for i in range(len(at) - 1)):
        base = np.frombuffer(payloads[0].obj, dtype=np.uint8)  # the buffer the first one is a view of
        lo = at[0] - base.__array_interface__["data"][0]
        if 0 <= lo and lo + int(offsets[-1]) <= base.size:
            return base[lo : lo + int(offsets[-1])], offsets
    return np.frombuffer(b"".join(payloads), dtype=np.uint8), offsets


@lru_cache(maxsize=None)
def triton_decoder(device: torch.device) -> TritonDecoder:
    """The shared decoder of ``device`` (the factory of ``registry.DEVICE_DECODERS``); ``BackendUnavailable`` if none."""
    return TritonDecoder(device)
