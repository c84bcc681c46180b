"""``DiskCacheStore``: the default store, on local disk via diskcache, with a size limit in two tiers.

Values are stored as raw bytes (small ones inline in SQLite, larger ones in files
that are fully written before the row pointing at them is committed), so a reader
sees a whole blob or nothing. The ``Disk`` used here refuses to store or load
anything but ``str`` keys and ``bytes`` values: a serialised-object row planted in the cache
directory is rejected, never deserialised, and a file-backed value must lie inside the
directory and be no larger than ``max_value_bytes``.

The size limit is kept in two tiers (``tiers.py``): raw forms and the rest, each least recently
used first, raw forms first (but for a reserve, ``raw_share``); this store culls them itself
(diskcache's own eviction is off). A read is not a write: the times of reads are kept in memory
and written to the database with the next write that needs room (so reads keep working on a
read-only directory, and a process that only reads does not move entries up).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW

from ..errors import StoreError
from ..paths import cache_dir
from .base import DEFAULT_NAMESPACE, BaseKVStore, Items, iter_items
from .disk_recovery import DB_NAME, damage, open_cache
from .tiers import CAPACITY_TIER, DEFAULT_RAW_SHARE, RAW_TIER, check_share, chunk_of, eviction_plan, tier_of

log = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_SIZE_LIMIT = 10 * GiB
#: Reads remembered between two culls (the oldest are forgotten past this).
MAX_TOUCHED = 1 << 14


def default_directory() -> Path:
    """``kv`` in the package's cache directory (``$CACHEGEN_CACHE_DIR`` or the user cache)."""
    return cache_dir("kv")


class UnsafeEntryError(Exception):
    """A row of the cache database is not a plain bytes value under a str key."""


class _BytesDisk(diskcache.Disk):
    """diskcache ``Disk`` that only handles str keys and bytes values: no object deserialisation, ever."""

    max_value_bytes: int | None = None

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) is not str:
            raise TypeError(f"DiskCacheStore keys must be str, got {type(key).__name__}")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        # A serialised-object or bytes key was not written by us: report it as None, never deserialise it.
        return key if raw and isinstance(key, str) else None

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        if type(value) is not bytes or read:
            raise TypeError("DiskCacheStore values must be bytes")
        return super().store(value, read, key=key)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if read and mode != MODE_BINARY:
            raise UnsafeEntryError("only a file-backed value is read into a buffer")
        if mode == MODE_RAW:
            data = bytes(value) if isinstance(value, (bytes, memoryview)) else None
            if data is None:
                raise UnsafeEntryError(f"inline value of type {type(value).__name__}, expected bytes")
            self._check_size(len(data))
            return data
        if mode == MODE_BINARY and isinstance(filename, str):
            root = os.path.realpath(self._directory)
            path = os.path.realpath(os.path.join(root, filename))
            if os.path.commonpath([root, path]) != root:
                raise UnsafeEntryError(f"value file {filename!r} lies outside the cache directory")
            f = open(path, "rb")  # noqa: SIM115  # OSError here reads as "deleted meanwhile": a miss
            try:
                self._check_size(os.fstat(f.fileno()).st_size)
                if read:  # DiskCacheStore.read_into's own use: the handle never leaves the store
                    return f
                return f.read()
            finally:
                if not read:
                    f.close()
        raise UnsafeEntryError(f"entry of mode {mode} is not a plain bytes value (refused, not deserialised)")

    def _check_size(self, n: int) -> None:
        if self.max_value_bytes is not None and n > self.max_value_bytes:
            raise UnsafeEntryError(f"stored value of {n} bytes exceeds max_value_bytes={self.max_value_bytes}")


