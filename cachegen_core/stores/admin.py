"""What is in a store, and evicting from it: the work behind ``cachegen stats`` and ``cachegen gc``.

A chunk is stored as ``<chunk>-M`` (its manifest) and ``<chunk>-L<level>`` (one blob per
level); :func:`scan` groups a store's entries by chunk. A chunk's *age* is its
manifest's (the entry the engine looks up on every request), else its newest entry's:
on disk the time since it was stored, on Redis since it was last read or written (the
listing itself reads nothing, see ``RedisStore.entries``). Blob headers are read only
for what needs them (models by fingerprint), a bounded prefix at a time. A partial chunk's
pointers (``<prefix key>-P``, ``keys/pointers.py``: a few KB each, leading a prompt to a longer
partial chunk) are counted as ``pointers``, in no chunk: ``gc`` deletes one by its own age, by size
as a unit of its own, and, read only then, when the chunk it names is gone or goes in that ``gc``
(``dangling``). Keys of another shape in the namespace are counted as ``other`` and never touched.
Both report per tier (``tiers.py``): the raw forms, and the rest (manifests, levels, pointers, other
keys); ``gc`` with ``tier="raw"`` drops raw forms only (each by its own age), leaving every chunk a hit
at its level.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CacheGenFormatError
from ..codec.format import read_header
from ..keys.pointers import Pointer
from .base import KVStore
from .signed import OVERHEAD, TRAILER, unwrap
from .tiers import CAPACITY_TIER, RAW_TIER

KEY_RE = re.compile(r"^(?P<chunk>[0-9a-f]{64})-(?:(?P<manifest>M)|L(?P<level>\d{1,2}|raw|lossless))$")
POINTER_RE = re.compile(r"^(?P<prefix>[0-9a-f]{64})-P$")
#: Bytes read to parse a blob's header (a header is ~1 KiB; a longer one is read whole).
HEAD_BYTES = 1 << 16


@dataclass
class ChunkEntries:
    """One chunk's entries: its manifest's bytes (None: no manifest) and each stored option's blob bytes
    (levels as ints, the raw forms as ``"raw"`` / ``"lossless"``)."""

    chunk: str
    manifest: int | None = None
    levels: dict[int | str, int] = field(default_factory=dict)
    age_s: float | None = None
    newest_s: float | None = None
    raw_ages: dict[str, float | None] = field(default_factory=dict)

    @property
    def raw_bytes(self) -> int:
        """Bytes of its raw forms (the raw tier's)."""
        return sum(n for lv, n in self.levels.items() if isinstance(lv, str))

    @property
    def bytes(self) -> int:
        return (self.manifest or 0) + sum(self.levels.values())

    @property
    def keys(self) -> list[str]:
        """Its keys, manifest first (deleted in this order: a reader never sees a manifest without its blobs)."""
        return ([f"{self.chunk}-M"] if self.manifest is not None else []) + [f"{self.chunk}-L{lv}" for lv in self.levels]


@dataclass
class Scan:
    """A store's entries grouped by chunk, and the entries of no chunk."""

    chunks: dict[str, ChunkEntries]
    other_keys: int = 0
    other_bytes: int = 0
    others: list[tuple[str, int, float | None]] = field(default_factory=list)  # (key, bytes, age) of each
    pointers: dict[str, tuple[int, float | None]] = field(default_factory=dict)  # key -> (bytes, age)

    @property
    def pointer_bytes(self) -> int:
        return sum(n for n, _ in self.pointers.values())

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.chunks.values()) + self.other_bytes + self.pointer_bytes


def entries(store: KVStore) -> Iterable[tuple[str, int, float | None]]:
    """(key, bytes, age in seconds or None) of every entry of ``store``'s namespace."""
    backend = unwrap(store)
    listing = getattr(backend, "entries", None)
    if listing is not None:
        return listing()
    return ((k, len(backend.get(k) or b""), None) for k in backend.keys())  # a store without a listing of its own


