"""Profile: what a codec knows about one model, fitted offline on real contexts of it.

- one frequency table per (level, kind, layer, component), from the symbols of the
  fitting contexts;
- the per-head transform between channels and components (``transform.py``), fitted from
  the KV's covariance and the model's Fisher (``kvstats.py``), when the configuration has one;
- the model's rotary embedding (``rotary.py``) when keys are coded before it.

Shared by every cache of that model. Saved as safetensors (tables, matrices) + JSON
metadata: no object serialisation. Its id is a hash of its content, so a blob coded with
one profile can never be decoded with another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Union

import numpy as np
import torch

from ..coders.base import TOTAL_FREQ, validate_freqs
from .config import CodecConfig
from ..errors import CacheGenFormatError, CoderError
from ..kv import KVCache
from ..paths import cache_dir
from .pipeline import components, quantise
from .quantize import ALPHABET
from .rotary import RotarySpec
from .transform import Transform, identity_transform

PROFILE_FORMAT = "cachegen-profile-v2"
MAX_PROFILE_TABLES = 1 << 24
IntOrArray = Union[int, np.ndarray]


def counts_to_freqs(counts: np.ndarray, alpha: float = 0.05) -> np.ndarray:
    """Histograms ``(..., A)`` -> uint32 tables summing to ``2**16`` with every entry >= 1.

    ``alpha`` is added to every count (additive smoothing) so symbols unseen while
    profiling stay cheap enough; the floor of 1 keeps everything encodable.
    """
    counts = np.asarray(counts, dtype=np.float64)
    a = counts.shape[-1]
    total = counts.sum(axis=-1, keepdims=True) + alpha * a
    # A table that saw nothing (e.g. the deltas of a one-token chunk) is uniform.
    p = np.where(total > 0, (counts + alpha) / np.where(total > 0, total, 1.0), 1.0 / a)
    f = np.floor(p * (TOTAL_FREQ - a)).astype(np.int64) + 1
    deficit = TOTAL_FREQ - f.sum(axis=-1)
    top = f.argmax(axis=-1)[..., None]
    np.put_along_axis(f, top, np.take_along_axis(f, top, -1) + deficit[..., None], -1)
    return f.astype(np.uint32)


def symbol_histogram(symbols: torch.Tensor) -> torch.Tensor:
    """Counts of ``symbols`` (uint8 ``(2, layers, heads, tokens, dim)``) per (kind, layer, component): ``(2 * layers * channels, 256)``."""
    kinds, layers, heads, _, dim = symbols.shape
    n = kinds * layers * heads * dim
    row = torch.arange(n).reshape(kinds, layers, heads, 1, dim) * ALPHABET
    idx = (row + symbols.long()).reshape(-1)
    return torch.bincount(idx, minlength=n * ALPHABET).reshape(n, ALPHABET)


@dataclass(frozen=True)
class TableLayout:
    """Where each table lives in a profile's flat ``(n_tables, 256)`` array: level-major, then
    kind, layer and component (``head * dim + j``)."""

    num_layers: int
    channels: int
    n_levels: int

    @property
    def per_level(self) -> int:
        return 2 * self.num_layers * self.channels

    @property
    def n_tables(self) -> int:
        return self.n_levels * self.per_level

    def level_base(self, level: int) -> int:
        """Id of the table of (level, keys, layer 0, component 0); the others of the level follow."""
        return level * self.per_level


class Profile:
    """Frequency tables, transform and rotary embedding of one model under one codec configuration."""

    def __init__(
        self, freqs: np.ndarray, meta: dict[str, Any], transform: Transform | None = None, rotary: RotarySpec | None = None
    ) -> None:
        self.meta = dict(meta)
        self.layout = TableLayout(int(meta["num_layers"]), int(meta["channels"]), int(meta["n_levels"]))
        if freqs.shape != (self.layout.n_tables, ALPHABET):
            raise CacheGenFormatError(f"profile tables have shape {freqs.shape}, expected {(self.layout.n_tables, ALPHABET)}")
        if transform is not None:
            layers, heads, dim = transform.shape
            if (layers, heads * dim) != (self.layout.num_layers, self.layout.channels):
                raise CacheGenFormatError(f"profile transform of shape {transform.shape} does not match its tables")
        self.freqs = np.ascontiguousarray(freqs, dtype=np.uint32)
        self.transform = transform
        self.rotary = rotary
        self.meta["rotary"] = rotary.to_dict() if rotary is not None else None
        self.id = _profile_id(self.freqs, self.meta, transform)

    @property
    def codec_id(self) -> str:
        return str(self.meta["codec_id"])

    @property
    def model_fingerprint(self) -> str:
        return str(self.meta.get("model_fingerprint", ""))

    @classmethod
    def fit(
        cls,
        config: CodecConfig,
        caches: Iterable[KVCache],
        *,
        transform: Transform | None = None,
        rotary: RotarySpec | None = None,
        chunk_tokens: int = 1536,
        model_fingerprint: str = "",
        alpha: float = 0.05,
    ) -> "Profile":
        """Histogram the symbols of ``caches`` (contexts from position 0) cut in chunks of
        ``chunk_tokens``, at every level, coded with ``transform`` (identity when None) and
        keys before ``rotary`` (as they are when None)."""
        counts: torch.Tensor | None = None
        shape = None
        n_chunks = 0
        for kv in caches:
            if shape is None:
                shape = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
                counts = torch.zeros(config.n_levels, 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim, ALPHABET, dtype=torch.int64)
                tf = transform if transform is not None else identity_transform(*shape)
                if tf.shape != shape:
                    raise ValueError(f"transform of shape {tf.shape} does not fit KV of shape {kv.shape}")
            elif (kv.num_layers, kv.num_kv_heads, kv.head_dim) != shape:
                raise ValueError(f"all caches must come from one model; got {kv.shape} after {shape}")
            for start in range(0, kv.num_tokens, chunk_tokens):
                comp = components(kv.slice(start, start + chunk_tokens), tf, start=start, sink_tokens=config.sink_tokens, rotary=rotary)
                n_chunks += 1
                for level in range(config.n_levels):
                    coded = quantise(comp, config.level_step(level, fitted=transform is not None), fitted=transform is not None, step_cap=config.step_cap)
                    counts[level] += symbol_histogram(coded.symbols)
        if shape is None or counts is None:
            raise ValueError("Profile.fit needs at least one KV cache")
        meta = {
            "format": PROFILE_FORMAT,
            "codec_id": config.codec_id,
            "codec_config": config.to_dict(),
            "model_fingerprint": model_fingerprint,
            "num_layers": shape[0],
            "kv_heads": shape[1],
            "head_dim": shape[2],
            "channels": shape[1] * shape[2],
            "n_levels": config.n_levels,
            "chunk_tokens": chunk_tokens,
            "n_chunks": n_chunks,
            "alpha": alpha,
        }
        return cls(counts_to_freqs(counts.reshape(-1, ALPHABET).numpy(), alpha), meta, transform, rotary)

    def save(self, path: str | Path) -> Path:
        """Write the profile as safetensors (uint16 tables, float32 transform) with JSON metadata; atomic."""
        from safetensors.numpy import save_file  # noqa: PLC0415

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {"freqs": self.freqs.astype(np.uint16)}
        if self.transform is not None:
            for name in _TRANSFORM_TENSORS:
                tensors[name] = np.ascontiguousarray(getattr(self.transform, name).numpy())
        save_file(tensors, str(tmp), metadata={"cachegen_profile": json.dumps(self.meta)})
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile written by ``save``; anything else raises ``CacheGenFormatError``."""
        from safetensors import safe_open  # noqa: PLC0415

        try:
            with safe_open(str(path), framework="numpy") as f:
                raw_meta = (f.metadata() or {}).get("cachegen_profile")
                names = set(f.keys())
                if raw_meta is None or names not in ({"freqs"}, {"freqs", *_TRANSFORM_TENSORS}):
                    raise CacheGenFormatError(f"{path} is not a cachegen profile")
                meta_probe = raw_meta
                try:
                    probe = json.loads(meta_probe)
                except (ValueError, RecursionError):
                    probe = None
                if isinstance(probe, dict) and probe.get("format") != PROFILE_FORMAT:
                    raise CacheGenFormatError(
                        f"{path} is a {probe.get('format')!r} file, this build reads {PROFILE_FORMAT}: refit it with `cachegen profile`"
                    )
                _check_size(f, path)
                tensors = {name: f.get_tensor(name) for name in names}
        except CacheGenFormatError:
            raise
        except Exception as e:  # safetensors raises several types on bad files
            raise CacheGenFormatError(f"cannot read profile {path}: {e}") from e
        try:
            meta = json.loads(raw_meta)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, ints over 4300 digits, deep nesting
            raise CacheGenFormatError(f"profile {path} has unreadable metadata: {str(e)[:200]}") from None
        if not isinstance(meta, dict) or meta.get("format") != PROFILE_FORMAT:
            raise CacheGenFormatError(f"{path} is not a {PROFILE_FORMAT} file")
        if not isinstance(meta.get("codec_id"), str):
            raise CacheGenFormatError(f"profile {path}: bad codec_id")
        for key in ("num_layers", "channels", "n_levels", "kv_heads", "head_dim"):
            if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or meta[key] < 1:
                raise CacheGenFormatError(f"profile {path}: bad {key}")
        if meta["kv_heads"] * meta["head_dim"] != meta["channels"]:
            raise CacheGenFormatError(f"profile {path}: kv_heads x head_dim != channels")
        if TableLayout(meta["num_layers"], meta["channels"], meta["n_levels"]).n_tables > MAX_PROFILE_TABLES:
            raise CacheGenFormatError(f"profile {path} claims too many tables")
        freqs = tensors["freqs"]
        if freqs.dtype != np.uint16 or freqs.ndim != 2:
            raise CacheGenFormatError(f"profile {path}: tables must be 2-D uint16")
        f32 = freqs.astype(np.uint32)
        try:
            validate_freqs(f32)
        except CoderError:
            raise CacheGenFormatError(f"profile {path}: tables are not normalised to {TOTAL_FREQ}") from None
        transform = _load_transform(tensors, meta, path) if len(tensors) > 1 else None
        rotary = None
        if meta.get("rotary") is not None:
            try:
                rotary = RotarySpec.from_dict(meta["rotary"])
            except ValueError:
                raise CacheGenFormatError(f"profile {path}: bad rotary description") from None
            if rotary.head_dim != meta["head_dim"]:
                raise CacheGenFormatError(f"profile {path}: rotary embedding does not match head_dim")
        return cls(f32, meta, transform, rotary)


