"""How far floats computed along two different paths may honestly differ.

Two paths that do the same maths in another order (another kernel, shape, chunking or
thread count: a prefill of 300 tokens against 256 reused plus 44 appended) round
differently, and which CPU runs them decides by how much. Tests compare such results
within ``reorder_tolerance``; exact equality is kept for the same computation run twice
and for what the design promises bit for bit (native decoders against the torch path,
lossless and raw forms, encoder determinism).
"""

from __future__ import annotations

import math

import torch


def reorder_tolerance(reference: torch.Tensor, terms: int, ulps: float = 4.0) -> float:
    """Largest absolute difference allowed from ``reference`` for a result whose sums of up to ``terms``
    addends ran in another order: ``ulps`` units of roundoff of its dtype, times its largest magnitude,
    times sqrt(terms) (rounding errors of a reordered sum add up like a random walk: Higham's
    probabilistic bound). For float32 KV of magnitude 3 over 300 terms: 2.5e-5, while a wrong
    position, a stale slot or a missed token is off by 1e-1 or more."""
    if terms < 1:
        raise ValueError("terms must be >= 1")
    return ulps * torch.finfo(reference.dtype).eps * float(reference.abs().max()) * math.sqrt(terms)
