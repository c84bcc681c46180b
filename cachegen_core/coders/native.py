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


def _compile_into_cache() -> Path:
    """Build the CPU library from ``csrc/`` into the user cache (keyed by the sources' hash)."""
    from platformdirs import user_cache_dir  # noqa: PLC0415

    src = CSRC / "rans_cpu.cpp"
    digest = hashlib.blake2b((src.read_bytes() + (CSRC / "rans_core.h").read_bytes()), digest_size=8).hexdigest()
    out = Path(user_cache_dir("langchain-cachegen")) / "native" / f"libcachegen_rans-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cxx = os.environ.get("CXX", "c++")
        subprocess.run([cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", str(src), "-o", str(tmp)], check=True, capture_output=True)
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
                path = _compile_into_cache()
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