_TRANSFORM_TENSORS = ("analysis", "synthesis", "spread")
#: Largest profile file accepted (tables + transform); the reference model's is ~12 MB.
MAX_PROFILE_TENSOR_BYTES = 1 << 31


def _check_size(f: Any, path: str | Path) -> None:
    """Refuse tensors whose declared size is absurd before reading them."""
    total = 0
    for name in f.keys():
        shape = f.get_slice(name).get_shape()
        n = 1
        for d in shape:
            n *= int(d)
        total += 4 * n
    if total > MAX_PROFILE_TENSOR_BYTES:
        raise CacheGenFormatError(f"profile {path} is too large ({total} bytes of tensors)")


def _load_transform(tensors: dict[str, np.ndarray], meta: dict[str, Any], path: str | Path) -> Transform:
    layers, heads, dim = meta["num_layers"], meta["kv_heads"], meta["head_dim"]
    want = {"analysis": (2, layers, heads, dim, dim), "synthesis": (2, layers, heads, dim, dim), "spread": (2, layers, heads, dim)}
    for name, shape in want.items():
        t = tensors[name]
        if t.dtype != np.float32 or t.shape != shape or not np.isfinite(t).all():
            raise CacheGenFormatError(f"profile {path}: transform {name!r} must be finite float32 {shape}")
    a, b = (torch.from_numpy(tensors[n].copy()) for n in ("analysis", "synthesis"))
    if (torch.matmul(b.double(), a.double()) - torch.eye(dim, dtype=torch.float64)).abs().max() > 1e-3:
        raise CacheGenFormatError(f"profile {path}: transform synthesis is not the inverse of its analysis")
    return Transform(a, b, torch.from_numpy(tensors["spread"].copy()))


def _profile_id(freqs: np.ndarray, meta: dict[str, Any], transform: Transform | None) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    h.update(np.ascontiguousarray(freqs, dtype=np.uint32).tobytes())
    if transform is not None:
        for name in _TRANSFORM_TENSORS:
            h.update(getattr(transform, name).contiguous().numpy().tobytes())
    return "p-" + h.hexdigest()


def profile_dir() -> Path:
    """Where profiles live: ``profiles`` in the package's cache directory, beside the converted models."""
    return cache_dir("profiles")


def default_profile_path(model_fingerprint: str, config: CodecConfig) -> Path:
    """The profile path of a model under a codec configuration (found again by fingerprint)."""
    return profile_dir() / f"{model_fingerprint[:32]}-{config.codec_id}.safetensors"


def find_profile(model_fingerprint: str, config: CodecConfig) -> Profile | None:
    """The stored profile of this model and codec, or None (chunks then carry their own tables)."""
    path = default_profile_path(model_fingerprint, config)
    if not path.exists():
        return None
    profile = Profile.load(path)
    if profile.model_fingerprint != model_fingerprint or profile.codec_id != config.codec_id:
        raise CacheGenFormatError(f"profile {path} belongs to another model or codec")
    return profile
