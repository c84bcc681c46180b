"""``SignedStore``: every value authenticated with a per-deployment key (HMAC-SHA256).

A store shared by several machines is only as trustworthy as everyone who can write to
it; the checksums inside a blob detect corruption, not forgery. ``SignedStore`` wraps
any ``KVStore``: ``put`` appends a tag, ``HMAC-SHA256(key, "cachegen-v1" | len(key) |
key | value)`` over the whole value (a blob's header and payload, or a manifest) and the
logical key it is stored under, so a valid value cannot be replayed under another key.
``get`` verifies the tag in constant time and strips it *before* the value is handed on:
a value without a tag, or with a wrong one, is a miss (``None``), never bytes to decode.
The first such value is logged (once per store, not per request) and every one is
counted in ``rejected``.

Stored layout: ``value | tag (32 bytes) | b"CGT1"``. The tag sits at the end, so tools
that only read a blob's header (``cachegen stats``) need no key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from collections.abc import Iterator, Sequence

from .base import Items, KVStore, check_key, fetches_on_cpu, iter_items

log = logging.getLogger(__name__)

#: Marks the end of a signed value.
TRAILER = b"CGT1"
TAG_BYTES = hashlib.sha256().digest_size
OVERHEAD = TAG_BYTES + len(TRAILER)
#: Shortest key accepted: 16 bytes (use 32 random bytes: ``python -c "import secrets; print(secrets.token_hex(32))"``).
MIN_KEY_BYTES = 16
_DOMAIN = b"cachegen-v1"


def as_key_bytes(key: str | bytes) -> bytes:
    """A key given as text (UTF-8) or bytes; ``ValueError`` when shorter than ``MIN_KEY_BYTES``."""
    raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(f"the HMAC key must be at least {MIN_KEY_BYTES} bytes (32 random bytes recommended)")
    return raw


def tag(key: bytes, store_key: str, value: bytes) -> bytes:
    """The tag of ``value`` stored under ``store_key`` (the logical key, without the store's namespace)."""
    name = store_key.encode("utf-8", "surrogateescape")
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    mac.update(len(name).to_bytes(4, "little"))
    mac.update(name)
    mac.update(value)
    return mac.digest()


def sign(key: bytes, store_key: str, value: bytes) -> bytes:
    """``value`` as stored: followed by its tag and the trailer."""
    return bytes(value) + tag(key, store_key, value) + TRAILER


def verify(key: bytes, store_key: str, stored: bytes) -> bytes | None:
    """The value of a signed ``stored`` entry, or ``None`` if it has no tag or a wrong one."""
    if len(stored) < OVERHEAD or not stored.endswith(TRAILER):
        return None
    value, mac = stored[:-OVERHEAD], stored[-OVERHEAD : -len(TRAILER)]
    return value if hmac.compare_digest(mac, tag(key, store_key, value)) else None


class SignedStore:
    """A ``KVStore`` over ``inner`` whose values are tagged with ``key`` on write and verified on read.

    Everything else (namespace, keys, deletes, close) is the inner store's. ``rejected``:
    values refused since this wrapper was made (no tag or a wrong one).
    """

    def __init__(self, inner: KVStore, key: str | bytes) -> None:
        if isinstance(inner, SignedStore):
            raise TypeError("the store is signed already")
        self.inner = inner
        self._key = as_key_bytes(key)
        self.rejected = 0
        self._lock = threading.Lock()

    @property
    def namespace(self) -> str:
        return self.inner.namespace

    @property
    def local(self) -> bool:
        """Whether the wrapped store lives on this machine (see ``BaseKVStore.local``)."""
        return bool(getattr(self.inner, "local", False))

    @property
    def same_host(self) -> bool:
        """Whether a fetch from the wrapped store is this machine's CPU work (see ``BaseKVStore.same_host``)."""
        return fetches_on_cpu(self.inner)

    def _check(self, store_key: str, stored: bytes | None) -> bytes | None:
        if stored is None:
            return None
        value = verify(self._key, store_key, stored)
        if value is None:
            with self._lock:
                self.rejected += 1
                first = self.rejected == 1
            if first:
                why = "has no tag" if not stored.endswith(TRAILER) else "has a wrong tag"
                log.warning("%r: value of %s %s: treated as a miss, never decoded (further rejections counted in "
                            "rejected, not logged)", self, store_key[:24], why)  # fmt: skip
        return value

    def get(self, key: str) -> bytes | None:
        return self._check(key, self.inner.get(check_key(key)))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._check(k, v) for k, v in zip(keys, self.inner.get_many(keys))]

    def put(self, key: str, value: bytes) -> None:
        self.inner.put(key, sign(self._key, check_key(key), value))

    def put_many(self, items: Items) -> None:
        self.inner.put_many([(k, sign(self._key, k, v)) for k, v in iter_items(items)])

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        self.inner.delete_many(keys)

    def keys(self, prefix: str = "") -> Iterator[str]:
        return self.inner.keys(prefix)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> SignedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SignedStore({self.inner!r})"


def unwrap(store: KVStore) -> KVStore:
    """The backend under any ``SignedStore`` (for tools that list or delete entries, never read values)."""
    while isinstance(store, SignedStore):
        store = store.inner
    return store
