"""Profile: what a codec knows about one model, fitted on real contexts of it.

- the class of every (level, kind, layer, component): which of the codec's fixed tables
  (``classes.py``) codes it, picked from the symbols of the fitting contexts;
- the transform between channels and components, one matrix per group of a layer's heads
  (``transform.py``), fitted from the KV's covariance and the model's Fisher (``kvstats.py``),
  stored with about 6 bits an entry (``transform.to_stored``);
- the model's rotary embedding (``rotary.py``) when keys are coded before it.

Shared by every cache of that model: about 1.8 MB for the reference model (30 layers of
3 KV heads x 64, one 192 x 192 matrix per layer and kind), whatever the number of tables. Saved as safetensors + JSON metadata
(``to_bytes``, ``from_bytes``): no object serialisation, so a profile can be read from a
file or a shared store alike. Its id is a hash of its content, so a blob coded with one
profile can never be decoded with another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from .classes import bank, classes_from_counts
from .config import CodecConfig
from ..errors import CacheGenFormatError
from ..kv import KVCache
from .pipeline import components, quantise
from .quantize import ALPHABET
from .rotary import RotarySpec
from .transform import Transform, from_stored, identity_transform, to_stored

PROFILE_FORMAT = "cachegen-profile-v5"
#: Formats of earlier builds: named when met, so that the user is told to refit.
OLD_FORMATS = ("cachegen-profile-v2", "cachegen-profile-v3", "cachegen-profile-v4")
#: Largest profile accepted (sum of its tensors' bytes); the reference model's is ~1.8 MB, a 7B GQA's ~13 MB.
MAX_PROFILE_BYTES = 1 << 30
_STORED = ("synthesis", "widths", "column_scale", "spread")
#: The metadata entry holding the identity of the model a profile was fitted on (``keys.fingerprint.model_identity``).
IDENTITY_KEY = "model"


def symbol_histogram(symbols: torch.Tensor) -> torch.Tensor:
    """Counts of ``symbols`` (uint8 ``(2, layers, heads, tokens, dim)``) per (kind, layer, component): ``(2 * layers * channels, 256)``."""
    kinds, layers, heads, _, dim = symbols.shape
    n = kinds * layers * heads * dim
    row = torch.arange(n).reshape(kinds, layers, heads, 1, dim) * ALPHABET
    idx = (row + symbols.long()).reshape(-1)
    return torch.bincount(idx, minlength=n * ALPHABET).reshape(n, ALPHABET)


class Profile:
    """Classes, transform and rotary embedding of one model under one codec configuration.

    ``classes``: uint8 ``(n_levels, 2, layers, channels)``, each < ``n_classes``. ``transform``
    (None: components are channels) is kept as stored (``stored``: ``transform.to_stored``), and used as
    stored, by encoders and decoders alike.
    ``origin``: where it came from, for people (logs, the demo); not part of its id.
    """

    def __init__(
        self, classes: np.ndarray, meta: dict[str, Any], stored: dict[str, np.ndarray] | None = None, rotary: RotarySpec | None = None
    ) -> None:
        self.meta = dict(meta)
        shape = (int(meta["n_levels"]), 2, int(meta["num_layers"]), int(meta["channels"]))
        classes = np.asarray(classes)
        if classes.shape != shape or classes.dtype != np.uint8:
            raise CacheGenFormatError(f"profile classes are {classes.dtype} {classes.shape}, expected uint8 {shape}")
        if classes.size and int(classes.max()) >= self.n_classes:
            raise CacheGenFormatError(f"profile classes must be < {self.n_classes}")
        self.classes = np.ascontiguousarray(classes)
        self.classes.flags.writeable = False
        self.stored = stored
        self.transform: Transform | None = None
        if stored is not None:
            try:
                self.transform = from_stored(**stored)
            except ValueError as e:
                raise CacheGenFormatError(f"profile transform: {e}") from None
            fits = self.transform.shape == (shape[2], meta["kv_heads"], meta["head_dim"])
            if not fits or self.transform.group != meta["head_group"]:
                raise CacheGenFormatError(f"profile transform of shape {self.transform.shape} does not match its classes")
        self.rotary = rotary
        self.meta["rotary"] = rotary.to_dict() if rotary is not None else None
        self.meta["format"] = PROFILE_FORMAT
        self.id = _profile_id(self.classes, self.meta, self.stored)
        self.origin = "fitted in this process"

    @property
    def codec_id(self) -> str:
        return str(self.meta["codec_id"])

    @property
    def model_fingerprint(self) -> str:
        return str(self.meta.get("model_fingerprint", ""))

    @property
    def n_classes(self) -> int:
        return int(self.meta["n_classes"])

    @property
    def freqs(self) -> np.ndarray:
        """The tables the classes index (``classes.bank``), uint32 ``(n_classes, 256)``."""
        return bank(self.n_classes)

    def row(self, level: int) -> np.ndarray:
        """The table of every position of the coder's period at ``level``: int32 ``(2 * layers * channels,)``."""
        return self.classes[level].reshape(-1).astype(np.int32)

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
        about: dict[str, Any] | None = None,
        identity: dict[str, Any] | None = None,
    ) -> "Profile":
        """Classes from the symbols of ``caches`` (contexts from position 0) cut in chunks of
        ``chunk_tokens``, at every level, coded with ``transform`` as stored (identity when None)
        and keys before ``rotary`` (as they are when None). ``about``: what it was fitted on, kept
        in the metadata for people; ``identity``: the model's (``keys.fingerprint.model_identity``),
        so that the profile serves the same model loaded in another dtype (not part of its id)."""
        counts: torch.Tensor | None = None
        shape = None
        n_chunks = 0
        kept = to_stored(transform) if transform is not None else None
        stored = from_stored(**kept) if kept is not None else None
        for kv in caches:
            if shape is None:
                shape = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
                counts = torch.zeros(config.n_levels, 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim, ALPHABET, dtype=torch.int64)
                if stored is not None and stored.shape != shape:
                    raise ValueError(f"transform of shape {stored.shape} does not fit KV of shape {kv.shape}")
                want = config.head_group(*shape[1:])
                if stored is not None and stored.group != want:
                    raise ValueError(f"transform of {stored.group} heads per matrix, the codec configuration's is {want}")
                stored = stored if stored is not None else identity_transform(*shape)
            elif (kv.num_layers, kv.num_kv_heads, kv.head_dim) != shape:
                raise ValueError(f"all caches must come from one model; got {kv.shape} after {shape}")
            for start in range(0, kv.num_tokens, chunk_tokens):
                comp = components(kv.slice(start, start + chunk_tokens), stored, start=start, sink_tokens=config.sink_tokens, rotary=rotary)
                n_chunks += 1
                for level in range(config.n_levels):
                    coded = quantise(
                        comp, config.level_step(level, fitted=transform is not None), fitted=transform is not None, step_cap=config.step_cap
                    )
                    counts[level] += symbol_histogram(coded.symbols)
        if shape is None or counts is None:
            raise ValueError("Profile.fit needs at least one KV cache")
        meta = {
            "codec_id": config.codec_id,
            "codec_config": config.to_dict(),
            "model_fingerprint": model_fingerprint,
            "num_layers": shape[0],
            "kv_heads": shape[1],
            "head_dim": shape[2],
            "channels": shape[1] * shape[2],
            "head_group": stored.group if transform is not None else 1,
            "n_levels": config.n_levels,
            "n_classes": config.table_classes,
            "chunk_tokens": chunk_tokens,
            "n_chunks": n_chunks,
            "fitted_on": about or {},
            **({IDENTITY_KEY: identity} if identity is not None else {}),
        }
        classes = classes_from_counts(counts.numpy(), config.table_classes).reshape(config.n_levels, 2, shape[0], -1)
        return cls(classes, meta, kept, rotary)

    def to_bytes(self) -> bytes:
        """The profile as safetensors bytes (uint8 classes, the stored transform) with JSON metadata."""
        from safetensors.numpy import save  # noqa: PLC0415

        tensors = {"classes": self.classes, **(self.stored or {})}
        return save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata={"cachegen_profile": json.dumps(self.meta)})

    def save(self, path: str | Path) -> Path:
        """Write ``to_bytes`` to ``path`` atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{id(self)}.tmp")
        tmp.write_bytes(self.to_bytes())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile written by ``save``; anything else raises ``CacheGenFormatError``."""
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise CacheGenFormatError(f"cannot read profile {path}: {e}") from e
        profile = cls.from_bytes(data, str(path))
        profile.origin = str(path)
        return profile

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "profile") -> "Profile":
        """Parse ``to_bytes``'s output (``source`` names it in errors); anything else raises ``CacheGenFormatError``."""
        from safetensors.numpy import load  # noqa: PLC0415

        meta = _read_meta(data, source)
        try:
            tensors = load(bytes(data))
        except Exception as e:  # safetensors raises several types on bad bytes
            raise CacheGenFormatError(f"cannot read profile {source}: {e}") from e
        return _from_parts(tensors, meta, source)


