"""GPU side of the native coder: the CUDA decoder of ``csrc/rans_cuda.cu``, built with nvcc at first use.

Only imported by ``NativeCoder.decode_cuda``; the CPU path never needs CUDA. The kernel
is compiled once into the user cache (``nvcc -O3 -shared``; ``CACHEGEN_NVCC_FLAGS`` adds
flags) and bound with ctypes; it takes device pointers from torch tensors.
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

from ..errors import CoderError
from .base import StreamLayout
from .native import CoderTables, _compile_into_cache, _describe, build_tables

if TYPE_CHECKING:
    import torch

    from .native import NativeCoder

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
# Device copies of coder tables, by (id of the host CoderTables, device): profiles are reused.
_device_tables: dict[tuple[int, str, int], tuple[weakref.ref, Any]] = {}


def nvcc_command() -> list[str]:
    """The nvcc command line that builds the decoder library (for the GPU of this machine)."""
    extra = shlex.split(os.environ.get("CACHEGEN_NVCC_FLAGS", ""))
    return ["nvcc", "-O3", "-arch=native", "-shared", "-Xcompiler", "-fPIC", *extra]


def library() -> ctypes.CDLL:
    """The compiled CUDA decoder; ``CoderError`` when nvcc is missing or the build fails."""
    global _lib
    with _lock:
        if _lib is None:
            if shutil.which("nvcc") is None:
                raise CoderError("the CUDA decoder needs nvcc on PATH")
            try:
                lib = ctypes.CDLL(str(_compile_into_cache("rans_cuda.cu", nvcc_command())))
            except (OSError, RuntimeError) as e:
                raise CoderError(f"cannot build the CUDA decoder: {e}") from e
            p, i32 = ctypes.c_void_p, ctypes.c_int32
            lib.cg_cuda_decode.argtypes = [p, p, i32, p, p, i32, p, p, i32, i32, p, p, p, p, i32]
            lib.cg_cuda_decode.restype = ctypes.c_int
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


def decode(coder: "NativeCoder", payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray, device: Any = "cuda") -> "torch.Tensor":
    """Decode on ``device``: the flat uint8 symbols as a CUDA tensor (see ``NativeCoder.decode_cuda``)."""
    import torch  # noqa: PLC0415

    lib = library()
    host = coder.tables(freqs)
    layout.validate(host.n_tables)
    if len(payloads) != layout.n_streams:
        raise CoderError(f"expected {layout.n_streams} substreams, got {len(payloads)}")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise CoderError(f"decode_cuda needs a CUDA device, got {dev}")
    tables, info, lut = _tables_on(host, freqs, dev)
    counts = layout.counts()
    lengths = np.fromiter((len(p) for p in payloads), dtype=np.int64, count=layout.n_streams)
    in_off = np.zeros(layout.n_streams + 1, dtype=np.int64)
    np.cumsum(lengths, out=in_off[1:])
    order = np.argsort(-counts, kind="stable").astype(np.int32)  # longest first: halves of a warp pair up
    host = torch.from_numpy(np.frombuffer(b"".join(payloads) + b"\0", dtype=np.uint8).copy())
    buf = host.pin_memory().to(dev, non_blocking=True) if torch.cuda.is_available() else host.to(dev)
    small = [torch.from_numpy(a).to(dev) for a in (in_off, np.ascontiguousarray(layout.offsets), np.ascontiguousarray(layout.table_ids), order)]
    out = torch.empty(max(1, layout.n_symbols), dtype=torch.uint8, device=dev)
    status = torch.zeros(max(1, layout.n_streams), dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream(dev)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    err = lib.cg_cuda_decode(
        buf.data_ptr(), small[0].data_ptr(), layout.n_streams, small[1].data_ptr(), small[2].data_ptr(), layout.period,
        info.data_ptr(), lut.data_ptr(), tables.lut_bits, tables.alphabet, small[3].data_ptr(), out.data_ptr(),
        status.data_ptr(), ctypes.c_void_p(stream.cuda_stream), int(os.environ.get("CACHEGEN_CUDA_BLOCK", "64")),
    )  # fmt: skip
    stop.record(stream)
    if err:
        raise CoderError(f"CUDA decoder launch failed with cudaError {err}")
    codes = status[: layout.n_streams].cpu().numpy()  # synchronises
    coder.last_cuda_kernel_s = start.elapsed_time(stop) / 1000
    bad = np.flatnonzero(codes)
    if bad.size:
        raise CoderError(f"CUDA decode failed: substream {int(bad[0])}: {_describe(codes[bad[0]])}")
    return out[: layout.n_symbols]


def timed_decode(coder: "NativeCoder", payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray, device: Any = "cuda") -> tuple["torch.Tensor", float]:
    """``decode`` and its wall time including the copy of the payloads to the GPU."""
    import torch  # noqa: PLC0415

    torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = decode(coder, payloads, layout, freqs, device)
    torch.cuda.synchronize(device)
    return out, time.perf_counter() - t
