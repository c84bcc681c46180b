"""CodecConfig: the frozen set of choices that defines a CacheGen bitstream."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .classes import DEFAULT_CLASSES, digest

#: Step of each level, from near-lossless (0) to the coarsest. With a profile the step is in
#: units of the RMS of the Fisher-weighted components (``transform.py``), the same for every
#: component of every layer; without one, in units of the RMS of each layer's channels.
#: Chosen on SmolLM2-135M (``docs/history/2026-11-24-results-journal.md``, "Codec v2"; level 1 moved from 0.075 to 0.085 with
#: codec v3's fixed tables; level 2 added with the transform across heads, 2026-11-28). Level 2 is the default since
#: 2026-11-29: with the profile's per-layer steps it codes held-out transcripts in 2.93-2.96 bits per element within
#: every quality target level 1 was chosen for (>= 99.0 % top-1, <= +0.5 % ppl, KL <= 0.41 mnat per token;
#: ``docs/history/2026-11-28-bits-per-element.md``), 8 % fewer bits than level 1.
DEFAULT_LEVELS: tuple[float, ...] = (0.03, 0.085, 0.104, 0.16, 0.34)
TRANSFORMS = ("fisher-klt", "pca", "none")


@dataclass(frozen=True)
class CodecConfig:
    """What a blob needs beyond its own header to be decoded the same way it was encoded.

    ``levels``: the step of each level (see ``DEFAULT_LEVELS``); ``default_level``: used when
    none is asked. ``sink_tokens``: tokens at context positions below this are kept exactly
    (the attention sink). ``step_cap``: no component's step exceeds this many of its own RMS
    in the chunk (0: no cap). ``stream_symbols``: symbols per substream, at least (whole
    tokens; fewer only when the chunk is smaller); a substream's rANS flush costs ~48 bytes,
    so 2^17 symbols keep it under 0.3 % down to one bit per element.
    ``transform`` and ``fisher_eps``: how a profile fits its transform
    (``transform.py``): ``"fisher-klt"`` (decorrelating, weighted by the model's Fisher,
    regularised by ``fisher_eps``), ``"pca"`` (decorrelating, unweighted) or ``"none"``.
    ``group_channels``: one transform matrix spans as many of a layer's KV heads as fit in this
    many channels (``head_group``): heads of a layer are projections of the same hidden state, so
    a transform across them codes the reference model's KV in 7 % fewer bits than one per head at
    the same quality (``docs/history/2026-11-28-transform-across-heads.md``); an element costs up to
    ``group_channels`` multiply-adds to decode (64 per head), and the profile holds the larger matrices (1.8 MB instead of 0.6 MB, stored in
    about 6 bits an entry).
    ``table_classes``: how many frequency tables code every component (``classes.py``: discrete
    Gaussian laws at log-spaced scales; a profile or the blob names each component's).
    ``unprofiled_scale``: without a profile the step of a level above 0 is this many times its
    step (in units of each layer's RMS): the default level's is 0.2, measured so that it costs
    ~4.25 bits per element without a profile at 99.0 % top-1 (``docs/results.md``);
    ``weighted_scale``: the same factor when the codec has step weights (``weights.py``): the default
    level's is 0.27, chosen on the tuning transcripts 0-11 for ~3.85 bits at 99.1-99.2 % top-1 (2026-11-27;
    both factors were 2.356 and 3.176 while level 1, step 0.085, was the default: the default's step without a
    profile is the same).
    """

    levels: tuple[float, ...] = field(default=DEFAULT_LEVELS)
    default_level: int = 2
    sink_tokens: int = 1
    step_cap: float = 0.0
    stream_symbols: int = 1 << 17
    transform: str = "fisher-klt"
    fisher_eps: float = 1.0
    group_channels: int = 256
    unprofiled_scale: float = 0.085 * 2.356 / 0.104
    weighted_scale: float = 0.085 * 3.176 / 0.104
    table_classes: int = DEFAULT_CLASSES

    def __post_init__(self) -> None:
        if not self.levels or any(not isinstance(s, (int, float)) or not 0 < s < float("inf") for s in self.levels):
            raise ValueError("levels must be a non-empty sequence of positive steps")
        object.__setattr__(self, "levels", tuple(float(s) for s in self.levels))
        if list(self.levels) != sorted(set(self.levels)):
            raise ValueError("levels must be strictly increasing (0 = finest)")
        if not 0 <= self.default_level < len(self.levels):
            raise ValueError(f"default_level must be in [0, {len(self.levels)})")
        if self.sink_tokens < 0:
            raise ValueError("sink_tokens must be >= 0")
        if self.step_cap < 0:
            raise ValueError("step_cap must be >= 0")
        if not 0 < self.unprofiled_scale < float("inf") or not 0 < self.weighted_scale < float("inf"):
            raise ValueError("unprofiled_scale and weighted_scale must be positive")
        if self.stream_symbols < 1:
            raise ValueError("stream_symbols must be >= 1")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}")
        if not self.fisher_eps > 0:
            raise ValueError("fisher_eps must be > 0")
        if self.group_channels < 1:
            raise ValueError("group_channels must be >= 1")
        if not 2 <= self.table_classes <= 256:
            raise ValueError("table_classes must be in [2, 256]")

    @property
    def n_levels(self) -> int:
        return len(self.levels)

    def level_step(self, level: int, *, fitted: bool = True, weighted: bool = False) -> float:
        """The step of ``level`` (see ``DEFAULT_LEVELS``); ``fitted=False``: for a codec without a
        fitted transform (``unprofiled_scale`` times larger, ``weighted_scale`` with step weights; level 0
        is near-lossless either way)."""
        if not 0 <= level < self.n_levels:
            raise ValueError(f"level {level} not in [0, {self.n_levels})")
        if fitted or level == 0:
            return self.levels[level]
        return self.levels[level] * (self.weighted_scale if weighted else self.unprofiled_scale)

    def head_group(self, heads: int, dim: int) -> int:
        """KV heads per transform matrix for a model of ``heads`` heads of ``dim`` channels: the largest
        divisor of ``heads`` whose channels fit in ``group_channels`` (at least one head)."""
        return max((g for g in range(1, heads + 1) if heads % g == 0 and g * dim <= self.group_channels), default=1)

    def tokens_per_stream(self, symbols_per_token: int) -> int:
        """Tokens per substream for a model with ``symbols_per_token`` (2 x layers x channels)."""
        return max(1, -(-self.stream_symbols // max(symbols_per_token, 1)))

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-ready data: hashed into ``codec_id``, written into headers for people and tools."""
        d = asdict(self)
        d["levels"] = list(self.levels)
        return d

    @property
    def codec_id(self) -> str:
        """Stable id of this configuration and of the tables it codes with (``classes.digest``);
        blobs of another configuration are rejected."""
        canon = json.dumps({**self.to_dict(), "tables": digest(self.table_classes)}, sort_keys=True, separators=(",", ":"))
        return "cachegen-v3-" + hashlib.blake2b(canon.encode(), digest_size=8).hexdigest()
