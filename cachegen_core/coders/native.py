"""The native interleaved-rANS coder (``csrc/``): threaded C++ on the CPU, a CUDA decoder on the GPU.

The C++ library is built when the package installs (``setup.py``); if that build is
missing (a source checkout used without installing), it is compiled once into the user
cache with the system C++ compiler. It is bound with ctypes, which releases the GIL
during every call, so decoding runs in parallel with Python threads too.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import subprocess
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import CoderError
from .base import StreamLayout, validate_freqs

CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
_ERRORS = {
    -1: "payload too short (truncated)",
    -2: "invalid initial coder state (corrupted)",
    -3: "trailing bytes after the last symbol",
    -4: "coder state did not return to its start (corrupted)",
    -5: "output buffer too small",
    -6: "symbol outside the alphabet",
    -7: "inconsistent arguments",
}
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lock = threading.Lock()


def _cache_dir() -> Path:
    if os.environ.get("CACHEGEN_CACHE_DIR"):
        return Path(os.environ["CACHEGEN_CACHE_DIR"]) / "native"
    from platformdirs import user_cache_dir  # noqa: PLC0415

    return Path(user_cache_dir("langchain-cachegen")) / "native"


def _compile_into_cache(source: str, command: list[str]) -> Path:
    """Build ``csrc/<source>`` into the user cache once (keyed by the sources' hash) with ``command``."""
    src = CSRC / source
    digest = hashlib.blake2b(src.read_bytes() + (CSRC / "rans_core.h").read_bytes(), digest_size=8).hexdigest()
    out = _cache_dir() / f"lib{src.stem}-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        proc = subprocess.run([*command, str(src), "-I", str(CSRC), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{command[0]} failed: {proc.stderr[-2000:]}")
        tmp.replace(out)
    return out


