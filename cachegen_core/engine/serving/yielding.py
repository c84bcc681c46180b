"""Background torch work that gives way to requests: :class:`Yielding`, paused before each torch op while one runs.

A background thread of the engine (the profile fit, ``profiles.py``; the cost probes, ``probes.py``) computes with torch,
whose ops hold every core, and with the model, which a request needs. Checking for requests only between model calls
made a request arriving mid-call wait for the rest of it (a new 4-layer 7B-shaped model's first request on 2 cores took
1.53 s instead of 0.38 s while its profile was fitted; on an H200 10.2 s instead of 0.24 s); lowering the thread's
priority does not help (an op's work runs on torch's intra-op threads), and ``torch.set_num_threads`` cannot be set for
one thread (it is process-wide, and the default of the threads started after it, a request's among them).

Inside :meth:`Yielding.active` (a torch dispatch mode: it sees every op of the thread that entered it, the ops of
autograd's backward pass included, and no other thread's) the thread checks before each op whether a request of the
process computes (``idle`` cleared: ``ChunkWriter.busy``); while one does, it waits, letting go of the model lock it
holds (:meth:`Yielding.holding`), until none has run for ``quiet_s``. A request waits at most for the op running when
it arrived. On a GPU the thread's ops go to a stream of their own, synchronised every ``SYNC_EVERY`` ops, so that no
more of its queued work runs beside a request's.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ... import openmp

#: On a GPU, the ops a background thread may queue before it waits for them.
SYNC_EVERY = 16
#: On the CPU, a matrix product that would take longer than about twice this is computed in blocks of rows of about
#: this many seconds, checking between them (a 7B model's MLP over a 1024-token piece is one 92 GFLOP product: 4 s of 2
#: cores in float32; a 2-layer model's vocabulary projection over 1024 tokens, 12.9 GFLOP, took 26 s in bfloat16 on
#: a 2-core AMD EPYC without native 16-bit products, 0.32 s in float32).
BLOCK_S = 0.05
#: What a CPU product's rate is assumed to be, flops per second, until one of that dtype was timed (float32: 2 cores of
#: the project's CI box; any other dtype: as slow as a CPU without native 16-bit products, so it is split from the start).
PRIOR_RATES = {torch.float32: 40e9, torch.float64: 20e9}
PRIOR_RATE = 0.5e9
#: The rate of each dtype's products measured on this CPU: that of its last block (a block slowed by other work makes
#: the next ones smaller, never a request's wait longer).
_RATES: dict[torch.dtype, float] = {}


_WORKERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def stop_at_exit(worker: Any) -> None:
    """Stop ``worker`` (its ``yielding.stop`` set, its ``_thread`` joined) before the interpreter finalises: a torch
    call running then would abort it."""
    _WORKERS.add(worker)


@atexit.register
def _stop_all() -> None:
    workers = list(_WORKERS)
    for w in workers:
        w.yielding.stop.set()
    for w in workers:
        thread = w._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)  # at most one op: its next check stops it
            if not thread.is_alive():
                _exited(thread)


def _exited(thread: threading.Thread, timeout: float = 2.0) -> None:
    """Wait until the OS thread behind a joined ``thread`` is gone (Linux; elsewhere at once). ``join`` returns before
    its thread-local destructors run, and torch's take the GIL (autograd's ready queue, left holding tensors by a
    backward pass :class:`Stopped` ended): run while the interpreter finalises, they abort the process ("terminate
    called without an active exception", about 1 exit in 4 while a profile was fitted). Sleeping lets go of the GIL."""
    task = Path(f"/proc/self/task/{thread.native_id}")
    deadline = time.monotonic() + timeout
    while thread.native_id is not None and task.exists() and time.monotonic() < deadline:
        time.sleep(0.002)


class Stopped(Exception):
    """The background work was asked to stop (its ``stop`` event set)."""


class _IdleOnly:
    """Turns that lend nothing: background work runs only while ``idle`` is set."""

    def __init__(self, idle: threading.Event) -> None:
        self.idle, self.granted = idle, threading.Event()

    def may_run(self) -> bool:
        return self.idle.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.idle.wait(timeout)


class Yielding(TorchDispatchMode):
    """Pauses the thread that runs :meth:`active` before each torch op while it may not compute: a request computes and
    no turn is lent (``turns``: the process's :class:`~.turns.Turns`, or an event set while no request computes).

    ``stop``: set to end the work (the next op raises :class:`Stopped`). ``device``: where its ops run (a CUDA device:
    on a stream of its own). ``paused`` is set while it waits for a turn (or for ``quiet_s`` without a request);
    ``pauses`` counts the ops it held back for a request, ``ops`` the ops run.
    """

    def __init__(self, turns: Any, stop: threading.Event | None = None, *, quiet_s: float = 0.5,
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        super().__init__()
        self.turns = _IdleOnly(turns) if isinstance(turns, threading.Event) else turns
        self.stop = stop or threading.Event()
        self.quiet_s = quiet_s
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.paused = threading.Event()
        self.pauses = self.ops = 0
        self._held: Any = None  # the lock held by ``holding``, let go while paused

    def __torch_dispatch__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        self.check()
        self.ops += 1
        kwargs = kwargs or {}
        if self.device.type == "cuda" and self.ops % SYNC_EVERY == 0:
            torch.cuda.current_stream(self.device).synchronize()
        if func in _SPLIT and not kwargs and args[-1].device.type == "cpu" and _flops(func, args) > 2 * BLOCK_S * rate(args[-1].dtype):
            return _SPLIT[func](self, *args)
        return func(*args, **kwargs)

    def check(self) -> None:
        """Return at once when no request computes; else wait (the model lock let go) until none has for ``quiet_s``;
        :class:`Stopped` when asked to stop."""
        if self.stop.is_set():
            raise Stopped
        if self.turns.may_run():
            return
        held, self.pauses = self._held, self.pauses + 1
        if held is not None:
            held.release()
        try:
            self.wait_quiet()
        finally:
            if held is not None:
                held.acquire()

    @property
    def idle(self) -> threading.Event:
        """Set while no request of the process computes."""
        return self.turns.idle

    def wait_quiet(self) -> None:
        """Wait for a turn lent under load, or until no request has computed for ``quiet_s`` (``paused`` set meanwhile;
        :class:`Stopped` when asked to stop)."""
        self.paused.set()
        openmp.release()  # its OpenMP threads, kept while it waits, would slow the requests' steps
        try:
            while True:
                if self.stop.is_set():
                    raise Stopped
                if not self.turns.wait(timeout=0.5):
                    continue
                if self.turns.granted.is_set():
                    return
                if not self.stop.wait(self.quiet_s) and self.turns.may_run():
                    return
        finally:
            self.paused.clear()

    @contextlib.contextmanager
    def holding(self, lock: Any) -> Iterator[None]:
        """Hold ``lock`` (the model's: the scheduler takes it for each step) once this thread may compute; let go of it
        whenever the thread pauses."""
        while True:
            self.wait_quiet()
            lock.acquire()
            if self.turns.may_run():
                break
            lock.release()
        self._held = lock
        try:
            yield
        finally:
            self._held = None
            lock.release()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the block's torch ops under this mode (and, on a GPU, on a stream of their own)."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), self:
            yield
        if stream is not None:
            stream.synchronize()


def rate(dtype: torch.dtype) -> float:
    """Flops per second of a CPU product in ``dtype``: as measured, else the prior."""
    return _RATES.get(dtype) or PRIOR_RATES.get(dtype, PRIOR_RATE)


def _flops(func: Any, args: tuple[Any, ...]) -> float:
    """A matrix product's flops."""
    a, b = (args[1], args[2]) if func is torch.ops.aten.addmm.default else (args[0], args[1])
    return 2.0 * a.numel() * b.shape[-1]


def _blocks(self: Yielding, rows: int, flops: float, dtype: torch.dtype) -> Iterator[tuple[int, int]]:
    """Row blocks of a product of ``flops`` over ``rows`` rows, each of about ``BLOCK_S`` at the rate measured for
    ``dtype`` (each block timed: the rate), a check before each but the first."""
    per_row, i = max(flops / max(rows, 1), 1.0), 0
    while i < rows:
        if i:
            self.check()
        j = min(rows, i + max(1, int(BLOCK_S * rate(dtype) / per_row)))
        t = time.perf_counter()
        yield i, j
        _RATES[dtype] = max(per_row * (j - i) / max(time.perf_counter() - t, 1e-9), 1e6)
        i = j


def _mm(self: Yielding, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a.new_empty((a.shape[0], b.shape[1]))
    for i, j in _blocks(self, a.shape[0], _flops(torch.ops.aten.mm.default, (a, b)), a.dtype):
        torch.mm(a[i:j], b, out=out[i:j])
    return out


def _addmm(self: Yielding, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a.new_empty((a.shape[0], b.shape[1]))
    rows = bias.dim() == 2 and bias.shape[0] == a.shape[0] > 1
    for i, j in _blocks(self, a.shape[0], _flops(torch.ops.aten.addmm.default, (bias, a, b)), a.dtype):
        torch.addmm(bias[i:j] if rows else bias, a[i:j], b, out=out[i:j])
    return out


def _bmm(self: Yielding, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.bmm(a[:, i:j], b) for i, j in _blocks(self, a.shape[1], _flops(torch.ops.aten.bmm.default, (a, b)), a.dtype)], dim=1)


#: The products split on the CPU (their default overloads: no ``beta``/``alpha``, no ``out``).
_SPLIT: dict[Any, Callable[..., torch.Tensor]] = {
    torch.ops.aten.mm.default: _mm,
    torch.ops.aten.addmm.default: _addmm,
    torch.ops.aten.bmm.default: _bmm,
}
