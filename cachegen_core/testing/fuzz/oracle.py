"""The oracle: run one input under a time and allocation watch and classify what happened.

Every input must end in a decoded ``KVCache`` or ``CacheGenFormatError``: any other
exception is a *crash*, running past ``hang_s`` a *hang*, a ``tracemalloc`` peak above
the input's bound an *overalloc*, and a decoded KV that contradicts its header or
(for raw mutations) its seed is *wrong_kv_accepted*.
"""

from __future__ import annotations

import signal
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.codec.format import unpack
from cachegen_core.kv import KVCache

from .blobs import header_of
from .seeds import LIMITS, MAX_TOKENS


OUTCOMES = ("decoded", "rejected", "crash", "hang", "overalloc", "wrong_kv_accepted", "forged_accepted")


class HardTimeout(BaseException):
    """Raised by the SIGALRM handler inside a target that runs past the hard time limit."""


@contextmanager
def hard_deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (main thread only; elsewhere only measured)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise HardTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def validated_elements(header: Any, max_tokens: int = MAX_TOKENS) -> int:
    """KV elements a header may legitimately make the decoder produce (0 unless its shape passes decode's checks)."""
    shape = header.get("shape") if isinstance(header, dict) else None
    if not (isinstance(shape, list) and len(shape) == 4 and all(type(d) is int and d >= 1 for d in shape)):
        return 0
    layers, heads, tokens, dim = shape
    if max(layers, heads, dim) > 1 << 14 or tokens > max_tokens:
        return 0
    return 2 * layers * heads * tokens * dim


def alloc_bound(data: bytes, max_tokens: int = MAX_TOKENS) -> int:
    """Bytes the decoder may allocate (traced) for ``data``: a few copies of the blob, plus a fixed
    overhead, plus 48 bytes per KV element of a shape that passes decode's own checks (symbols,
    table ids, offsets...). Without a valid shape nothing may scale beyond the blob's size."""
    try:
        elements = validated_elements(header_of(data), max_tokens)
    except Exception:  # noqa: BLE001
        elements = 0
    return 8 * len(data) + (8 << 20) + 48 * elements


@dataclass
class Result:
    """The outcome of one input."""

    outcome: str
    detail: str = ""
    seconds: float = 0.0
    peak_bytes: int = 0
    bound_bytes: int = 0


def _same_kv(a: KVCache, b: KVCache) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def inconsistency(kv: KVCache, header: dict[str, Any], max_tokens: int) -> str:
    """Why a decoded KV contradicts its own header ('' if it does not)."""
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if list(kv.shape) != header.get("shape"):
        return f"decoded shape {kv.shape} != header shape {header.get('shape')}"
    if dtypes.get(header.get("dtype")) != kv.dtype:  # type: ignore[arg-type]
        return f"decoded dtype {kv.dtype} != header dtype {header.get('dtype')}"
    if kv.num_tokens > max_tokens:
        return f"{kv.num_tokens} tokens > max_tokens"
    if not (torch.isfinite(kv.keys).all() and torch.isfinite(kv.values).all()):
        return "non-finite KV accepted"
    return ""


def run_one(fn: Callable[[], Any], bound: int, hang_s: float, hard_s: float, trace: bool) -> tuple[Any, BaseException | None, Result]:
    """Run ``fn`` under the time and allocation watch; return (value, exception, partial result)."""
    started = trace and not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    if trace:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
    t = time.perf_counter()
    value, exc = None, None
    try:
        with hard_deadline(hard_s):
            value = fn()
    except HardTimeout as e:
        exc = e
    except Exception as e:  # noqa: BLE001  classified by the caller
        exc = e
    dt = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1] - base if trace else 0
    if started:
        tracemalloc.stop()
    res = Result("", seconds=dt, peak_bytes=peak, bound_bytes=bound)
    if isinstance(exc, HardTimeout) or dt > hang_s:
        res.outcome, res.detail = "hang", f"{dt:.2f}s"
    elif trace and peak > bound:
        res.outcome, res.detail = "overalloc", f"traced peak {peak} B > bound {bound} B"
    return value, exc, res


def check_container(data: bytes, *, hang_s: float = 2.0, hard_s: float = 20.0, trace: bool = True) -> Result:
    """``format.unpack``: a ``Container`` or ``CacheGenFormatError``, quickly, within the bound."""
    _, exc, res = run_one(lambda: unpack(data, LIMITS), 8 * len(data) + (4 << 20), hang_s, hard_s, trace)
    if res.outcome:
        return res
    if exc is None:
        res.outcome = "decoded"
    elif isinstance(exc, CacheGenFormatError):
        res.outcome = "rejected"
    else:
        res.outcome, res.detail = "crash", f"{type(exc).__name__}: {exc}"[:300]
    return res


def check_codec(
    codec: KVCodec,
    data: bytes,
    *,
    expected: KVCache | None,
    forged: bool,
    hang_s: float = 2.0,
    hard_s: float = 20.0,
    trace: bool = True,
) -> Result:
    """``KVCodec.decode``: KV or ``CacheGenFormatError``; a decoded KV is judged against ``expected``.

    ``expected``: the KV the unmodified seed decodes to, or None when ``data`` is a seed
    blob itself (then ``expected`` is compared too) -- see the package doc for the rules.
    """
    kv, exc, res = run_one(lambda: codec.decode(data), alloc_bound(data, codec.max_tokens), hang_s, hard_s, trace)
    if res.outcome:
        return res
    if exc is not None:
        if isinstance(exc, CacheGenFormatError):
            res.outcome = "rejected"
        else:
            res.outcome, res.detail = "crash", f"{type(exc).__name__}: {exc}"[:300]
        return res
    if not isinstance(kv, KVCache):
        res.outcome, res.detail = "crash", f"decode returned {type(kv).__name__}"
        return res
    why = inconsistency(kv, header_of(data), codec.max_tokens)
    if why:
        res.outcome, res.detail = "wrong_kv_accepted", why
    elif expected is not None and not _same_kv(kv, expected):
        if forged:
            res.outcome = "forged_accepted"
        else:
            res.outcome, res.detail = "wrong_kv_accepted", "a corrupted blob decoded to other KV than its seed"
    else:
        res.outcome = "decoded"
    return res