def scan(store: KVStore) -> Scan:
    """Every entry of ``store`` grouped by chunk (see the module doc)."""
    out = Scan({})
    for key, size, age in entries(store):
        m = KEY_RE.match(key)
        if m is None and POINTER_RE.match(key):
            out.pointers[key] = (size, age)
            continue
        if m is None:
            out.other_keys += 1
            out.other_bytes += size
            out.others.append((key, size, age))
            continue
        c = out.chunks.setdefault(m["chunk"], ChunkEntries(m["chunk"]))
        if m["manifest"]:
            c.manifest = size
            c.age_s = age
        else:
            lv = m["level"]
            c.levels[int(lv) if lv.isdigit() else lv] = size
            if not lv.isdigit():
                c.raw_ages[lv] = age
        if age is not None and (c.newest_s is None or age < c.newest_s):
            c.newest_s = age
    for c in out.chunks.values():
        if c.manifest is None:
            c.age_s = c.newest_s
    return out


def blob_header(store: KVStore, key: str) -> dict[str, Any] | None:
    """The parsed header of the blob under ``key`` (None: absent or not a blob); reads a prefix where it can."""
    backend = unwrap(store)
    head = getattr(backend, "head", None)
    data = head(key, HEAD_BYTES) if head is not None else backend.get(key)
    for attempt in (0, 1):
        if data is None:
            return None
        try:
            return read_header(data)
        except CacheGenFormatError:
            if attempt or head is None or len(data) < HEAD_BYTES:
                return None
            data = backend.get(key)  # a header longer than the prefix
    return None


def option_order(option: int | str) -> tuple[bool, str]:
    """Levels (numerically, up to 99) before the raw forms."""
    return (isinstance(option, str), f"{option:>2}" if isinstance(option, int) else option)


def chunk_model(store: KVStore, chunk: ChunkEntries) -> str | None:
    """The model fingerprint in the header of one of the chunk's blobs (None: no readable blob)."""
    for level in sorted(chunk.levels, key=option_order):
        header = blob_header(store, f"{chunk.chunk}-L{level}")
        if header is not None and isinstance(header.get("model_fingerprint"), str):
            return header["model_fingerprint"]
    return None


def stats(store: KVStore, *, headers: bool = True) -> dict[str, Any]:
    """Entries, bytes, chunks, manifests, blobs and bytes per level, and (``headers``) chunks per model."""
    s = scan(store)
    levels: dict[int | str, dict[str, int]] = defaultdict(lambda: {"blobs": 0, "bytes": 0})
    for c in s.chunks.values():
        for lv, n in c.levels.items():
            levels[lv]["blobs"] += 1
            levels[lv]["bytes"] += n
    ages = [c.age_s for c in s.chunks.values() if c.age_s is not None]
    out: dict[str, Any] = {
        "store": repr(unwrap(store)),
        "entries": sum(len(c.keys) for c in s.chunks.values()) + len(s.pointers) + s.other_keys,
        "bytes": s.bytes,
        "chunks": len(s.chunks),
        "manifests": sum(c.manifest is not None for c in s.chunks.values()),
        "manifest_bytes": sum(c.manifest or 0 for c in s.chunks.values()),
        "blobs": sum(len(c.levels) for c in s.chunks.values()),
        "levels": {str(lv): levels[lv] for lv in sorted(levels, key=option_order)},
        "chunks_without_manifest": sum(c.manifest is None for c in s.chunks.values()),
        "pointers": len(s.pointers),
        "pointer_bytes": s.pointer_bytes,
        "other_keys": s.other_keys,
        "oldest_chunk_age_s": max(ages) if ages else None,
        "newest_chunk_age_s": min(ages) if ages else None,
        "tiers": tiers(s),
    }
    budget = getattr(unwrap(store), "budget", None)
    if budget is not None:
        out["budget"] = budget()
    if headers:
        models: dict[str, dict[str, int]] = defaultdict(lambda: {"chunks": 0, "bytes": 0})
        for c in s.chunks.values():
            fp = chunk_model(store, c) or "unreadable"
            models[fp]["chunks"] += 1
            models[fp]["bytes"] += c.bytes
        out["models"] = dict(models)
    return out


