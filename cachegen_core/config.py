"""CodecConfig: the frozen set of choices that defines a CacheGen bitstream."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .quantize import layer_groups

#: Delta step per layer group (first third, middle, last third of the layers), in units of
#: the channel's delta RMS, one tuple per level from near-lossless (0) to aggressive.
DEFAULT_LEVELS: tuple[tuple[float, float, float], ...] = (
    (0.05, 0.1, 0.15),
    (0.5, 1.0, 1.5),
    (1.0, 2.0, 3.0),
    (2.0, 3.0, 4.0),
)


@dataclass(frozen=True)
class CodecConfig:
    """What a blob needs beyond its own header to be decoded the same way it was encoded.

    ``group_size``: tokens per anchor group. ``tokens_per_stream``: tokens per
    substream (a multiple of ``group_size``); shorter substreams mean more parallel
    decoding and bounded memory in the reference coder, at ~10 bytes of overhead each.
    ``levels``: delta steps per layer group for each level. ``value_step_scale``: the
    values' steps relative to the keys'. ``default_level``: used when none is asked.
    """

    group_size: int = 10
    tokens_per_stream: int = 160
    levels: tuple[tuple[float, float, float], ...] = field(default=DEFAULT_LEVELS)
    value_step_scale: float = 1.0
    default_level: int = 1

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError("group_size must be >= 1")
        if self.tokens_per_stream < self.group_size or self.tokens_per_stream % self.group_size:
            raise ValueError("tokens_per_stream must be a positive multiple of group_size")
        if not self.levels or any(len(lv) != 3 or min(lv) <= 0 for lv in self.levels):
            raise ValueError("levels must be a non-empty sequence of 3 positive steps (early, middle, late layers)")
        object.__setattr__(self, "levels", tuple(tuple(float(s) for s in lv) for lv in self.levels))
        if self.value_step_scale <= 0:
            raise ValueError("value_step_scale must be > 0")
        if not 0 <= self.default_level < len(self.levels):
            raise ValueError(f"default_level must be in [0, {len(self.levels)})")

    @property
    def n_levels(self) -> int:
        return len(self.levels)

    def delta_steps(self, level: int, num_layers: int, kind: int) -> torch.Tensor:
        """Base delta step of every layer, float32 ``(num_layers,)``; ``kind`` 0 = keys, 1 = values."""
        if not 0 <= level < self.n_levels:
            raise ValueError(f"level {level} not in [0, {self.n_levels})")
        steps = torch.tensor(self.levels[level], dtype=torch.float32)[layer_groups(num_layers)]
        return steps * (self.value_step_scale if kind == 1 else 1.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["levels"] = [list(lv) for lv in self.levels]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CodecConfig":
        d = dict(d)
        d["levels"] = tuple(tuple(lv) for lv in d["levels"])
        return cls(**d)

    @property
    def codec_id(self) -> str:
        """Stable id of this configuration; blobs of another configuration are rejected."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return "cachegen-v1-" + hashlib.blake2b(canon.encode(), digest_size=8).hexdigest()
