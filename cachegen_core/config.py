"""CodecConfig: the frozen set of choices that defines a CacheGen bitstream."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .quantize import ANCHOR_MODES, DELTA_OFFSET, DELTA_SCALES, Quantized, dequantize, layer_groups, quantize

#: Delta step per layer group (first third, middle, last third of the layers), in units of
#: the layer's delta RMS, one tuple per level from near-lossless (0) to aggressive. Measured
#: on SmolLM2-135M (docs/results.md): a per-layer step beats a per-channel one at every rate,
#: and keys are more sensitive than values (hence ``value_step_scale`` > 1).
DEFAULT_LEVELS: tuple[tuple[float, float, float], ...] = (
    (0.04, 0.05, 0.06),
    (0.12, 0.15, 0.18),
    (0.24, 0.3, 0.36),
    (0.48, 0.6, 0.72),
)


@dataclass(frozen=True)
class CodecConfig:
    """What a blob needs beyond its own header to be decoded the same way it was encoded.

    ``group_size``: tokens per anchor group. ``stream_symbols``: target symbols per
    substream; the token block of a substream is the multiple of ``group_size`` closest
    to ``stream_symbols / channels``. More substreams mean more parallel decoding (a
    CUDA warp each) and bounded memory in the reference coder, at ~72 bytes each
    (coder state flush and stream table entry).
    ``levels``: steps per layer group for each level, in units of the RMS of what is
    coded. ``value_step_scale``: the values' steps relative to the keys'.
    ``default_level``: used when none is asked. ``anchor_mode``: ``"level"`` codes
    anchors at the level's step around a per-channel centre, ``"8bit"`` at 8 bits over
    the chunk's min/max (the paper). ``delta_scale``: whether the RMS that sets the
    step is the layer's (``"layer"``) or each channel's (``"channel"``).
    """

    group_size: int = 10
    stream_symbols: int = 1 << 16
    levels: tuple[tuple[float, float, float], ...] = field(default=DEFAULT_LEVELS)
    value_step_scale: float = 1.25
    default_level: int = 1
    anchor_mode: str = "8bit"
    delta_scale: str = "layer"

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError("group_size must be >= 1")
        if self.stream_symbols < 1:
            raise ValueError("stream_symbols must be >= 1")
        if not self.levels or any(len(lv) != 3 or min(lv) <= 0 for lv in self.levels):
            raise ValueError("levels must be a non-empty sequence of 3 positive steps (early, middle, late layers)")
        object.__setattr__(self, "levels", tuple(tuple(float(s) for s in lv) for lv in self.levels))
        if self.value_step_scale <= 0:
            raise ValueError("value_step_scale must be > 0")
        if self.anchor_mode not in ANCHOR_MODES or self.delta_scale not in DELTA_SCALES:
            raise ValueError(f"anchor_mode must be one of {ANCHOR_MODES}, delta_scale one of {DELTA_SCALES}")
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

    def tokens_per_stream(self, channels: int) -> int:
        """Tokens per substream block for a model with ``channels`` KV channels per layer."""
        groups = max(1, round(self.stream_symbols / max(channels, 1) / self.group_size))
        return groups * self.group_size

    @property
    def anchor_offset(self) -> int:
        """Symbol of a zero anchor offset: 0 for 8-bit min/max anchors, 128 for level-step anchors."""
        return 0 if self.anchor_mode == "8bit" else DELTA_OFFSET

    def quantize(self, x: torch.Tensor, level: int, kind: int) -> Quantized:
        """Quantise one kind ``(layers, tokens, channels)`` at ``level`` under this configuration."""
        return quantize(
            x,
            self.group_size,
            self.delta_steps(level, x.shape[0], kind),
            anchor_mode=self.anchor_mode,
            delta_scale=self.delta_scale,
        )

    def dequantize(self, q: Quantized, num_tokens: int) -> torch.Tensor:
        """Inverse of ``quantize`` up to half a step."""
        return dequantize(q, self.group_size, num_tokens)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-ready data: hashed into ``codec_id``, written into headers for people and tools."""
        d = asdict(self)
        d["levels"] = [list(lv) for lv in self.levels]
        return d

    @property
    def codec_id(self) -> str:
        """Stable id of this configuration; blobs of another configuration are rejected."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return "cachegen-v1-" + hashlib.blake2b(canon.encode(), digest_size=8).hexdigest()