def tiers(s: Scan) -> dict[str, dict[str, int]]:
    """Entries and bytes of each tier: the raw forms, and the rest."""
    raw_blobs = sum(len(c.raw_ages) for c in s.chunks.values())
    raw_bytes = sum(c.raw_bytes for c in s.chunks.values())
    entries = sum(len(c.keys) for c in s.chunks.values()) + len(s.pointers) + s.other_keys
    return {RAW_TIER: {"entries": raw_blobs, "bytes": raw_bytes},
            CAPACITY_TIER: {"entries": entries - raw_blobs, "bytes": s.bytes - raw_bytes}}  # fmt: skip


@dataclass(frozen=True)
class GcPolicy:
    """What ``gc`` evicts: chunks older than ``max_age_s``, of a model whose fingerprint starts with
    ``model``, without a manifest (``orphans``, once older than ``orphan_grace_s``), then the oldest
    until the store holds at most ``max_bytes``. ``tier="raw"``: raw forms only (the age each one's
    own, ``max_bytes`` the raw tier's), their chunks left stored at their levels."""

    max_age_s: float | None = None
    max_bytes: int | None = None
    model: str | None = None
    orphans: bool = False
    orphan_grace_s: float = 600.0
    tier: str = "all"

    def __post_init__(self) -> None:
        if self.model is not None and len(self.model) < 8:
            raise ValueError("give at least 8 characters of the model fingerprint")
        if (self.max_age_s, self.max_bytes, self.model, self.orphans) == (None, None, None, False):
            raise ValueError("nothing to collect: give an age, a size, a model or orphans")
        if self.tier not in ("all", RAW_TIER):
            raise ValueError(f"tier must be 'all' or 'raw', got {self.tier!r}")
        if self.tier == RAW_TIER and self.orphans:
            raise ValueError("orphans are whole chunks: not with tier='raw'")


def gc(store: KVStore, policy: GcPolicy, *, dry_run: bool = False) -> dict[str, Any]:
    """Evict the chunks ``policy`` selects (whole chunks, manifest first; or their raw forms alone with
    ``tier="raw"``) and the pointers it selects (see the module doc); what was (or would be) deleted."""
    s = scan(store)
    if policy.tier == RAW_TIER:
        return _gc_raw(store, s, policy, dry_run)
    reasons: dict[str, str] = {}
    for c in s.chunks.values():
        if policy.max_age_s is not None and c.age_s is not None and c.age_s >= policy.max_age_s:
            reasons[c.chunk] = "age"
        elif policy.orphans and c.manifest is None and c.newest_s is not None and c.newest_s >= policy.orphan_grace_s:
            reasons[c.chunk] = "orphan"
        elif policy.model is not None and (chunk_model(store, c) or "").startswith(policy.model):
            reasons[c.chunk] = "model"
    old = policy.max_age_s
    gone = {k: "age" for k, (_, age) in s.pointers.items() if old is not None and age is not None and age >= old}  # pointer -> reason
    dangling = _Dangling(store, s, policy.orphan_grace_s)
    if reasons or policy.orphans:
        dangling.add_to(gone, reasons)
    left = s.bytes - sum(s.chunks[k].bytes for k in reasons) - sum(s.pointers[k][0] for k in gone)
    if policy.max_bytes is not None and left > policy.max_bytes:
        units = [(c.age_s, c.chunk, c.bytes) for c in s.chunks.values() if c.chunk not in reasons]
        units += [(age, k, n) for k, (n, age) in s.pointers.items() if k not in gone]
        for _, unit, n in sorted(units, key=lambda u: -1.0 if u[0] is None else u[0], reverse=True):
            if left <= policy.max_bytes:
                break
            (gone if unit in s.pointers else reasons)[unit] = "size"
            left -= n
        if "size" in reasons.values():
            left -= dangling.add_to(gone, reasons)
    victims = [s.chunks[k] for k in reasons]
    backend = unwrap(store)
    if not dry_run:
        pointers = list(gone)  # first: a pointer leads to a chunk, never the other way
        for i in range(0, len(pointers), 200):
            backend.delete_many(pointers[i : i + 200])
        for i in range(0, len(victims), 200):
            batch = victims[i : i + 200]
            backend.delete_many([k for c in batch for k in c.keys[:1] if k.endswith("-M")])
            backend.delete_many([k for c in batch for k in c.keys if not k.endswith("-M")])
    return {
        "store": repr(unwrap(store)),
        "dry_run": dry_run,
        "chunks_deleted": len(victims),
        "pointers_deleted": len(gone),
        "keys_deleted": sum(len(c.keys) for c in victims) + len(gone),
        "bytes_freed": sum(c.bytes for c in victims) + sum(s.pointers[k][0] for k in gone),
        "by_reason": dict(Counter(reasons.values())),
        "pointers_by_reason": dict(Counter(gone.values())),
        "chunks_left": len(s.chunks) - len(victims),
        "pointers_left": len(s.pointers) - len(gone),
        "bytes_left": left,
        "unknown_ages": sum(c.age_s is None for c in s.chunks.values()),
    }


