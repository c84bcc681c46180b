"""The native coder's C++ library: building, loading, errors and tables.

The C++ library is built when the package installs (``setup.py``, as the extension file
``cachegen_core._native``); a source checkout used without installing compiles it once
into the user cache with the system C++ compiler (``compile_into_cache``). The GPU decoder
(``triton_decoder.py``) is Triton, compiled at run time: nothing of it is built here. ``CACHEGEN_NATIVE_LIB`` names another build to load (an
AddressSanitizer build, say). The library is bound with ctypes, which releases the GIL
during every call. The byte format is documented in ``csrc/rans_core.h``.
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
from typing import Sequence

import numpy as np

from ..errors import CoderError
from ..paths import cache_dir
from .base import validate_freqs

CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
FORMAT_VERSION = 1
#: The byte format of ``csrc/rans_core.h``, recorded in every blob it codes.
CODER_NAME = f"native-rans16-v{FORMAT_VERSION}"
#: The entry points' signatures as bound below (``cg_api_version``): a library built from older sources is refused.
API_VERSION = 2
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


def describe(code: int) -> str:
    """What a status code of the library (``CG_ERR_*``) means."""
    return _ERRORS.get(int(code), f"error {int(code)}")


def compile_into_cache(source: str | Sequence[str], command: list[str]) -> Path:
    """Build ``csrc/<source>`` (one file or several) once into the user cache, keyed by the sources,
    every header of ``csrc/`` and the command."""
    sources = [CSRC / s for s in ([source] if isinstance(source, str) else source)]
    key = b"".join(p.read_bytes() for p in [*sources, *sorted(CSRC.glob("*.h"))]) + " ".join(command).encode()
    out = cache_dir("native") / f"lib{sources[0].stem}-{hashlib.blake2b(key, digest_size=8).hexdigest()}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        proc = subprocess.run([*command, *map(str, sources), "-I", str(CSRC), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{command[0]} failed: {proc.stderr[-2000:]}")
        tmp.replace(out)
    return out


#: The sources of the CPU library, and its compiler flags (as setup.py builds it).
CPU_SOURCES = ("rans_cpu.cpp", "kv_fused.cpp", "kv_encode.cpp")
CPU_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden", "-ffp-contract=off"]


def _library_path() -> Path:
    if os.environ.get("CACHEGEN_NATIVE_LIB"):
        return Path(os.environ["CACHEGEN_NATIVE_LIB"])
    spec = importlib.util.find_spec("cachegen_core._native")
    if spec is not None and spec.origin and Path(spec.origin).exists():
        return Path(spec.origin)
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None or not (CSRC / "rans_cpu.cpp").exists():
        raise RuntimeError("the native library is not built and no C++ compiler or sources are here")
    return compile_into_cache(CPU_SOURCES, [cxx, *CPU_FLAGS])


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    api = getattr(lib, "cg_api_version", None)
    if api is None or api() != API_VERSION:
        raise RuntimeError(
            f"the native library is a stale build (API {api() if api else 1}, this package binds {API_VERSION}): "
            "rebuild it with `pip install .` (or `make install`)"
        )
    signatures = {
        "cg_format_version": ([], i32),
        "cg_lanes": ([], i32),
        "cg_encode_bound": ([i64], i64),
        "cg_build_tables": ([p, i32, i32, i32, p, p], ctypes.c_int),
        "cg_encode": ([p, p, i32, p, i32, p, i32, i32, p, p, p, i32], ctypes.c_int),
        "cg_decode": ([p, p, i32, p, p, i32, p, p, i32, i32, i32, p, p, i32], ctypes.c_int),
        "cg_decode_components": ([p, p, i32, p, p, i32, p, p, i32, i32, i32, i32, i64, i32, p, p, p, i32], ctypes.c_int),
        "cg_decode_kv": (
            [p, p, i32, p, p, i32, p, p, i32, i32, i32, i32, i32, i32, i64, i32, p, p, p, p, p, p, i32, i64, i64, i64, i64, p, i32],
            ctypes.c_int,
        ),
        "cg_encode_chunk": ([p, p, p, p, i32, i32, i64, i32, i64, p, p, *[ctypes.c_float] * 3, i32, p, p, p, p, i64, p, p, p, i32], ctypes.c_int),
        "cg_torch_sums": ([p, i64, i64, i32, p, p], ctypes.c_int),
    }
    for fn, (args, res) in signatures.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = res
    if lib.cg_format_version() != FORMAT_VERSION:
        raise RuntimeError(f"native library speaks format {lib.cg_format_version()}, expected {FORMAT_VERSION}")
    return lib


def cpu_library() -> ctypes.CDLL:
    """The CPU library, loaded once; ``CoderError`` (remembered) when it cannot be had."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if _lib_error is None:
            try:
                _lib = _bind(ctypes.CDLL(str(_library_path())))
                return _lib
            except Exception as e:  # noqa: BLE001  no build, no compiler, a stale build: the registry picks another coder
                _lib_error = f"native coder unavailable: {e}"
        raise CoderError(_lib_error)


