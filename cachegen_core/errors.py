"""Typed errors of the core: every bad input ends in one of these, never in a crash."""

from __future__ import annotations


class CacheGenError(Exception):
    """Base class of every error raised on purpose by cachegen_core."""


class CacheGenFormatError(CacheGenError, ValueError):
    """A blob (or a profile file) is truncated, corrupted, oversized, foreign or otherwise unusable."""


class CoderError(CacheGenFormatError):
    """An entropy coder rejected its input (bad tables, garbage or truncated substream)."""


class StoreError(CacheGenError):
    """A KV store could not complete an operation (server down, disk full, read-only...)."""


class StoreURLError(CacheGenError, ValueError):
    """A store URL (``CACHEGEN_STORE``, a ``cachegen`` command's STORE) names no store: an unknown scheme, word or option,
    a bad option value, options on a plain path. Raised when the store is opened, before anything is created."""


class BackendUnavailable(CacheGenError, RuntimeError):
    """A coder or decoder backend asked for cannot run here (no GPU, no Triton, library not built...).

    Not a ``CacheGenFormatError``: the blob is fine, this process is not set up to decode it so.
    """


class BlobMissing(StoreError):
    """A blob the request looked for is not in the store (never written, evicted or expired): a miss, not a failure."""


class ModelNotFoundError(CacheGenError, FileNotFoundError):
    """The model argument names nothing that can be loaded: no such directory or ``.gguf`` file, no such model (or
    revision, or file) on the Hugging Face hub, or a hub model that cannot be downloaded now."""


class ModelNotCachedError(ModelNotFoundError):
    """A hub model is not in the local Hugging Face cache, and downloads are off (``HF_HUB_OFFLINE=1``, or
    ``local_files_only=True`` in ``model_kwargs``)."""


class ModelDownloadError(ModelNotFoundError):
    """A hub model is not in the local Hugging Face cache, and the hub could not be reached (network, server)."""


class EngineBusy(CacheGenError, RuntimeError):
    """The engine's queue of requests waiting for KV memory is full: try again later, or raise ``kv_queue``."""


class TooLarge(CacheGenError, ValueError):
    """A request's KV alone exceeds the engine's KV memory: shorten it, or raise ``kv_memory``."""