class _Dangling:
    """The pointers of a scan whose chunk is gone: their chunks read once, when first needed (``get_many``)."""

    def __init__(self, store: KVStore, s: Scan, grace_s: float) -> None:
        self.store, self.scan, self.grace_s = store, s, grace_s
        self._chunks: dict[str, str | None] | None = None  # pointer key -> the chunk it names (None: unreadable)

    def add_to(self, gone: dict[str, str], reasons: dict[str, str]) -> int:
        """Add to ``gone`` the pointers whose chunk goes (in ``reasons``) or has no manifest (a pointer younger than the
        grace excepted: the listing may have missed its new chunk); returns their bytes."""
        if self._chunks is None:
            keys = list(self.scan.pointers)
            self._chunks = {}
            for i in range(0, len(keys), 200):
                batch = keys[i : i + 200]
                self._chunks.update(zip(batch, map(pointed_chunk, unwrap(self.store).get_many(batch))))
        freed = 0
        for key, chunk in self._chunks.items():
            n, age = self.scan.pointers[key]
            held = self.scan.chunks.get(chunk or "")
            if key in gone or (held is not None and held.manifest is not None and chunk not in reasons):
                continue
            if chunk in reasons or age is None or age >= self.grace_s:
                gone[key] = "dangling"
                freed += n
        return freed


def pointed_chunk(value: bytes | None) -> str | None:
    """The chunk a stored pointer names (a signed store's value read without its key), None when unreadable."""
    if value is None:
        return None
    body = value[:-OVERHEAD] if len(value) >= OVERHEAD and value.endswith(TRAILER) else value
    try:
        return Pointer.from_bytes(body).chunk
    except CacheGenFormatError:
        return None


def _gc_raw(store: KVStore, s: Scan, policy: GcPolicy, dry_run: bool) -> dict[str, Any]:
    """``gc`` of the raw tier: raw forms by age and model, then the oldest until it holds ``max_bytes``."""
    blobs = [(c, form, c.levels[form], age) for c in s.chunks.values() for form, age in c.raw_ages.items()]
    reasons: dict[str, str] = {}
    for c, form, _, age in blobs:
        key = f"{c.chunk}-L{form}"
        if policy.max_age_s is not None and age is not None and age >= policy.max_age_s:
            reasons[key] = "age"
        elif policy.model is not None and (chunk_model(store, c) or "").startswith(policy.model):
            reasons[key] = "model"
    size = {f"{c.chunk}-L{form}": n for c, form, n, _ in blobs}
    left = sum(size.values()) - sum(size[k] for k in reasons)
    if policy.max_bytes is not None:
        for c, form, n, _ in sorted(blobs, key=lambda b: -1.0 if b[3] is None else b[3], reverse=True):
            if left <= policy.max_bytes:
                break
            if f"{c.chunk}-L{form}" not in reasons:
                reasons[f"{c.chunk}-L{form}"] = "size"
                left -= n
    if not dry_run:
        keys = list(reasons)
        for i in range(0, len(keys), 200):  # the manifests still name them: a reader takes the next form
            unwrap(store).delete_many(keys[i : i + 200])
    return {
        "store": repr(unwrap(store)),
        "dry_run": dry_run,
        "tier": RAW_TIER,
        "blobs_deleted": len(reasons),
        "bytes_freed": sum(size[k] for k in reasons),
        "by_reason": dict(Counter(reasons.values())),
        "raw_bytes_left": left,
        "unknown_ages": sum(a is None for *_, a in blobs),
    }