def _read_meta(data: bytes, source: str) -> dict[str, Any]:
    """The checked metadata of safetensors ``data`` (read from its header alone, before any tensor)."""
    if len(data) < 8:
        raise CacheGenFormatError(f"{source} is not a cachegen profile (too short)")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, 1 << 24):
        raise CacheGenFormatError(f"{source} is not a cachegen profile (bad header length)")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
        raw = header.get("__metadata__", {}).get("cachegen_profile") if isinstance(header, dict) else None
        meta = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError, AttributeError):  # JSONDecodeError, ints over 4300 digits, deep nesting
        raise CacheGenFormatError(f"{source} is not a cachegen profile (unreadable header)") from None
    if not isinstance(meta, dict):
        raise CacheGenFormatError(f"{source} is not a cachegen profile")
    if meta.get("format") in OLD_FORMATS:
        raise CacheGenFormatError(f"{source} is a {meta['format']!r} file, this build reads {PROFILE_FORMAT}: refit it with `cachegen profile`")
    if meta.get("format") != PROFILE_FORMAT:
        raise CacheGenFormatError(f"{source} is not a {PROFILE_FORMAT} file")
    if not isinstance(meta.get("codec_id"), str) or not isinstance(meta.get("model_fingerprint", ""), str):
        raise CacheGenFormatError(f"profile {source}: bad codec_id or model_fingerprint")
    for key in ("num_layers", "channels", "n_levels", "kv_heads", "head_dim", "n_classes", "head_group"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or not 1 <= meta[key] <= 1 << 16:
            raise CacheGenFormatError(f"profile {source}: bad {key}")
    if meta["kv_heads"] * meta["head_dim"] != meta["channels"] or not 2 <= meta["n_classes"] <= 256:
        raise CacheGenFormatError(f"profile {source}: kv_heads x head_dim != channels, or bad n_classes")
    if meta["kv_heads"] % meta["head_group"]:
        raise CacheGenFormatError(f"profile {source}: head_group does not divide kv_heads")
    layers, channels, groups = meta["num_layers"], meta["channels"], meta["kv_heads"] // meta["head_group"]
    n = channels // groups
    size = meta["n_levels"] * 2 * layers * channels + 2 * layers * (groups * (n * n + 5 * n) + 2 * channels)  # <= 8 bits an entry
    if size > MAX_PROFILE_BYTES:
        raise CacheGenFormatError(f"profile {source} claims too large a model")
    return meta


def _from_parts(tensors: dict[str, np.ndarray], meta: dict[str, Any], source: str) -> Profile:
    """A profile from its parsed tensors and checked metadata."""
    layers, heads, dim, group = meta["num_layers"], meta["kv_heads"], meta["head_dim"], meta["head_group"]
    if set(tensors) not in ({"classes"}, {"classes", *_STORED}):
        raise CacheGenFormatError(f"profile {source} holds tensors {sorted(tensors)}")
    stored = None
    if len(tensors) > 1:
        n = group * dim
        want = {"widths": ((2, layers, heads // group, n), np.uint8), "column_scale": ((2, layers, heads // group, n), np.float32),
                "spread": ((2, layers, heads, dim), np.float16)}  # fmt: skip
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            if t.dtype != dtype or t.shape != shape or not np.isfinite(t).all():
                raise CacheGenFormatError(f"profile {source}: transform {name!r} must be finite {np.dtype(dtype).name} {shape}")
        if tensors["synthesis"].dtype != np.uint8 or tensors["synthesis"].ndim != 1:
            raise CacheGenFormatError(f"profile {source}: transform 'synthesis' must be packed uint8 bytes")
        stored = {name: tensors[name] for name in _STORED}
    rotary = None
    if meta.get("rotary") is not None:
        try:
            rotary = RotarySpec.from_dict(meta["rotary"])
        except ValueError:
            raise CacheGenFormatError(f"profile {source}: bad rotary description") from None
        if rotary.head_dim != dim:
            raise CacheGenFormatError(f"profile {source}: rotary embedding does not match head_dim")
    profile = Profile(tensors["classes"], meta, stored, rotary)
    profile.origin = source
    return profile


def _profile_id(classes: np.ndarray, meta: dict[str, Any], stored: dict[str, np.ndarray] | None) -> str:
    """A hash of what codes: the metadata (but the model's identity, which only finds the profile), classes, transform."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps({k: v for k, v in meta.items() if k != IDENTITY_KEY}, sort_keys=True, separators=(",", ":")).encode())
    h.update(classes.tobytes())
    for name in _STORED if stored is not None else ():
        h.update(np.ascontiguousarray(stored[name]).tobytes())  # type: ignore[index]
    return "p-" + h.hexdigest()
