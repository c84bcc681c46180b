"""A thread that has done its torch work lets its OpenMP worker threads go, so the scheduler's steps keep their speed.

torch's CPU ops run on OpenMP (GNU libgomp in the Linux wheels): each thread that runs a parallel op gets a team of
worker threads of its own, kept (spinning, then asleep) after the op. libgomp counts every team's threads; once they
outnumber the cores, every worker spins only ~100 times before it sleeps, so each of the step's parallel regions pays
a wake-up. On the 2-core CI box one packed decode step of 8 requests (the reference model, 1,536 cached tokens each)
took 158-176 ms in the scheduler's thread while another thread that had run torch ops was alive, 127-130 ms when
none was (as fast as in the main thread). So a thread of the engine that is done with torch for now (a request's
thread once its KV is gathered, a background worker going idle, the thread that built the engine) calls
:func:`release`: libgomp frees that thread's team (``omp_pause_resource_all``, OpenMP 5.0); its next parallel op
starts a new one (~0.1 ms). Other OpenMP runtimes pause every thread of the process on that call, so only libgomp
is called; elsewhere :func:`release` does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Any

import torch

_SOFT = 1  # omp_pause_soft


@functools.cache
def _libgomp() -> Any:
    """The libgomp torch runs on, already loaded; None when torch uses another runtime or none."""
    if not torch.backends.openmp.is_available():
        return None
    names = sorted(str(p) for p in (Path(torch.__file__).parent / "lib").glob("libgomp*.so*")) + ["libgomp.so.1"]
    for name in names:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only if the process has it loaded
            fn = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def release() -> None:
    """Free the calling thread's OpenMP worker threads (see the module doc); harmless where there are none."""
    fn = _libgomp()
    if fn is not None:
        fn(_SOFT)
