"""Mutation primitives: boundary values of every JSON type, paths into JSON values, byte-level edits."""

from __future__ import annotations

import random
from typing import Any


INTERESTING_INTS = [0, 1, 2, 3, 7, 8, 9, 10, 11, 15, 16, 17, 127, 128, 255, 256, 1023, 4095, 4096, 4097,
                     16383, 16384, 16385, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1,
                     2**63, 2**64, 2**70, -1, -2, -(2**31), -(2**63)]  # fmt: skip


def odd_value(rng: random.Random, old: Any = None) -> Any:
    """A value of a random JSON type, biased to boundaries and to near-misses of ``old``."""
    r = rng.random()
    if isinstance(old, int) and not isinstance(old, bool) and r < 0.35:
        return rng.choice([old + 1, old - 1, old * 2, old // 2, -old, old + 16, old * 1000, 0])
    if r < 0.6:
        return rng.choice(INTERESTING_INTS)
    return rng.choice([None, True, False, 1.0, 0.5, -0.0, 1e308, float("inf"), float("nan"), "", "x", "0",
                       "native-rans16-v1", "torchac", "inline", "profile", "float32", "float16", "bfloat16",
                       "uint8", "uint16", "int32", "float64", "object", "cachegen", [], [1], [1, 2, 3, 4],
                       [2, 2, 2**31, 4], {}, {"a": 1}, [[]], ["float32"]])  # fmt: skip


def json_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (dict keys and list indices)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += json_paths(v, prefix + (k,))
    elif isinstance(obj, list) and len(obj) <= 16:
        for i, v in enumerate(obj):
            out += json_paths(v, prefix + (i,))
    return out


def json_set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return obj


def json_get(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def raw_edit(rng: random.Random, b: bytearray, other: bytes = b"") -> None:
    """One in-place byte-level edit of ``b`` (bit flips, set bytes, insert, delete, truncate, splice...)."""
    op = rng.randrange(10)
    n = len(b)
    if op == 0 and n:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
    elif op == 1 and n:
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(n)] = rng.choice([0, 0xFF, 0x7F, 0x80, 0x01, rng.randrange(256)])
    elif op == 2:
        i = rng.randrange(n + 1)
        b[i:i] = rng.randbytes(rng.choice([1, 2, 4, 8, 16, 100]))
    elif op == 3 and n:
        i = rng.randrange(n)
        del b[i : i + rng.choice([1, 2, 4, 16, 64, n])]
    elif op == 4:
        del b[rng.randrange(n + 1) :]
    elif op == 5:
        b += rng.randbytes(rng.choice([1, 4, 64])) if rng.random() < 0.5 else bytes(rng.choice([1, 16]))
    elif op == 6 and n:
        i = rng.randrange(n)
        j = rng.randrange(i, min(n, i + 64) + 1)
        b[i:i] = b[i:j]  # duplicate a range
    elif op == 7 and other:
        i, j = rng.randrange(n + 1), rng.randrange(len(other) + 1)
        b[i:] = other[j:]  # splice: our head, the other blob's tail
    elif op == 8 and n >= 4:
        i = rng.randrange(n - 3)
        b[i : i + 4] = (rng.choice(INTERESTING_INTS) & 0xFFFFFFFF).to_bytes(4, "little")
    elif n:
        i, j = sorted(rng.sample(range(n + 1), 2)) if n > 1 else (0, n)
        b[i:j] = bytes(reversed(b[i:j]))
