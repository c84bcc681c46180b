"""The ``KVStore`` protocol and a small base class the bundled stores share.

A store maps ``str`` keys to ``bytes`` values. Every store takes a ``namespace`` that
is prepended to every key in the backend (one prefix per deployment), so two
applications sharing one backend never see each other's entries; ``keys()`` yields
keys with the namespace stripped. The namespace is a plain prefix: end it with a
separator (``"app-a:"``) so that no deployment's namespace is a prefix of another's. Every backend failure is raised as
:class:`~cachegen_core.errors.StoreError`, never as a raw driver or OS error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import StoreError

if TYPE_CHECKING:
    from typing_extensions import Self

#: Namespace used when none is given.
DEFAULT_NAMESPACE = "cachegen:"

Items = Iterable[tuple[str, bytes]] | Mapping[str, bytes]


@runtime_checkable
class KVStore(Protocol):
    """Bytes in, bytes out, with batch forms. Failures raise ``StoreError``."""

    namespace: str

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` when absent."""
        ...

    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` atomically (a reader sees all of it or nothing)."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` in order, ``None`` for absent ones."""
        ...

    def put_many(self, items: Items) -> None:
        """Store several ``(key, value)`` pairs; each one atomically."""
        ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> None:
        """Remove ``key``; absent keys are ignored."""
        ...

    def delete_many(self, keys: Sequence[str]) -> None: ...

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Keys (namespace stripped) that start with ``prefix``, in no particular order."""
        ...

    def close(self) -> None: ...


def check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"store keys must be str, got {type(key).__name__}")
    return key


def check_value(value: object, max_value_bytes: int | None = None) -> bytes:
    """``value`` as ``bytes``; ``StoreError`` if larger than ``max_value_bytes``."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"store values must be bytes, got {type(value).__name__}")
    data = bytes(value)
    if max_value_bytes is not None and len(data) > max_value_bytes:
        raise StoreError(f"value of {len(data)} bytes exceeds max_value_bytes={max_value_bytes}")
    return data


def iter_items(items: Items) -> list[tuple[str, bytes]]:
    pairs = items.items() if isinstance(items, Mapping) else items
    return [(check_key(k), v) for k, v in pairs]


class BaseKVStore:
    """Namespacing, argument checks, batch fallbacks and context management.

    Subclasses implement ``get``, ``put``, ``contains``, ``delete``, ``keys`` and
    ``close``; they override the batch methods when the backend has real batch ops.
    ``local``: the store lives on this machine (memory, local disk), so encoding a chunk's raw
    form costs little and the engine has it ready before answering (see ``ChunkWriter``).
    ``shares_values``: ``get`` returns the very ``bytes`` object the store holds (an in-process
    store): a reader that verified that object once need not hash it again, a fetch runs on the
    request's thread (see ``ChunkReader``), and a local store of this kind takes the raw form
    before the answer (a dict insert), where another one gets it from the writer's worker.
    ``same_host``: a fetch is work of this machine's CPU (a copy, a file read, a server on this
    host), so it does not overlap a CPU decode: the streaming controller plans fetch and decode
    in turns (``Controller.serial``). Every local store; a Redis server on a loopback address or a
    Unix socket too.
    """

    local: bool = False
    shares_values: bool = False

    @property
    def same_host(self) -> bool:
        """Whether a fetch runs on this machine's CPU (see the class docstring); by default, ``local``."""
        return self.local

    def __init__(self, namespace: str = DEFAULT_NAMESPACE, max_value_bytes: int | None = None) -> None:
        if not isinstance(namespace, str):
            raise TypeError("namespace must be a str")
        if max_value_bytes is not None and max_value_bytes < 0:
            raise ValueError("max_value_bytes must be >= 0")
        self.namespace = namespace
        self.max_value_bytes = max_value_bytes

    def _full(self, key: str) -> str:
        return self.namespace + check_key(key)

    def _strip(self, full_key: str) -> str:
        return full_key[len(self.namespace) :]

    def _value(self, value: object) -> bytes:
        return check_value(value, self.max_value_bytes)

    # Batch fallbacks -------------------------------------------------------------
    def get(self, key: str) -> bytes | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def put(self, key: str, value: bytes) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def delete(self, key: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: Items) -> None:
        for k, v in iter_items(items):
            self.put(k, v)

    def delete_many(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.delete(k)

    def close(self) -> None:
        """Release the backend's resources (no-op by default)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(namespace={self.namespace!r})"


def fetches_on_cpu(store: object) -> bool:
    """Whether fetching from ``store`` is this machine's CPU work (``same_host``, else ``local``; False for an
    object that says neither): its fetches do not overlap a CPU decode."""
    return bool(getattr(store, "same_host", getattr(store, "local", False)))
