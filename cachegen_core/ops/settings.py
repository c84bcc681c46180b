"""Configuration from the environment: ``CACHEGEN_*`` variables (documented in ``docs/configuration.md``).

:class:`CacheGenSettings` reads them (pydantic-settings); arguments given to
``KVEngine.from_pretrained`` (or ``CacheGenLLM.from_model_id``) win over them, and a
setting left unset leaves the engine's own default. Two entry points serve the engine:
:func:`engine_options` (its keyword arguments and decode limits) and
:func:`resolve_store` (the store: opened from ``CACHEGEN_STORE`` when none is given,
wrapped in a :class:`~cachegen_core.stores.signed.SignedStore` when a key is set).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..codec.limits import DecodeLimits
from ..errors import StoreURLError
from ..stores.base import DEFAULT_NAMESPACE, KVStore

#: Engine keyword arguments a setting can supply, and the setting that does.
ENGINE_FIELDS = ("chunk_tokens", "level", "store_options", "slo_s", "progress", "kv_memory", "kv_queue")
_RAW_FORMS = ("raw", "lossless")


def _option(v: Any) -> int | str:
    """A stored option from the environment: a level (``"1"``) or a raw form (``"raw"``, ``"lossless"``)."""
    if isinstance(v, str):
        v = v.strip().strip("'\"")
        if v in _RAW_FORMS:
            return v
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"not a level or raw form: {v!r}")
    return v


class CacheGenSettings(BaseSettings):
    """Every ``CACHEGEN_*`` setting; ``None`` means "not set: the engine's default"."""

    model_config = SettingsConfigDict(env_prefix="CACHEGEN_", frozen=True, extra="ignore")

    store: str = Field(
        "disk",
        description="disk, memory, a directory (./kv, /var/kv: created if missing), a store's directory "
        "by its name, disk:///path, redis://, rediss:// or redis-cluster:// URL (stores/url.py)",
    )
    namespace: str = Field(DEFAULT_NAMESPACE, description="prefix of every key in the store")
    cache_dir: Path | None = Field(None, description="the package cache (models, profiles, the disk store's kv/)")
    chunk_tokens: int | None = Field(None, ge=1, description="tokens per stored chunk (engine default 1536)")
    level: int | str | None = Field(None, description="quality of a hit without a deadline: a level, raw or lossless")
    store_options: Annotated[tuple[int | str, ...] | None, NoDecode] = Field(None, description="forms written on a miss, e.g. raw,1,3")
    slo_s: float | None = Field(None, gt=0, description="deadline for streaming a prompt's cached chunks, seconds")
    hmac_key: SecretStr | None = Field(None, description="authenticate every stored value with this key")
    max_elements_per_byte: int | None = Field(None, ge=1, description="decoded KV elements per blob byte")
    max_blob_bytes: int | None = Field(None, ge=1, description="bytes of one blob")
    max_elements: int | None = Field(None, ge=1, description="decoded KV elements of one blob")
    max_tokens: int | None = Field(None, ge=1, description="tokens of one chunk")
    progress: bool | None = Field(None, description="progress bar on long cold work (on a terminal)")
    auto_profile: bool = Field(True, description="fit a model's missing profile in the background and share it via the store")
    kv_memory: int | None = Field(
        None, ge=1, description="bytes the KV of running requests may take, e.g. 8G (default: a share of the device's memory)"
    )
    kv_queue: int | None = Field(None, ge=0, description="requests that may wait for KV memory before one is refused")

    @field_validator("kv_memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        if isinstance(v, str):
            from ..stores.url import parse_size  # noqa: PLC0415

            return parse_size(v) if v.strip() else None
        return v

    @field_validator("store_options", mode="before")
    @classmethod
    def _options(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip().strip("[]")
            return tuple(_option(x) for x in v.replace(",", " ").split()) or None
        return None if v is None else tuple(_option(x) for x in v)

    @field_validator("level", mode="after")
    @classmethod
    def _level(cls, v: Any) -> Any:
        return None if v is None else _option(v)

    @field_validator("hmac_key", "cache_dir", "slo_s", "chunk_tokens", "level", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @property
    def decode_limits(self) -> DecodeLimits:
        return DecodeLimits(self.max_elements_per_byte, self.max_blob_bytes, self.max_elements, self.max_tokens)

    def key_bytes(self) -> bytes | None:
        """The HMAC key, or None when none is set."""
        return None if self.hmac_key is None else self.hmac_key.get_secret_value().encode("utf-8")

    def open_store(self, **options: Any) -> KVStore:
        """The store ``store`` names (not signed: see :func:`resolve_store`); ``options`` go to
        :func:`~cachegen_core.stores.url.open_store` (``namespace``, ``create``, a constructor's options).

        A store URL that names no store raises ``StoreURLError``, naming ``CACHEGEN_STORE`` when it came from there.
        """
        from ..stores.url import describe, open_store  # noqa: PLC0415

        try:
            return open_store(self.store, **{"namespace": self.namespace, "cache_dir": self.cache_dir, **options})
        except ValueError as e:  # StoreURLError, or a value a store's constructor refuses (disk?size_limit=0)
            if (variable := self._variable("store")) is None:
                raise
            raise StoreURLError(f"{variable}={describe(self.store)!r}: {e}") from e

    def _variable(self, name: str) -> str | None:
        """The environment variable that set field ``name``, or None when it was given in code or left unset."""
        wanted = f"{self.model_config.get('env_prefix', '')}{name}".upper()
        value = getattr(self, name)
        return next((k for k, v in os.environ.items() if k.upper() == wanted and v == value), None)


def load(**overrides: Any) -> CacheGenSettings:
    """The settings of the environment, with ``overrides`` (field names) on top."""
    return CacheGenSettings(**overrides)


def resolve_store(store: KVStore | None, settings: CacheGenSettings | None = None) -> KVStore:
    """``store`` (or the configured one when None), signed when an HMAC key is configured.

    A store that is a ``SignedStore`` already is returned as it is.
    """
    from ..stores.signed import SignedStore  # noqa: PLC0415

    settings = settings or load()
    if store is None:
        store = settings.open_store()
    key = settings.key_bytes()
    if key is not None and not isinstance(store, SignedStore):
        store = SignedStore(store, key)
    return store


def engine_options(kwargs: dict[str, Any], settings: CacheGenSettings | None = None) -> tuple[dict[str, Any], DecodeLimits]:
    """``KVEngine`` keyword arguments (``kwargs``, a setting filling each one absent or None) and the decode limits.

    ``kwargs`` may hold ``decode_limits`` (a :class:`DecodeLimits`), which then wins over the settings' limits.
    """
    settings = settings or load()
    out = dict(kwargs)
    limits = out.pop("decode_limits", None) or settings.decode_limits
    for name in ENGINE_FIELDS:
        if out.get(name) is None:
            value = getattr(settings, name)
            if value is None:
                out.pop(name, None)
            else:
                out[name] = list(value) if name == "store_options" else value
    return out, limits