def load_error() -> str | None:
    """Why the CPU library cannot be loaded (building it into the cache if needed), or None when it loads."""
    try:
        cpu_library()
        return None
    except CoderError as e:
        return str(e)


def available() -> bool:
    """Whether the native CPU library can be loaded (building it into the cache if needed)."""
    return load_error() is None


def ptr(a: np.ndarray) -> int:
    """Address of an array's data, for a ctypes ``void*`` argument."""
    return a.ctypes.data


def join_payloads(payloads: Sequence[bytes], n_streams: int) -> tuple[np.ndarray, np.ndarray]:
    """All payloads in one buffer (never empty, so its pointer is valid) and their int64 offsets."""
    if len(payloads) != n_streams:
        raise CoderError(f"expected {n_streams} substreams, got {len(payloads)}")
    offsets = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum([len(p) for p in payloads], out=offsets[1:])
    buf = np.frombuffer(b"".join(payloads) + b"\0", dtype=np.uint8)
    return buf, offsets


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

    Measured on real and 7B-shaped chunks (docs/history/): finer lookups mean fewer
    bisection steps, coarser ones fewer cache misses when there are many tables.
    ``CACHEGEN_LUT_BITS`` overrides (for measurements).
    """
    if os.environ.get("CACHEGEN_LUT_BITS"):
        return int(os.environ["CACHEGEN_LUT_BITS"])
    return next((b for b in (12, 10) if n_tables << b <= LUT_BUDGET_BYTES), 8)


def build_tables(freqs: np.ndarray, lut_bits: int | None = None) -> CoderTables:
    """Validate ``freqs`` and convert it for the coder (once per table set: see ``cached_tables``)."""
    validate_freqs(freqs)
    freqs = np.ascontiguousarray(freqs)
    n, a = freqs.shape
    bits = lut_bits or lut_bits_for(n)
    info = np.empty((n, a), dtype=np.uint32)
    lut = np.empty((n, 1 << bits), dtype=np.uint8)
    err = cpu_library().cg_build_tables(ptr(freqs), n, a, bits, ptr(info), ptr(lut))
    if err:
        raise CoderError(f"native table build failed: {describe(err)}")
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
            for ref, address, shape, tables in self._entries:
                if ref() is freqs and (address, shape) == key:
                    return tables
        tables = build_tables(freqs)
        with self._lock:
            self._entries = [e for e in self._entries if e[0]() is not None][-(self.size - 1) :]
            self._entries.append((weakref.ref(freqs), *key, tables))
        return tables


_TABLES = _TableCache()


def cached_tables(freqs: np.ndarray) -> CoderTables:
    """The coder form of ``freqs``, validated and converted once per table set (CPU lookup resolution)."""
    return _TABLES.get(freqs)
