"""The native interleaved-rANS coder (``csrc/``): threaded C++ on the CPU, a CUDA decoder on the GPU.

The C++ library is built when the package installs (``setup.py``, as the extension file
``cachegen_core._native``); a source checkout used without installing compiles it once
into the user cache with the system C++ compiler. ``CACHEGEN_NATIVE_LIB`` names another
build to load (an AddressSanitizer build, say). The library is bound with ctypes, which
releases the GIL during every call. The byte format is documented in ``csrc/rans_core.h``.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import CoderError
from ..paths import cache_dir
from .base import StreamLayout, validate_freqs

if TYPE_CHECKING:
    import torch

CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
FORMAT_VERSION = 1
_ERRORS = {
    -1: "payload too short (truncated)",
    -2: "invalid initial coder state (corrupted)",
    -3: "trailing bytes after the last symbol",
    -4: "coder state did not return to its start (corrupted)",
    -5: "output buffer too small",
    -6: "symbol outside the alphabet",
    -7: "inconsistent arguments",
    -8: "invalid frequency table",
    -9: "out of memory or threads",
}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


def _describe(code: int) -> str:
    return _ERRORS.get(int(code), f"error {int(code)}")


def _compile_into_cache(source: str, command: list[str]) -> Path:
    """Build ``csrc/<source>`` once into the user cache (keyed by sources and command)."""
    src = CSRC / source
    key = src.read_bytes() + (CSRC / "rans_core.h").read_bytes() + " ".join(command).encode()
    out = cache_dir("native") / f"lib{src.stem}-{hashlib.blake2b(key, digest_size=8).hexdigest()}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        proc = subprocess.run([*command, str(src), "-I", str(CSRC), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{command[0]} failed: {proc.stderr[-2000:]}")
        tmp.replace(out)
    return out


def _library_path() -> Path:
    if os.environ.get("CACHEGEN_NATIVE_LIB"):
        return Path(os.environ["CACHEGEN_NATIVE_LIB"])
    spec = importlib.util.find_spec("cachegen_core._native")
    if spec is not None and spec.origin and Path(spec.origin).exists():
        return Path(spec.origin)
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None or not (CSRC / "rans_cpu.cpp").exists():
        raise RuntimeError("the native library is not built and no C++ compiler or sources are here")
    return _compile_into_cache("rans_cpu.cpp", [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-pthread"])


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    signatures = {
        "cg_format_version": ([], i32),
        "cg_lanes": ([], i32),
        "cg_encode_bound": ([i64], i64),
        "cg_build_tables": ([p, i32, i32, i32, p, p], ctypes.c_int),
        "cg_encode": ([p, p, i32, p, i32, p, i32, i32, p, p, p, i32], ctypes.c_int),
        "cg_decode": ([p, p, i32, p, p, i32, p, p, i32, i32, i32, p, p, i32], ctypes.c_int),
    }
    for fn, (args, res) in signatures.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = res
    if lib.cg_format_version() != FORMAT_VERSION:
        raise RuntimeError(f"native library speaks format {lib.cg_format_version()}, expected {FORMAT_VERSION}")
    return lib


def _library() -> ctypes.CDLL:
    """The CPU library, loaded once; ``CoderError`` (remembered) when it cannot be had."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if _lib_error is None:
            try:
                _lib = _bind(ctypes.CDLL(str(_library_path())))
                return _lib
            except Exception as e:  # no build, no compiler, a stale build: the reference coder takes over
                _lib_error = f"native coder unavailable: {e}"
        raise CoderError(_lib_error)


def available() -> bool:
    """Whether the native CPU library can be loaded (building it into the cache if needed)."""
    try:
        _library()
        return True
    except CoderError:
        return False


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


@dataclass(frozen=True)
class CoderTables:
    """A table set in the coder's own form: ``info`` (start | freq << 16) and the decoder's slot lookup."""

    info: np.ndarray  # uint32 (n_tables, alphabet)
    lut: np.ndarray  # uint8 (n_tables, 2**lut_bits)
    lut_bits: int

    @property
    def n_tables(self) -> int:
        return int(self.info.shape[0])

    @property
    def alphabet(self) -> int:
        return int(self.info.shape[1])


LUT_BUDGET_BYTES = 64 << 20


def lut_bits_for(n_tables: int) -> int:
    """CPU slot-lookup resolution: the finest of 12, 10, 8 bits whose lookups fit in 64 MiB.

    Measured on real and 7B-shaped chunks (docs/results.md): finer lookups mean fewer
    bisection steps, coarser ones fewer cache misses when there are many tables.
    ``CACHEGEN_LUT_BITS`` overrides (for measurements).
    """
    if os.environ.get("CACHEGEN_LUT_BITS"):
        return int(os.environ["CACHEGEN_LUT_BITS"])
    return next((b for b in (12, 10) if n_tables << b <= LUT_BUDGET_BYTES), 8)


def build_tables(freqs: np.ndarray, lut_bits: int | None = None) -> CoderTables:
    """Validate ``freqs`` and convert it for the coder (once per table set: see ``_TableCache``)."""
    validate_freqs(freqs)
    freqs = np.ascontiguousarray(freqs)
    n, a = freqs.shape
    bits = lut_bits or lut_bits_for(n)
    info = np.empty((n, a), dtype=np.uint32)
    lut = np.empty((n, 1 << bits), dtype=np.uint8)
    err = _library().cg_build_tables(_ptr(freqs), n, a, bits, _ptr(info), _ptr(lut))
    if err:
        raise CoderError(f"native table build failed: {_describe(err)}")
    return CoderTables(info, lut, bits)