class DiskCacheStore(BaseKVStore):
    """A ``KVStore`` on a diskcache ``Cache`` directory, shared safely by threads and processes.

    ``size_limit`` bounds the cache's bytes on disk (values and database). ``raw_share``: a
    share of it kept for raw forms even when levels want it (see the module doc; default none);
    ``None``: no tiers, diskcache culls by its ``eviction_policy`` (default: oldest stored first). ``timeout`` bounds how long an
    operation waits on a locked database. Extra keyword arguments are diskcache settings.
    A damaged store (its database overwritten, truncated, unreadable) is moved aside and a new one
    started (``disk_recovery.py``). ``create=False``: open an existing store only, as a read command
    does: ``StoreError`` when the directory holds none or a damaged one (nothing created, nothing moved).
    A store created (its directory or its database made) is logged once, at INFO, with its absolute path.
    """

    local = True

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        size_limit: int = DEFAULT_SIZE_LIMIT,
        raw_share: float | None = DEFAULT_RAW_SHARE,
        namespace: str = DEFAULT_NAMESPACE,
        max_value_bytes: int | None = None,
        timeout: float = 5.0,
        create: bool = True,
        **settings: Any,
    ) -> None:
        if size_limit <= 0:
            raise ValueError("size_limit must be > 0")
        max_value_bytes = size_limit if max_value_bytes is None else min(size_limit, max_value_bytes)
        super().__init__(namespace, max_value_bytes)
        self.directory = Path(directory) if directory is not None else default_directory()
        self.size_limit = size_limit
        self.raw_share = check_share(raw_share)
        if self.raw_share is None:
            settings.setdefault("eviction_policy", "least-recently-stored")
        elif settings.setdefault("eviction_policy", "none") != "none":
            raise ValueError("eviction_policy is diskcache's, used without tiers: give raw_share=None with it")
        self._touched: dict[str, float] = {}  # full key -> time of its last read not yet in the database
        self._touch_lock = threading.Lock()
        new = not os.path.lexists(self.directory / DB_NAME)
        if new and not create:
            what = f"it holds no {DB_NAME}" if self.directory.is_dir() else "no such directory"
            raise StoreError(f"no disk store in {str(self.directory)!r}: {what}")
        with self._errors("open"):
            if create:
                self.directory.mkdir(parents=True, exist_ok=True)
            open_ = lambda: diskcache.Cache(str(self.directory), timeout=timeout, disk=_BytesDisk, size_limit=size_limit, **settings)  # noqa: E731
            try:
                self._cache = open_cache(self.directory, open_, recover=create)
            except sqlite3.DatabaseError as exc:
                if (why := damage(exc, self.directory)) is None:
                    raise
                raise StoreError(f"the disk store in {str(self.directory)!r} is damaged ({why}); an application opening it "
                                 "moves it aside and starts an empty one") from exc  # fmt: skip
        self._cache.disk.max_value_bytes = max_value_bytes
        if new:  # once: the next opening finds its database (a typo of a path shows here, by where it went)
            log.info("created a disk store in %s", self.directory.absolute())

    @contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        try:
            yield
        except StoreError:
            raise
        except (OSError, sqlite3.Error, diskcache.Timeout, UnsafeEntryError) as exc:
            hint = "" if os.access(self.directory, os.W_OK) else " (the cache directory is not writable)"
            raise StoreError(f"DiskCacheStore {op} failed in {str(self.directory)!r}: {exc!r}{hint}") from exc

    @property
    def volume(self) -> int:
        """Estimated bytes on disk (database + value files)."""
        with self._errors("volume"):
            return int(self._cache.volume())

    def budget(self) -> dict[str, int | float | None]:
        """The byte budget and the raw tier's share of it (for ``cachegen stats``)."""
        return {"limit": self.size_limit, "raw_share": self.raw_share}

    def _read(self, fulls: Sequence[str], values: Sequence[object]) -> None:
        """Remember the reads that found a value (tiers only: diskcache keeps its own times otherwise)."""
        if self.raw_share is None:
            return
        now = time.time()
        with self._touch_lock:
            for full, value in zip(fulls, values):
                if value is not None:
                    self._touched.pop(full, None)
                    self._touched[full] = now
            while len(self._touched) > MAX_TOUCHED:
                del self._touched[next(iter(self._touched))]

    def get(self, key: str) -> bytes | None:
        full = self._full(key)
        with self._errors("get"):
            value = self._cache.get(full, default=None, retry=False)
        self._read([full], [value])
        return value

    def read_into(self, key: str, buffer: bytearray) -> memoryview | bytes | None:
        """The value of ``key``, read into ``buffer`` when it is a file that fits (a view of its first bytes),
        else as ``get`` returns it; None when absent. For big values read again and again: ``get`` returns
        each in fresh memory, whose pages the kernel faults in and zeroes first (``docs/history/``)."""
        full = self._full(key)
        with self._errors("read_into"):
            try:
                f = self._cache.get(full, default=None, read=True, retry=False)
            except UnsafeEntryError:  # a small value stored inline (or no plain value: get says which)
                return self.get(key)
            if f is None:
                return None
            self._read([full], [f])
            with f:
                n = os.fstat(f.fileno()).st_size
                if n > len(buffer):
                    return f.read()
                view = memoryview(buffer)[:n]
                got = f.readinto(view)
            return view[:got]  # a short read (the file replaced meanwhile) fails the blob's checks

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        fulls = [self._full(k) for k in keys]
        with self._errors("get_many"):
            values = [self._cache.get(f, default=None, retry=False) for f in fulls]
        self._read(fulls, values)
        return values

    def put(self, key: str, value: bytes) -> None:
        full, data = self._full(key), self._value(value)
        with self._errors("put"):
            self._cache.set(full, data, retry=False)
            self._cull()

    def put_many(self, items: Items) -> None:
        pairs = [(self._full(k), self._value(v)) for k, v in iter_items(items)]
        with self._errors("put_many"):
            for full, data in pairs:
                self._cache.set(full, data, retry=False)
            self._cull()

    def contains(self, key: str) -> bool:
        full = self._full(key)
        with self._errors("contains"):
            return full in self._cache

    def delete(self, key: str) -> None:
        full = self._full(key)
        with self._errors("delete"):
            self._cache.delete(full, retry=False)

    def keys(self, prefix: str = "") -> Iterator[str]:
        start = self._full(prefix)
        with self._errors("keys"):
            matched = [self._strip(k) for k in self._cache.iterkeys() if isinstance(k, str) and k.startswith(start)]
        yield from matched

    def _rows(self) -> list[tuple[str, int, float]]:
        """(full key, bytes, time of its last use) of every entry: diskcache's own table (inline values have
        size 0, their length is the row's), with the reads not yet written (without tiers: its stored time)."""
        rows = self._cache._sql(
            "SELECT key, CASE WHEN filename IS NULL THEN length(value) ELSE size END, access_time FROM Cache WHERE raw = 1"
        ).fetchall()
        with self._touch_lock:
            touched = dict(self._touched)
        return [(k, int(n or 0), max(t or 0.0, touched.get(k, 0.0))) for k, n, t in rows if isinstance(k, str)]

    def entries(self, prefix: str = "") -> Iterator[tuple[str, int, float | None]]:
        """(key, bytes, seconds since it was last used: read or written; without tiers, since it was stored)
        of every entry whose key starts with ``prefix``."""
        start = self._full(prefix)
        with self._errors("entries"):
            rows = self._rows()
        now = time.time()
        yield from ((self._strip(k), n, max(0.0, now - t)) for k, n, t in rows if k.startswith(start))

    def _cull(self) -> None:
        """Bring the cache within ``size_limit`` (tiers only, see the module doc): write the reads kept in memory,
        then evict raw forms one at a time and other entries a whole chunk at a time, least recently used first."""
        if self.raw_share is None or self._cache.volume() <= self.size_limit:
            return
        with self._touch_lock:
            touched, self._touched = self._touched, {}
        if touched:
            with self._cache.transact(retry=False):
                self._cache._con.executemany("UPDATE Cache SET access_time = ? WHERE key = ? AND raw = 1",
                                             [(t, k) for k, t in touched.items()])  # fmt: skip
        rows = self._rows()
        raw = [(k, n) for k, n, t in sorted(rows, key=lambda r: r[2]) if tier_of(k) == RAW_TIER]
        units: dict[str, list[tuple[str, int]]] = {}
        last: dict[str, float] = {}
        for k, n, t in rows:
            if tier_of(k) == CAPACITY_TIER:
                units.setdefault(stem := chunk_of(k), []).append((k, n))
                last[stem] = max(last.get(stem, 0.0), t)
        overhead = self._cache.volume() - sum(n for _, n, _ in rows)  # the database's own pages
        victims = eviction_plan(self.size_limit, self.raw_share, raw, sorted(units.items(), key=lambda u: last[u[0]]), overhead)
        for k in victims:
            self._cache.delete(k, retry=False)

    def close(self) -> None:
        with self._errors("close"):
            self._cache.close()

    def __repr__(self) -> str:
        return f"DiskCacheStore({str(self.directory)!r}, namespace={self.namespace!r}, size_limit={self.size_limit})"
