"""Tables by scale class: the one fixed set of frequency tables every component is coded with.

A component's symbols ``x = s - 128 = round(c / step)`` follow a zero-mean law close to a
discrete Gaussian whose scale is the component's spread in steps (measured on the reference
model's KV: within 0.5-0.8 % of per-component tables fitted on the same model,
``docs/history/2026-11-27-codec-v3-tuning.md``).
So the codec has one bank of ``n_classes`` discrete Gaussian laws at log-spaced scales
(``scales``) and codes each component with one of them, its *class*: with a profile the class
of every (level, kind, layer, component) is fitted once and stored in the profile
(``classes_from_counts``); without one the encoder picks each component's class on the chunk
itself (``chunk_classes``) and the blob carries it, one byte per component. The number of
tables no longer grows with the model (64 whatever its width or depth), so a decoder's tables
stay in its caches.

The law of class ``k``: ``p(x) = exp(-x^2 / (2 s_k^2)) / Z`` for ``x`` in -127..127, quantised
to 16-bit frequencies (every entry >= 1, symbol 0 unused). The bank is built with float64
``exp`` and correctly rounded sums; its digest is part of the codec id (``config.CodecConfig.codec_id``), so a platform that computed other
tables would have another codec id and never decode this one's blobs with them.
"""

from __future__ import annotations

import functools
import hashlib
import math

import numpy as np

ALPHABET, OFFSET, RADIUS = 256, 128, 127  # as quantize.py (not imported: this module needs no torch)
TOTAL = 1 << 16
#: Smallest and largest class scale (RMS of ``x`` in steps): below 0.21 a law's tables are all the
#: same (every symbol but 0 at the floor of 1 in 2^16); 127 steps is the symbols' radius.
SCALE_RANGE = (0.2, 80.0)
DEFAULT_CLASSES = 64


def scales(n_classes: int = DEFAULT_CLASSES) -> np.ndarray:
    """The class scales, float64 ``(n_classes,)``, log-spaced over ``SCALE_RANGE``."""
    lo, hi = SCALE_RANGE
    return np.array([lo * (hi / lo) ** (k / (n_classes - 1)) for k in range(n_classes)], dtype=np.float64)


@functools.lru_cache(maxsize=4)
def bank(n_classes: int = DEFAULT_CLASSES) -> np.ndarray:
    """The frequency tables, uint32 ``(n_classes, 256)`` (rows sum to 2^16, every entry >= 1), read-only."""
    if not 2 <= n_classes <= 256:
        raise ValueError("n_classes must be in [2, 256] (a class is one byte)")
    rows = []
    for s in scales(n_classes):
        w = [0.0] + [math.exp(-(x * x) / (2.0 * s * s)) for x in range(-RADIUS, RADIUS + 1)]
        z = math.fsum(w)
        f = [int(math.floor(v / z * (TOTAL - ALPHABET))) + 1 for v in w]
        f[OFFSET] += TOTAL - sum(f)
        rows.append(f)
    out = np.array(rows, dtype=np.uint32)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=4)
def code_lengths(n_classes: int = DEFAULT_CLASSES) -> np.ndarray:
    """Bits of every symbol under every class, float64 ``(n_classes, 256)``."""
    out = 16.0 - np.log2(bank(n_classes).astype(np.float64))
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=4)
def digest(n_classes: int = DEFAULT_CLASSES) -> str:
    """Short hash of the bank's tables (bound into the codec id)."""
    return hashlib.blake2b(bank(n_classes).astype("<u4").tobytes(), digest_size=8).hexdigest()


def counts_to_freqs(counts: np.ndarray, alpha: float = 0.05) -> np.ndarray:
    """Histograms ``(..., A)`` -> uint32 tables summing to ``2**16`` with every entry >= 1 (a table
    measured on symbols: the fuzz harness's, and tools'). ``alpha`` is added to every count (additive
    smoothing); a table that saw nothing is uniform."""
    counts = np.asarray(counts, dtype=np.float64)
    a = counts.shape[-1]
    total = counts.sum(axis=-1, keepdims=True) + alpha * a
    p = np.where(total > 0, (counts + alpha) / np.where(total > 0, total, 1.0), 1.0 / a)
    f = np.floor(p * (TOTAL - a)).astype(np.int64) + 1
    deficit = TOTAL - f.sum(axis=-1)
    top = f.argmax(axis=-1)[..., None]
    np.put_along_axis(f, top, np.take_along_axis(f, top, -1) + deficit[..., None], -1)
    return f.astype(np.uint32)


def classes_from_counts(counts: np.ndarray, n_classes: int = DEFAULT_CLASSES) -> np.ndarray:
    """The class coding each histogram of ``counts`` (``(..., 256)``) in the fewest bits: uint8 ``(...)``."""
    counts = np.asarray(counts, dtype=np.float64)
    cost = counts.reshape(-1, ALPHABET) @ code_lengths(n_classes).T
    return cost.argmin(axis=1).astype(np.uint8).reshape(counts.shape[:-1])