class _TableCache:
    """Coder tables of the last few table sets, by identity of the ``freqs`` array.

    A profile's tables are reused by every chunk of its model, so they are converted once.
    Table arrays must therefore not be modified in place after coding with them.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[weakref.ref, int, tuple[int, ...], CoderTables]] = []
        self._lock = threading.Lock()

    def get(self, freqs: np.ndarray) -> CoderTables:
        if not isinstance(freqs, np.ndarray):
            raise CoderError("frequency tables must be a numpy array")
        key = (freqs.ctypes.data, freqs.shape)
        with self._lock:
            for ref, ptr, shape, tables in self._entries:
                if ref() is freqs and (ptr, shape) == key:
                    return tables
        tables = build_tables(freqs)
        with self._lock:
            self._entries = [e for e in self._entries if e[0]() is not None][-(self.size - 1) :]
            self._entries.append((weakref.ref(freqs), *key, tables))
        return tables


_TABLES = _TableCache()


def _check_symbols(symbols: np.ndarray, layout: StreamLayout) -> np.ndarray:
    if not isinstance(symbols, np.ndarray) or symbols.dtype != np.uint8 or symbols.ndim != 1:
        raise CoderError("symbols must be a flat uint8 numpy array")
    if symbols.shape[0] != layout.n_symbols:
        raise CoderError(f"symbols hold {symbols.shape[0]} entries, the layout {layout.n_symbols}")
    return np.ascontiguousarray(symbols)


def _join(payloads: Sequence[bytes], n_streams: int) -> tuple[np.ndarray, np.ndarray]:
    """All payloads in one buffer (never empty, so its pointer is valid) and their offsets."""
    if len(payloads) != n_streams:
        raise CoderError(f"expected {n_streams} substreams, got {len(payloads)}")
    offsets = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum([len(p) for p in payloads], out=offsets[1:])
    buf = np.frombuffer(b"".join(payloads) + b"\0", dtype=np.uint8)
    return buf, offsets


class NativeCoder:
    """Interleaved rANS (16 lanes, 16-bit tables) over substreams, threaded over substreams."""

    name = "native-rans16-v1"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads or os.cpu_count() or 1)
        self._lib = _library()
        self.last_cuda_kernel_s: float | None = None

    def tables(self, freqs: np.ndarray) -> CoderTables:
        """The coder form of ``freqs`` (validated and cached; see ``_TableCache``)."""
        return _TABLES.get(freqs)

    def encode(self, symbols: np.ndarray, layout: StreamLayout, freqs: np.ndarray) -> list[bytes]:
        """Code ``symbols`` into one byte string per substream (format: ``csrc/rans_core.h``)."""
        t = self.tables(freqs)
        layout.validate(t.n_tables)
        symbols = _check_symbols(symbols, layout)
        counts = layout.counts()
        caps = np.where(counts > 0, 2 * counts + 4 * self._lib.cg_lanes(), 0)
        out_off = np.zeros(layout.n_streams + 1, dtype=np.int64)
        np.cumsum(caps, out=out_off[1:])
        out = np.empty(max(1, int(out_off[-1])), dtype=np.uint8)
        sizes = np.zeros(max(1, layout.n_streams), dtype=np.int64)
        tids = np.ascontiguousarray(layout.table_ids)
        offsets = np.ascontiguousarray(layout.offsets)
        err = self._lib.cg_encode(
            _ptr(symbols), _ptr(offsets), layout.n_streams, _ptr(tids), layout.period,
            _ptr(t.info), t.n_tables, t.alphabet, _ptr(out), _ptr(out_off), _ptr(sizes), self.threads,
        )  # fmt: skip
        if err:
            raise CoderError(f"native encode failed: {_describe(err)}")
        return [out[a : a + n].tobytes() for a, n in zip(out_off[:-1].tolist(), sizes.tolist())]

    def decode(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray) -> np.ndarray:
        """Decode one byte string per substream into the flat uint8 symbols; ``CoderError`` on bad input."""
        out = np.empty(layout.n_symbols, dtype=np.uint8)
        self.decode_into(payloads, layout, freqs, out)
        return out

    def decode_into(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray, out: np.ndarray) -> None:
        """``decode`` into a caller's contiguous uint8 array of ``layout.n_symbols`` entries."""
        t = self.tables(freqs)
        layout.validate(t.n_tables)
        if not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.shape == (layout.n_symbols,)):
            raise CoderError(f"output must be a uint8 array of shape ({layout.n_symbols},)")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise CoderError("output array must be contiguous and writeable")
        buf, in_off = _join(payloads, layout.n_streams)
        status = np.zeros(max(1, layout.n_streams), dtype=np.int32)
        tids = np.ascontiguousarray(layout.table_ids)
        offsets = np.ascontiguousarray(layout.offsets)
        target = out if out.size else np.empty(1, dtype=np.uint8)
        err = self._lib.cg_decode(
            _ptr(buf), _ptr(in_off), layout.n_streams, _ptr(offsets), _ptr(tids), layout.period,
            _ptr(t.info), _ptr(t.lut), t.lut_bits, t.n_tables, t.alphabet, _ptr(target), _ptr(status), self.threads,
        )  # fmt: skip
        if err:
            bad = np.flatnonzero(status[: layout.n_streams])
            where = f"substream {int(bad[0])}: " if bad.size else ""
            raise CoderError(f"native decode failed: {where}{_describe(status[bad[0]] if bad.size else err)}")

    def decode_cuda(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray, device: Any = "cuda") -> "torch.Tensor":
        """Decode on the GPU: the flat uint8 symbols as a CUDA tensor, equal to ``decode``'s.

        Needs a CUDA device and ``nvcc`` (the kernel is compiled at first use). The time of
        the last kernel alone is kept in ``last_cuda_kernel_s``.
        """
        from . import native_cuda  # noqa: PLC0415

        return native_cuda.decode(self, payloads, layout, freqs, device)
