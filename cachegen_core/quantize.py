"""Anchor/delta token groups and layer-group quantisation of one KV kind (keys or values).

Tokens are cut into groups of ``group_size``. The first token of a group is the
*anchor*, quantised to 8 bits; every other token is coded as its difference from the
*reconstructed* anchor (not from its neighbour), so the error of every element is
bounded by half of its own step and any token decodes with one addition.

Scaling (chosen by measurement, see ``docs/results.md``): all scales are per chunk
and per (layer, channel), stored in the blob as bfloat16 with directed rounding so
that the stored values themselves guarantee the error bound.

- Anchors: asymmetric min/max over the chunk's anchors, 256 levels. Per channel,
  because KV channels differ in range by orders of magnitude (keys have outlier
  channels); per chunk, because the range of a chunk is known exactly, so 8 bits are
  never clipped.
- Deltas: step = ``base_step[level, layer group] * rms(delta)``, where ``rms`` is
  the chunk's own root mean square of the deltas of the whole layer (default) or of
  each channel. Measured on SmolLM2-135M, one step per layer wins at every rate:
  equal absolute error across channels is what minimises the error of attention
  scores for a given number of bits, while a per-channel step (equal SNR) spends bits
  on quiet channels and starves the loud ones that dominate ``q . k``. The step is
  raised per channel where needed so that ``|delta| / step <= DELTA_RADIUS``: no
  delta is ever clipped.
- Anchors in ``"level"`` mode use the level's step around a per-channel centre
  instead of 8 bits: cheaper, but measured worse in quality per bit on the
  reference model, so ``"8bit"`` is the default.

Layer groups: the first third of the layers gets the finest step, the last third
the coarsest, because errors in early layers propagate through the whole network.

Everything is vectorised over layers, tokens and channels; no Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ANCHOR_LEVELS = 256
DELTA_RADIUS = 127
DELTA_OFFSET = 128  # delta symbol = q + DELTA_OFFSET, in [1, 255]
ALPHABET = 256
ANCHOR_MODES = ("level", "8bit")
DELTA_SCALES = ("layer", "channel")
_TINY = 1e-30


@dataclass(frozen=True)
class Quantized:
    """Quantised symbols and the per-(layer, channel) parameters that rebuild one KV kind.

    ``anchors``: uint8 ``(layers, n_anchors, channels)``; ``deltas``: uint8
    ``(layers, tokens - n_anchors, channels)``, in token order; ``anchor_min``,
    ``anchor_step``, ``delta_step``: float32 ``(layers, channels)``, exactly
    representable in bfloat16.
    """

    anchors: torch.Tensor
    deltas: torch.Tensor
    anchor_min: torch.Tensor
    anchor_step: torch.Tensor
    delta_step: torch.Tensor
    anchor_offset: int = 0


def layer_groups(num_layers: int, n_groups: int = 3) -> torch.Tensor:
    """Group index of each layer: first third 0, middle 1, last third 2."""
    return torch.div(torch.arange(num_layers) * n_groups, max(num_layers, 1), rounding_mode="floor")


def anchor_mask(num_tokens: int, group_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean ``(tokens,)``: True at the first token of every group."""
    return torch.arange(num_tokens, device=device) % group_size == 0


def _bf16_round(x: torch.Tensor, direction: float) -> torch.Tensor:
    """Round float32 to the nearest bfloat16 value in ``direction`` (+inf or -inf), as float32."""
    b = x.to(torch.bfloat16)
    bad = b.float() < x if direction > 0 else b.float() > x
    b = torch.where(bad, torch.nextafter(b, torch.full_like(b, direction * float("inf"))), b)
    return b.float()


