"""Direct fuzzing of a coder's ``decode``: random layouts and tables, valid or damaged payloads."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachegen_core.coders import StreamLayout
from cachegen_core.errors import CoderError
from cachegen_core.codec.classes import counts_to_freqs

from .edits import raw_edit
from .oracle import Result, run_one


def _random_freqs(g: np.random.Generator, n_tables: int, alphabet: int) -> np.ndarray:
    kind = g.integers(4)
    if kind == 0:  # peaked: one symbol takes almost everything (rANS's cheapest case)
        counts = np.zeros((n_tables, alphabet))
        counts[np.arange(n_tables), g.integers(0, alphabet, n_tables)] = 1e9
    elif kind == 1:
        counts = np.ones((n_tables, alphabet))
    else:
        counts = g.integers(0, 1000, (n_tables, alphabet)) * (g.random((n_tables, alphabet)) < g.random())
    counts = counts + (counts.sum(axis=1, keepdims=True) == 0)  # an empty row would be 0/0
    return counts_to_freqs(counts, alpha=0.0)


def _bad_freqs(g: np.random.Generator, freqs: np.ndarray) -> np.ndarray:
    f = freqs.copy()
    k = g.integers(7)
    if k == 0:
        f[0, 0] += 1  # sums to 2**16 + 1
    elif k == 1:
        f[0, :] = 0
        f[0, 0] = 1 << 16  # a zero-frequency symbol
    elif k == 2:
        return f.astype(np.int64)
    elif k == 3:
        return f[0]  # 1-D
    elif k == 4:
        return np.ascontiguousarray(f[:, :1])  # alphabet of 1
    elif k == 5:
        return np.zeros((0, f.shape[1]), dtype=np.uint32)
    else:
        f[0, 0] = 0xFFFFFFFF
    return f


@dataclass
class CoderCase:
    """One direct call of a coder's ``decode``; ``expect`` is set when the payloads are unmodified."""

    payloads: list[bytes]
    layout: StreamLayout
    freqs: np.ndarray
    expect: np.ndarray | None
    alphabet: int
    what: str


def coder_case(rng: random.Random, coder: Any, others: Sequence[Any]) -> CoderCase:
    """A random layout and table set, symbols coded by ``coder`` (or another coder), then maybe damaged."""
    g = np.random.default_rng(rng.randrange(2**32))
    n_streams = int(g.choice([0, 1, 1, 2, 3, 5, 8, 17]))
    big = rng.random() < 0.05
    counts = g.integers(0, 20_000 if big else 300, n_streams) * (g.random(n_streams) < 0.9)
    if n_streams and rng.random() < 0.2:
        counts[g.integers(n_streams)] = rng.choice([1, 15, 16, 17, 31, 32, 33])  # around the 16 lanes
    offsets = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    period = int(g.choice([1, 2, 3, 7, 15, 16, 17, 40]))
    alphabet = int(g.choice([2, 3, 16, 255, 256, 256, 256]))
    n_tables = int(g.integers(1, 6))
    freqs = _random_freqs(g, n_tables, alphabet)
    tids = g.integers(0, n_tables, (n_streams, period)).astype(np.int32)
    layout = StreamLayout(offsets, tids)
    # symbols drawn from their own tables, so that peaked tables give long cheap runs
    cdf = np.cumsum(freqs, axis=1) / float(1 << 16)
    n = int(offsets[-1])
    table_of = np.concatenate([np.resize(tids[s], int(counts[s])) for s in range(n_streams)]) if n else np.zeros(0, dtype=np.int32)
    symbols = (cdf[table_of] < g.random((n, 1))).sum(axis=1).clip(0, alphabet - 1).astype(np.uint8) if n else np.zeros(0, np.uint8)
    enc = rng.choice(list(others)) if others and rng.random() < 0.15 else coder
    payloads = enc.encode(symbols, layout, freqs)
    what = f"n_streams={n_streams} symbols={n} period={period} alphabet={alphabet} by={enc.name}"
    r = rng.random()
    if enc is coder and r < 0.25:
        if rng.random() < 0.3:  # same values in strided, non-contiguous arrays: a coder must not assume C order
            layout = StreamLayout(np.repeat(offsets, 2)[::2], np.repeat(tids, 2, axis=1)[:, ::2])
            what += " strided layout"
        return CoderCase(payloads, layout, freqs, symbols, alphabet, "valid " + what)
    if r < 0.55 and payloads:
        i = rng.randrange(len(payloads))
        b = bytearray(payloads[i])
        raw_edit(rng, b, rng.choice(payloads))
        payloads[i] = bytes(b)
        what += f" damaged stream {i}"
    elif r < 0.65 and payloads:
        payloads = [rng.randbytes(rng.choice([0, 3, 64, 65, 66, 130, len(p)])) for p in payloads]
        what += " random payloads"
    elif r < 0.72:
        payloads = payloads[:-1] if payloads and rng.random() < 0.5 else payloads + [b""]
        what += " wrong payload count"
    elif r < 0.8:
        freqs = _bad_freqs(g, freqs)
        what += " bad tables"
    elif r < 0.88 and n_streams:
        bad = rng.randrange(4)
        if bad == 0:
            tids = tids.copy()
            tids[0, 0] = rng.choice([-1, n_tables, 2**31 - 1])
        elif bad == 1:
            offsets = offsets.copy()
            offsets[-1] = max(0, offsets[-2] - 1) if n_streams else 0
        elif bad == 2:
            offsets = offsets.astype(np.int32)
        else:
            tids = tids.astype(np.int64)
        layout = StreamLayout(offsets, tids)
        what += " bad layout"
    elif enc is not coder:
        what += " (cross-coder)"
    else:  # swap two payloads
        if len(payloads) > 1:
            i, j = rng.sample(range(len(payloads)), 2)
            payloads[i], payloads[j] = payloads[j], payloads[i]
        what += " swapped streams"
    return CoderCase(payloads, layout, freqs, None, alphabet, what)


def check_coder(coder: Any, case: CoderCase, *, hang_s: float = 2.0, hard_s: float = 20.0, trace: bool = True) -> Result:
    """A coder's ``decode``: uint8 symbols in the alphabet (exactly the input when unmodified), or ``CoderError``."""
    n = int(case.layout.offsets[-1]) if case.layout.offsets.size else 0
    bound = (8 << 20) + 8 * sum(len(p) for p in case.payloads) + 24 * max(n, 0) + 16 * case.layout.table_ids.size
    out, exc, res = run_one(lambda: coder.decode(case.payloads, case.layout, case.freqs), bound, hang_s, hard_s, trace)
    if res.outcome:
        res.detail += f" [{case.what}]"
        return res
    if exc is not None:
        if isinstance(exc, CoderError) and case.expect is None:
            res.outcome = "rejected"
        else:
            res.outcome, res.detail = "crash", f"{type(exc).__name__}: {exc} [{case.what}]"[:300]
        return res
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != (n,):
        res.outcome, res.detail = (
            "wrong_kv_accepted",
            f"decode returned {type(out).__name__} {getattr(out, 'shape', '')} [{case.what}]",
        )
    elif out.size and int(out.max()) >= case.alphabet:
        res.outcome, res.detail = "wrong_kv_accepted", f"symbol {int(out.max())} outside the alphabet [{case.what}]"
    elif case.expect is not None and not np.array_equal(out, case.expect):
        res.outcome, res.detail = "wrong_kv_accepted", f"valid payloads mis-decoded [{case.what}]"
    else:
        res.outcome = "decoded"
    return res