def _library() -> ctypes.CDLL:
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise CoderError(_lib_error)
        try:
            spec = importlib.util.find_spec("cachegen_core._native")
            path = Path(spec.origin) if spec and spec.origin else None
            if path is None or not path.exists():
                path = _compile_into_cache("rans_cpu.cpp", [os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-shared", "-fPIC", "-pthread"])
            lib = ctypes.CDLL(str(path))
        except Exception as e:  # no compiler, no build: the reference coder takes over
            _lib_error = f"native coder unavailable: {e}"
            raise CoderError(_lib_error) from e
        p = ctypes.c_void_p
        i32, i64, u32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32
        lib.cg_encode.argtypes = [p, p, i32, p, i32, p, u32, p, p, p, i32]
        lib.cg_encode.restype = ctypes.c_int
        lib.cg_decode.argtypes = [p, p, i32, p, p, i32, p, u32, p, p, i32]
        lib.cg_decode.restype = ctypes.c_int
        lib.cg_encode_bound.argtypes = [i64]
        lib.cg_encode_bound.restype = i64
        lib.cg_lanes.restype = i32
        _lib = lib
        return lib


def available() -> bool:
    """Whether the native CPU library can be loaded (building it into the cache if needed)."""
    try:
        _library()
        return True
    except CoderError:
        return False


def cdf_tables(freqs: np.ndarray) -> np.ndarray:
    """uint32 ``(n_tables, alphabet + 1)`` cumulative frequencies, starting at 0."""
    cdf = np.zeros((freqs.shape[0], freqs.shape[1] + 1), dtype=np.uint32)
    np.cumsum(freqs, axis=1, dtype=np.uint32, out=cdf[:, 1:])
    return cdf


_cuda_lib: ctypes.CDLL | None = None


def _cuda_library() -> ctypes.CDLL:
    """The CUDA decoder, compiled with nvcc at first use (only where nvcc and a GPU exist)."""
    global _cuda_lib
    with _lock:
        if _cuda_lib is None:
            import shutil  # noqa: PLC0415

            if shutil.which("nvcc") is None:
                raise CoderError("the CUDA decoder needs nvcc on PATH")
            path = _compile_into_cache("rans_cuda.cu", ["nvcc", "-O3", "-arch=native", "-shared", "-Xcompiler", "-fPIC"])
            lib = ctypes.CDLL(str(path))
            p, i32, u32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32
            lib.cg_cuda_decode.argtypes = [p, p, i32, p, p, i32, p, u32, p, p, p]
            lib.cg_cuda_decode.restype = ctypes.c_int
            _cuda_lib = lib
        return _cuda_lib


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class NativeCoder:
    """Interleaved rANS (16 lanes, 16-bit tables) over substreams, threaded over substreams."""

    name = "native-rans16-v1"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or os.cpu_count() or 1
        self._lib = _library()
        self._cdf_cache: tuple[np.ndarray, np.ndarray] | None = None

    def _cdf(self, freqs: np.ndarray) -> np.ndarray:
        cached = self._cdf_cache
        if cached is not None and cached[0] is freqs:
            return cached[1]
        validate_freqs(freqs)
        cdf = cdf_tables(freqs)
        self._cdf_cache = (freqs, cdf)
        return cdf

    def encode(self, symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray) -> list[bytes]:
        cdf = self._cdf(freqs)
        layout.validate(freqs.shape[0])
        if symbols.dtype != np.uint8 or symbols.ndim != 1 or symbols.shape[0] != layout.n_symbols:
            raise CoderError("symbols must be a flat uint8 array matching the layout")
        symbols = np.ascontiguousarray(symbols)
        counts = layout.counts()
        caps = np.where(counts > 0, 2 * counts + 4 * self._lib.cg_lanes(), 0)
        out_off = np.zeros(layout.n_streams + 1, dtype=np.int64)
        np.cumsum(caps, out=out_off[1:])
        out = np.empty(int(out_off[-1]), dtype=np.uint8)
        sizes = np.zeros(layout.n_streams, dtype=np.int64)
        tids = np.ascontiguousarray(layout.table_ids)
        err = self._lib.cg_encode(
            _ptr(symbols), _ptr(layout.offsets), layout.n_streams, _ptr(tids), layout.period,
            _ptr(cdf), freqs.shape[1], _ptr(out), _ptr(out_off), _ptr(sizes), self.threads,
        )  # fmt: skip
        if err:
            raise CoderError(f"native encode failed: {_ERRORS.get(err, err)}")
        return [out[a : a + n].tobytes() for a, n in zip(out_off[:-1].tolist(), sizes.tolist())]

    def decode(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray) -> np.ndarray:
        cdf = self._cdf(freqs)
        layout.validate(freqs.shape[0])
        if len(payloads) != layout.n_streams:
            raise CoderError(f"expected {layout.n_streams} substreams, got {len(payloads)}")
        buf = np.frombuffer(b"".join(payloads), dtype=np.uint8)
        in_off = np.zeros(layout.n_streams + 1, dtype=np.int64)
        np.cumsum([len(p) for p in payloads], out=in_off[1:])
        out = np.empty(layout.n_symbols, dtype=np.uint8)
        status = np.zeros(layout.n_streams, dtype=np.int32)
        tids = np.ascontiguousarray(layout.table_ids)
        if buf.size == 0:
            buf = np.zeros(1, dtype=np.uint8)  # a valid pointer even when every stream is empty
        err = self._lib.cg_decode(
            _ptr(buf), _ptr(in_off), layout.n_streams, _ptr(layout.offsets), _ptr(tids), layout.period,
            _ptr(cdf), freqs.shape[1], _ptr(out), _ptr(status), self.threads,
        )  # fmt: skip
        if err:
            bad = int(np.flatnonzero(status)[0])
            raise CoderError(f"substream {bad}: {_ERRORS.get(int(status[bad]), int(status[bad]))}")
        return out

    def decode_cuda(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray, device: str = "cuda") -> "torch.Tensor":
        """Decode on the GPU, one warp per substream: same bytes, same symbols as ``decode``.

        Returns the flat uint8 symbols as a CUDA tensor (the dequantisation that follows
        runs on the GPU too).
        """
        import torch  # noqa: PLC0415

        lib = _cuda_library()
        cdf = self._cdf(freqs)
        layout.validate(freqs.shape[0])
        if len(payloads) != layout.n_streams:
            raise CoderError(f"expected {layout.n_streams} substreams, got {len(payloads)}")
        dev = torch.device(device)
        key = (id(freqs), dev)
        if getattr(self, "_gpu_cdf_key", None) != key:
            self._gpu_cdf = torch.from_numpy(cdf).to(dev)
            self._gpu_cdf_key = key
        joined = b"".join(payloads) or b"\0"
        buf = torch.frombuffer(bytearray(joined), dtype=torch.uint8).to(dev, non_blocking=True)
        in_off = torch.zeros(layout.n_streams + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([len(p) for p in payloads], dtype=torch.int64), 0, out=in_off[1:])
        in_off = in_off.to(dev)
        sym_off = torch.from_numpy(layout.offsets).to(dev)
        tids = torch.from_numpy(np.ascontiguousarray(layout.table_ids)).to(dev)
        out = torch.empty(layout.n_symbols, dtype=torch.uint8, device=dev)
        status = torch.zeros(layout.n_streams, dtype=torch.int32, device=dev)
        stream = torch.cuda.current_stream(dev).cuda_stream
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        err = lib.cg_cuda_decode(
            buf.data_ptr(), in_off.data_ptr(), layout.n_streams, sym_off.data_ptr(), tids.data_ptr(), layout.period,
            self._gpu_cdf.data_ptr(), freqs.shape[1], out.data_ptr(), status.data_ptr(), stream,
        )  # fmt: skip
        stop.record()
        if err:
            raise CoderError(f"CUDA launch failed with error {err}")
        stop.synchronize()
        self.last_cuda_kernel_s = start.elapsed_time(stop) / 1000
        bad = torch.nonzero(status).flatten()
        if bad.numel():
            s = int(bad[0])
            raise CoderError(f"substream {s}: {_ERRORS.get(int(status[s]), int(status[s]))}")
        return out