def to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 values exactly representable in bfloat16 -> their raw uint16 bit patterns (as int32)."""
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF


def from_bf16_bits(bits: torch.Tensor) -> torch.Tensor:
    """Raw bfloat16 bit patterns (any integer dtype) -> float32."""
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).float()


def quantize(
    x: torch.Tensor,
    group_size: int,
    delta_base_step: torch.Tensor,
    *,
    anchor_mode: str = "8bit",
    delta_scale: str = "layer",
) -> Quantized:
    """Quantise ``x`` of shape ``(layers, tokens, channels)``.

    ``delta_base_step``: float ``(layers,)``, the step of each layer in units of the
    RMS of what is coded (see the module docstring). ``anchor_mode``: ``"8bit"``
    (min/max over the chunk, 256 levels) or ``"level"`` (the level's step around a
    per-channel centre). ``delta_scale``: ``"layer"`` or ``"channel"`` RMS.
    """
    if anchor_mode not in ANCHOR_MODES or delta_scale not in DELTA_SCALES:
        raise ValueError(f"anchor_mode must be in {ANCHOR_MODES} and delta_scale in {DELTA_SCALES}")
    x = x.float()
    layers, tokens, channels = x.shape
    base = delta_base_step.float()[:, None]
    is_anchor = anchor_mask(tokens, group_size)
    a = x[:, is_anchor]  # (L, nA, C)
    amin, amax = a.amin(dim=1), a.amax(dim=1)
    if anchor_mode == "8bit":
        lo = _bf16_round(amin, -1.0)
        astep = _bf16_round(((amax - lo) / (ANCHOR_LEVELS - 1)).clamp_min(_TINY), +1.0)
        # Directed rounding can leave lo + 255 * astep a hair below amax; widen the step.
        short = lo + (ANCHOR_LEVELS - 1) * astep < amax
        astep_b = astep.to(torch.bfloat16)
        astep = torch.where(short, torch.nextafter(astep_b, torch.full_like(astep_b, float("inf"))).float(), astep)
        aq = torch.round((a - lo[:, None]) / astep[:, None]).clamp_(0, ANCHOR_LEVELS - 1)
        anchor_offset = 0
    else:
        lo = (0.5 * (amin + amax)).to(torch.bfloat16).float()  # centre, exactly representable
        centred = a - lo[:, None]
        rms = _rms(centred, "layer")
        astep = _bf16_round(torch.maximum(base * rms, centred.abs().amax(dim=1) / DELTA_RADIUS).clamp_min(_TINY), +1.0)
        aq = torch.round(centred / astep[:, None]).clamp_(-DELTA_RADIUS, DELTA_RADIUS) + DELTA_OFFSET
        anchor_offset = DELTA_OFFSET
    a_hat = lo[:, None] + (aq - anchor_offset) * astep[:, None]

    group_of = torch.arange(tokens) // group_size
    d = x[:, ~is_anchor] - a_hat[:, group_of[~is_anchor]]  # (L, nD, C)
    step = torch.maximum(base * _rms(d, delta_scale), d.abs().amax(dim=1) / DELTA_RADIUS if d.shape[1] else torch.zeros_like(base))
    dstep = _bf16_round(torch.where(step > 0, step, torch.ones_like(step)).clamp_min(_TINY), +1.0)
    dq = torch.round(d / dstep[:, None]).clamp_(-DELTA_RADIUS, DELTA_RADIUS)
    return Quantized(
        anchors=aq.to(torch.uint8),
        deltas=(dq + DELTA_OFFSET).to(torch.uint8),
        anchor_min=lo,
        anchor_step=astep,
        delta_step=dstep,
        anchor_offset=anchor_offset,
    )


def _rms(d: torch.Tensor, scale: str) -> torch.Tensor:
    """RMS of ``d`` ``(layers, n, channels)`` per (layer, channel), or per layer broadcast to every channel."""
    layers, n, channels = d.shape
    if n == 0:
        return torch.zeros(layers, channels)
    if scale == "channel":
        return d.square().mean(dim=1).sqrt()
    return d.square().mean(dim=(1, 2)).sqrt()[:, None].expand(layers, channels)


def dequantize(q: Quantized, group_size: int, num_tokens: int) -> torch.Tensor:
    """Rebuild float32 ``(layers, tokens, channels)`` from ``q``, on the device of its symbols;
    inverse of ``quantize`` up to half a step."""
    layers, _, channels = q.anchors.shape
    dev = q.anchors.device
    is_anchor = anchor_mask(num_tokens, group_size, dev)
    a_hat = q.anchor_min[:, None] + (q.anchors.float() - q.anchor_offset) * q.anchor_step[:, None]
    out = torch.empty(layers, num_tokens, channels, dtype=torch.float32, device=dev)
    out[:, is_anchor] = a_hat
    group_of = torch.arange(num_tokens, device=dev) // group_size
    d = (q.deltas.float() - DELTA_OFFSET) * q.delta_step[:, None]
    out[:, ~is_anchor] = a_hat[:, group_of[~is_anchor]] + d
    return out
