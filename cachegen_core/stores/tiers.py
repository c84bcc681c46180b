"""The two tiers inside a bounded store: what a key belongs to and which tier gives up room next.

A chunk is stored as its manifest, its compression levels and its exact 16-bit forms
(``keys/chunks.py``). A byte of store buys far more reuse as a level (about a quarter of the
16-bit bytes: a hit instead of a full prefill) than as a raw form (a faster hit on a local
store: 0.1 s against 0.2 s on a 3K context). So a bounded store keeps two tiers:

- the **capacity tier**: manifests, levels and any other key, evicted a whole chunk at a time
  (its manifest, levels and raw forms), least recently used first;
- the **raw tier**: the raw forms (``-Lraw``, ``-Llossless``), one blob at a time, least
  recently used first. A chunk whose raw form went stays a hit at its level: the reader takes
  the next form its manifest names (``engine/chunks/reader.py``).

When the store is over its budget the raw tier yields first, unless it is down to ``raw_share``
of the budget (a reserve, default none): raw forms live in the room the levels leave, up to the
whole budget, so with room for every level the hottest contexts stay 16-bit as well, and a store
too small for every level holds levels only. A reserve kept raw forms that levels would have
used, and cost hits: on the reference model's 3-8K contexts in Zipf order at a quarter of their
fp16 bytes, a 20 % reserve held 5 % fewer contexts and its mean TTFT was 1.25x the unreserved one's,
equal at half and above (``benchmarks.store_budget``, ``docs/results.md``). (Unrelated to
``engine/chunks/hot.py``'s ``HotTier``: an engine's write-behind buffer of chunks not yet stored.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from ..keys.manifest import RAW_OPTIONS

Tier = Literal["raw", "capacity"]
RAW_TIER: Tier = "raw"
CAPACITY_TIER: Tier = "capacity"
TIERS: tuple[Tier, ...] = (RAW_TIER, CAPACITY_TIER)
#: The share of a bounded store's budget kept for raw forms even when levels want it, by default.
DEFAULT_RAW_SHARE = 0.0

_RAW_SUFFIXES = tuple(f"-L{o}" for o in RAW_OPTIONS)
#: A chunk's key in a backend: anything (the namespace), 64 hex digits, then ``-M`` or ``-L<option>``.
_CHUNK_KEY = re.compile(r"^(?P<stem>.*[0-9a-f]{64})-(?:M|L(?:\d{1,2}|raw|lossless))$")


def tier_of(key: str) -> Tier:
    """The tier of a store key (with or without the namespace)."""
    return RAW_TIER if key.endswith(_RAW_SUFFIXES) else CAPACITY_TIER


def chunk_of(key: str) -> str:
    """The unit a capacity-tier key is evicted with: its chunk (namespace and key), or the key itself."""
    m = _CHUNK_KEY.match(key)
    return m["stem"] if m is not None else key


def raw_keys(stem: str) -> list[str]:
    """The raw-tier keys of the chunk ``stem`` (as :func:`chunk_of` names it)."""
    return [stem + s for s in _RAW_SUFFIXES]


def check_share(raw_share: float | None) -> float | None:
    """``raw_share`` when it is a fraction in [0, 1] (or None: no tiers); ``ValueError`` otherwise."""
    if raw_share is not None and not 0.0 <= float(raw_share) <= 1.0:
        raise ValueError(f"raw_share must be in [0, 1], got {raw_share}")
    return None if raw_share is None else float(raw_share)


def yielding_tier(limit: int, raw_share: float, raw_bytes: int, capacity_bytes: int) -> Tier | None:
    """The tier that gives up its least recently used unit next, or None when the store is within ``limit``: the raw
    tier while it holds more than its reserve (``raw_share`` of ``limit``) or nothing else is held, else the capacity tier."""
    if raw_bytes + capacity_bytes <= limit:
        return None
    return RAW_TIER if raw_bytes > raw_share * limit or capacity_bytes <= 0 else CAPACITY_TIER


def eviction_plan(limit: int, raw_share: float, raw: Sequence[tuple[str, int]], units: Sequence[tuple[str, Sequence[tuple[str, int]]]],
                  overhead: int = 0) -> list[str]:  # fmt: skip
    """The keys to delete, in order, to bring a store within ``limit``: ``raw`` the raw tier's (key, bytes) and
    ``units`` the capacity tier's chunks (its stem, its (key, bytes)), each least recently used first;
    ``overhead`` bytes the store spends besides (counted in the capacity tier). A chunk goes manifest
    first, then its levels, then its raw forms."""
    raw_size = dict(raw)
    held = {RAW_TIER: sum(raw_size.values()), CAPACITY_TIER: overhead + sum(n for _, unit in units for _, n in unit)}
    victims: list[str] = []
    gone: set[str] = set()
    next_raw = iter(raw)
    next_unit = iter(units)
    while (tier := yielding_tier(limit, raw_share, held[RAW_TIER], held[CAPACITY_TIER])) is not None:
        if tier == RAW_TIER:
            key = next((k for k, _ in next_raw if k not in gone), None)
            drop = [] if key is None else [key]
        else:
            stem, unit = next(next_unit, (None, ()))
            if stem is None:
                break
            victims += [k for k, _ in sorted(unit, key=lambda kn: not kn[0].endswith("-M"))]
            held[CAPACITY_TIER] -= sum(n for _, n in unit)
            drop = [k for k in raw_keys(stem) if k in raw_size and k not in gone]
        if tier == RAW_TIER and not drop:
            break
        victims += drop
        gone.update(drop)
        held[RAW_TIER] -= sum(raw_size[k] for k in drop)
    return victims
