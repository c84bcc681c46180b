"""The CUDA decoder of the native byte format (``csrc/rans_cuda.cu``), built with nvcc at first use.

A ``SymbolDecoder`` for ``cuda`` devices, chosen through ``coders.get_decoder``; the CPU
path never needs it. The kernel is compiled once into the user cache (``nvcc -O3
-shared``; ``CACHEGEN_NVCC_FLAGS`` adds flags) and bound with ctypes; it takes device
pointers from torch tensors. Tables are converted by the CPU library (``native_lib``)
and copied to each device once per table set.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import CacheGenFormatError, CoderError
from .base import BackendUnavailable, StreamLayout
from .native_lib import CODER_NAME, CoderTables, build_tables, cached_tables, compile_into_cache, describe, join_payloads, load_error

if TYPE_CHECKING:
    import torch

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
# Device copies of coder tables, by (id of the host CoderTables, device, lookup bits): profiles are reused.
_device_tables: dict[tuple[int, str, int], tuple[weakref.ref, Any]] = {}


def nvcc_command() -> list[str]:
    """The nvcc command line that builds the decoder library (for the GPU of this machine)."""
    extra = shlex.split(os.environ.get("CACHEGEN_NVCC_FLAGS", ""))
    # no fused multiply-add: the fused KV kernel rounds every product and sum as the CPU and torch do
    return ["nvcc", "-O3", "-arch=native", "--fmad=false", "-shared", "-Xcompiler", "-fPIC", *extra]


def unavailable_reason(device: Any = "cuda") -> str | None:
    """Why this process cannot decode on ``device`` (no CUDA, no nvcc, no CPU library), or None.

    Cheap: builds nothing (``cuda_library`` does, at most once).
    """
    import torch  # noqa: PLC0415

    dev = torch.device(device)
    if dev.type != "cuda":
        return f"the CUDA decoder needs a CUDA device, got {dev}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"no CUDA device {dev.index} (torch sees {torch.cuda.device_count()})"
    if shutil.which("nvcc") is None:
        return "the CUDA decoder needs nvcc on PATH"
    return load_error()  # tables are converted by the CPU library


def cuda_library() -> ctypes.CDLL:
    """The compiled CUDA decoder; ``BackendUnavailable`` when nvcc is missing or the build fails."""
    global _lib
    with _lock:
        if _lib is None:
            if shutil.which("nvcc") is None:
                raise BackendUnavailable("the CUDA decoder needs nvcc on PATH")
            try:
                lib = ctypes.CDLL(str(compile_into_cache("rans_cuda.cu", nvcc_command())))
            except (OSError, RuntimeError) as e:
                raise BackendUnavailable(f"cannot build the CUDA decoder: {e}") from e
            p, i32 = ctypes.c_void_p, ctypes.c_int32
            lib.cg_cuda_decode.argtypes = [p, p, i32, p, p, i32, p, p, i32, i32, p, p, p, p, i32]
            lib.cg_cuda_decode.restype = ctypes.c_int
            i64 = ctypes.c_int64
            lib.cg_cuda_decode_kv.argtypes = [p, p, i32, p, p, i32, p, p, i32, i32, p, i32, i32, i32, i32, p, p, p, p, p, p,
                                              i32, i64, i64, i64, i64, p, p, i32]  # fmt: skip
            lib.cg_cuda_decode_kv.restype = ctypes.c_int
            _lib = lib
        return _lib


def gpu_lut_bits(n_tables: int) -> int:
    """GPU slot-lookup resolution: 12 bits for few tables, 8 for many (measured on an H100:
    with per-channel tables, the smaller lookups' cache footprint wins over the extra
    bisection steps). ``CACHEGEN_CUDA_LUT_BITS`` overrides."""
    if os.environ.get("CACHEGEN_CUDA_LUT_BITS"):
        return int(os.environ["CACHEGEN_CUDA_LUT_BITS"])
    return 12 if n_tables <= 1024 else 8


def _tables_on(host: CoderTables, freqs: np.ndarray, dev: "torch.device") -> tuple[CoderTables, "torch.Tensor", "torch.Tensor"]:
    """GPU copies of a table set (converted once per table set and device, like the CPU's)."""
    import torch  # noqa: PLC0415

    bits = gpu_lut_bits(host.n_tables)
    key = (id(host), str(dev), bits)
    hit = _device_tables.get(key)
    if hit is not None and hit[0]() is host:
        return hit[1]
    tables = host if bits == host.lut_bits else build_tables(freqs, bits)
    entry = (tables, torch.from_numpy(tables.info).to(dev), torch.from_numpy(tables.lut).to(dev))
    for k in [k for k, v in _device_tables.items() if v[0]() is None]:
        del _device_tables[k]
    _device_tables[key] = (weakref.ref(host), entry)
    return entry


class CudaDecoder:
    """Decodes ``native-rans16-v1`` substreams on one CUDA device, one warp per substream.

    Construction fails with ``BackendUnavailable`` when the device, nvcc or the libraries
    are missing (building the kernel at first use). The time of the last kernel alone is
    kept in ``last_kernel_s``.
    """

    name = CODER_NAME

    def __init__(self, device: Any = "cuda") -> None:
        import torch  # noqa: PLC0415

        reason = unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailable(f"cannot decode {CODER_NAME} on {device}: {reason}")
        self._lib = cuda_library()
        self.device = torch.device(device)
        self.last_kernel_s: float | None = None

    def decode_symbols(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray) -> "torch.Tensor":
        """The flat uint8 symbols as a tensor on this decoder's device, equal to the CPU decoder's."""
        import torch  # noqa: PLC0415

        out = torch.empty(max(1, layout.n_symbols), dtype=torch.uint8, device=self.device)
        self._launch(payloads, layout, freqs, lambda args: self._lib.cg_cuda_decode(*args[:11], out.data_ptr(), *args[11:]))
        return out[: layout.n_symbols]

    @staticmethod
    def fuses(head_dim: int, rotary: bool) -> bool:
        """Whether ``decode_kv`` handles head vectors of ``head_dim`` (keys rotated or not): the kernel's lanes
        own every 16th element, and a rotary pair must be one lane's (``csrc/rans_cuda.cu``)."""
        return head_dim % 16 == 0 and (not rotary or (head_dim % 32 == 0 and head_dim <= 256))

    def decode_kv(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray, *, heads: int, head_dim: int,
                  min_symbol: int, step: "torch.Tensor", mean: "torch.Tensor", cos_sin: tuple["torch.Tensor", "torch.Tensor"] | None,
                  keys: "torch.Tensor", values: "torch.Tensor", out_dtype: int, first_token: int) -> None:  # fmt: skip
        """Decode the substreams and write the KV of their tokens into ``keys`` and ``values`` (device tensors of
        one dtype, code ``out_dtype`` of ``csrc/kv_core.h``'s ``CG_OUT_*``, and one stride, ``(layers, heads,
        tokens, head_dim)``) from token ``first_token``: the CPU
        library's ``cg_decode_kv`` in one kernel (``csrc/kv_core.h``). ``step``, ``mean``: ``(2, layers, heads,
        head_dim)``; ``cos_sin``: ``(coded tokens, head_dim)`` each, or None (keys stored as they are)."""
        import torch  # noqa: PLC0415

        if not self.fuses(head_dim, cos_sin is not None) or keys.stride() != values.stride() or keys.stride(3) != 1:
            raise CoderError(f"the fused CUDA decoder cannot write head vectors of {head_dim} into these tensors")
        dev = self.device
        st, mu = (x.to(device=dev, dtype=torch.float32).contiguous() for x in (step, mean))
        cs = [x.to(device=dev, dtype=torch.float32).contiguous() for x in cos_sin] if cos_sin is not None else []
        rotary = (cs[0].data_ptr(), cs[1].data_ptr()) if cs else (None, None)
        layers = keys.shape[0]

        def launch(args: list[Any]) -> int:
            return self._lib.cg_cuda_decode_kv(
                *args[:11], layers, heads, head_dim, min_symbol, st.data_ptr(), mu.data_ptr(), *rotary, keys.data_ptr(),
                values.data_ptr(), out_dtype, keys.stride(0), keys.stride(1), keys.stride(2), first_token, *args[11:],
            )  # fmt: skip

        self._launch(payloads, layout, freqs, launch)

    def _launch(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray, kernel: Any) -> None:
        """Copy the payloads and layout to the device, run ``kernel`` (given the shared arguments: the inputs, then
        status, stream and block size) and check every substream's status."""
        import torch  # noqa: PLC0415

        host_tables = cached_tables(freqs)
        layout.validate(host_tables.n_tables)
        joined, in_off = join_payloads(payloads, layout.n_streams)
        dev = self.device
        tables, info, lut = _tables_on(host_tables, freqs, dev)
        order = np.argsort(-layout.counts(), kind="stable").astype(np.int32)  # longest first: halves of a warp pair up
        buf = torch.from_numpy(joined.copy()).pin_memory().to(dev, non_blocking=True)
        small = [torch.from_numpy(a).to(dev) for a in (in_off, np.ascontiguousarray(layout.offsets), np.ascontiguousarray(layout.table_ids), order)]
        status = torch.zeros(max(1, layout.n_streams), dtype=torch.int32, device=dev)
        stream = torch.cuda.current_stream(dev)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        err = kernel([
            buf.data_ptr(), small[0].data_ptr(), layout.n_streams, small[1].data_ptr(), small[2].data_ptr(), layout.period,
            info.data_ptr(), lut.data_ptr(), tables.lut_bits, tables.alphabet, small[3].data_ptr(),
            status.data_ptr(), ctypes.c_void_p(stream.cuda_stream), int(os.environ.get("CACHEGEN_CUDA_BLOCK", "64")),
        ])  # fmt: skip
        stop.record(stream)
        if err:
            raise CoderError(f"CUDA decoder launch failed with cudaError {err}")
        codes = status[: layout.n_streams].cpu().numpy()  # synchronises
        self.last_kernel_s = start.elapsed_time(stop) / 1000
        bad = np.flatnonzero(codes)
        if bad.size:
            code = int(codes[bad[0]])
            if code == -6:
                raise CacheGenFormatError(f"substream {int(bad[0])}: symbol out of range")
            raise CoderError(f"CUDA decode failed: substream {int(bad[0])}: {describe(code)}")


def timed_decode(decoder: CudaDecoder, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray) -> tuple["torch.Tensor", float]:
    """``decoder.decode_symbols`` and its wall time including the copy of the payloads to the GPU."""
    import torch  # noqa: PLC0415

    torch.cuda.synchronize(decoder.device)
    t = time.perf_counter()
    out = decoder.decode_symbols(payloads, layout, freqs)
    torch.cuda.synchronize(decoder.device)
    return out, time.perf_counter() - t
