"""Profile: per-model symbol statistics turned into integer frequency tables.

One table per (K/V, layer, channel) for anchors (shared by every level, since anchors
are quantised the same way at every level) and one per (level, K/V, layer, channel)
for deltas, fitted offline on real contexts of the model and shared by every cache of
that model. Saved as safetensors (tables) + JSON metadata: no object serialisation. Its id is a hash
of its content, so a blob coded with one profile can never be decoded with another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Union

import numpy as np
import torch

from .coders.base import TOTAL_FREQ, validate_freqs
from .config import CodecConfig
from .errors import CacheGenFormatError, CoderError
from .kv import KVCache, merge_heads
from .paths import cache_dir
from .quantize import ALPHABET

PROFILE_FORMAT = "cachegen-profile-v1"
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
    """Counts of ``symbols`` (uint8 ``(layers, n, channels)``) per (layer, channel): ``(layers, channels, 256)``."""
    layers, _, channels = symbols.shape
    idx = (torch.arange(layers)[:, None, None] * channels + torch.arange(channels)[None, None, :]) * ALPHABET
    idx = (idx + symbols.long()).reshape(-1)
    return torch.bincount(idx, minlength=layers * channels * ALPHABET).reshape(layers, channels, ALPHABET)


@dataclass(frozen=True)
class TableLayout:
    """Where each table lives in a profile's flat ``(n_tables, 256)`` array."""

    num_layers: int
    channels: int
    n_levels: int

    @property
    def n_tables(self) -> int:
        return 2 * self.num_layers * self.channels * (1 + self.n_levels)

    def anchor_base(self, kind: IntOrArray, layer: IntOrArray) -> IntOrArray:
        """Id of the table of channel 0 for anchors of (kind, layer); channels follow. Broadcasts over arrays."""
        return (kind * self.num_layers + layer) * self.channels

    def delta_base(self, level: int, kind: IntOrArray, layer: IntOrArray) -> IntOrArray:
        """Id of the table of channel 0 for deltas of (level, kind, layer); channels follow. Broadcasts over arrays."""
        head = 2 * self.num_layers * self.channels
        return head + ((level * 2 + kind) * self.num_layers + layer) * self.channels


class Profile:
    """Frequency tables of one model under one codec configuration."""

    def __init__(self, freqs: np.ndarray, meta: dict[str, Any]) -> None:
        self.meta = dict(meta)
        self.layout = TableLayout(int(meta["num_layers"]), int(meta["channels"]), int(meta["n_levels"]))
        if freqs.shape != (self.layout.n_tables, ALPHABET):
            raise CacheGenFormatError(f"profile tables have shape {freqs.shape}, expected {(self.layout.n_tables, ALPHABET)}")
        self.freqs = np.ascontiguousarray(freqs, dtype=np.uint32)
        self.id = _profile_id(self.freqs, self.meta)

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
        chunk_tokens: int = 1536,
        model_fingerprint: str = "",
        alpha: float = 0.05,
    ) -> "Profile":
        """Histogram the symbols of ``caches`` cut in chunks of ``chunk_tokens``, at every level."""
        anchor_counts: torch.Tensor | None = None
        delta_counts: torch.Tensor | None = None
        shape = None
        n_chunks = 0
        for kv in caches:
            if shape is None:
                shape = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
                channels = kv.num_kv_heads * kv.head_dim
                anchor_counts = torch.zeros(2, kv.num_layers, channels, ALPHABET, dtype=torch.int64)
                delta_counts = torch.zeros(config.n_levels, 2, kv.num_layers, channels, ALPHABET, dtype=torch.int64)
            elif (kv.num_layers, kv.num_kv_heads, kv.head_dim) != shape:
                raise ValueError(f"all caches must come from one model; got {kv.shape} after {shape}")
            for start in range(0, kv.num_tokens, chunk_tokens):
                chunk = kv.slice(start, start + chunk_tokens)
                n_chunks += 1
                for kind, x in enumerate((chunk.keys, chunk.values)):
                    x = merge_heads(x)
                    for level in range(config.n_levels):
                        q = config.quantize(x, level, kind)
                        if level == 0:
                            anchor_counts[kind] += symbol_histogram(q.anchors)
                        delta_counts[level, kind] += symbol_histogram(q.deltas)
        if shape is None:
            raise ValueError("Profile.fit needs at least one KV cache")
        counts = torch.cat([anchor_counts.reshape(-1, ALPHABET), delta_counts.reshape(-1, ALPHABET)])
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
        return cls(counts_to_freqs(counts.numpy(), alpha), meta)

    def save(self, path: str | Path) -> Path:
        """Write the profile as safetensors (uint16 tables) with JSON metadata; atomic."""
        from safetensors.numpy import save_file  # noqa: PLC0415

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"freqs": self.freqs.astype(np.uint16)}, str(tmp), metadata={"cachegen_profile": json.dumps(self.meta)})
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile written by ``save``; anything else raises ``CacheGenFormatError``."""
        from safetensors import safe_open  # noqa: PLC0415

        try:
            with safe_open(str(path), framework="numpy") as f:
                raw_meta = (f.metadata() or {}).get("cachegen_profile")
                if raw_meta is None or set(f.keys()) != {"freqs"}:
                    raise CacheGenFormatError(f"{path} is not a cachegen profile")
                freqs = f.get_tensor("freqs")
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
        for key in ("num_layers", "channels", "n_levels"):
            if not isinstance(meta.get(key), int) or meta[key] < 1:
                raise CacheGenFormatError(f"profile {path}: bad {key}")
        if TableLayout(meta["num_layers"], meta["channels"], meta["n_levels"]).n_tables > MAX_PROFILE_TABLES:
            raise CacheGenFormatError(f"profile {path} claims too many tables")
        if freqs.dtype != np.uint16 or freqs.ndim != 2:
            raise CacheGenFormatError(f"profile {path}: tables must be 2-D uint16")
        f32 = freqs.astype(np.uint32)
        try:
            validate_freqs(f32)
        except CoderError:
            raise CacheGenFormatError(f"profile {path}: tables are not normalised to {TOTAL_FREQ}") from None
        return cls(f32, meta)


def _profile_id(freqs: np.ndarray, meta: dict[str, Any]) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    h.update(np.ascontiguousarray(freqs, dtype=np.uint32).tobytes())
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
