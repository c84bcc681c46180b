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
- Deltas: step = ``base_step[level, layer group] * rms(delta)`` per channel, where
  ``rms`` is the chunk's own root mean square of the deltas of that channel. This
  gives every channel the same signal-to-noise ratio and makes the symbol
  distribution of a (layer, channel) nearly the same from chunk to chunk, which is
  what lets a profile fitted offline code new chunks well. The step is raised where
  needed so that ``|delta| / step <= DELTA_RADIUS``: no delta is ever clipped.

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


def layer_groups(num_layers: int, n_groups: int = 3) -> torch.Tensor:
    """Group index of each layer: first third 0, middle 1, last third 2."""
    return torch.div(torch.arange(num_layers) * n_groups, max(num_layers, 1), rounding_mode="floor")


def anchor_mask(num_tokens: int, group_size: int) -> torch.Tensor:
    """Boolean ``(tokens,)``: True at the first token of every group."""
    return torch.arange(num_tokens) % group_size == 0


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


def quantize(x: torch.Tensor, group_size: int, delta_base_step: torch.Tensor) -> Quantized:
    """Quantise ``x`` of shape ``(layers, tokens, channels)``.

    ``delta_base_step``: float ``(layers,)``, the step of each layer in units of the
    channel's delta RMS (from the level and the layer group).
    """
    x = x.float()
    layers, tokens, channels = x.shape
    is_anchor = anchor_mask(tokens, group_size)
    a = x[:, is_anchor]  # (L, nA, C)

    amin = _bf16_round(a.amin(dim=1), -1.0)
    amax = a.amax(dim=1)
    astep = _bf16_round(((amax - amin) / (ANCHOR_LEVELS - 1)).clamp_min(_TINY), +1.0)
    # Directed rounding can leave amin + 255 * astep a hair below amax; widen the step.
    short = amin + (ANCHOR_LEVELS - 1) * astep < amax
    astep_b = astep.to(torch.bfloat16)
    astep = torch.where(short, torch.nextafter(astep_b, torch.full_like(astep_b, float("inf"))).float(), astep)
    aq = torch.round((a - amin[:, None]) / astep[:, None]).clamp_(0, ANCHOR_LEVELS - 1)
    a_hat = amin[:, None] + aq * astep[:, None]

    group_of = torch.arange(tokens) // group_size
    d = x[:, ~is_anchor] - a_hat[:, group_of[~is_anchor]]  # (L, nD, C)
    if d.shape[1]:
        rms = d.square().mean(dim=1).sqrt()
        need = d.abs().amax(dim=1) / DELTA_RADIUS
    else:
        rms = torch.zeros(layers, channels)
        need = torch.zeros(layers, channels)
    step = torch.maximum(delta_base_step.float()[:, None] * rms, need)
    step = torch.where(step > 0, step, torch.ones_like(step))
    dstep = _bf16_round(step.clamp_min(_TINY), +1.0)
    dq = torch.round(d / dstep[:, None]).clamp_(-DELTA_RADIUS, DELTA_RADIUS)
    return Quantized(
        anchors=aq.to(torch.uint8),
        deltas=(dq + DELTA_OFFSET).to(torch.uint8),
        anchor_min=amin,
        anchor_step=astep,
        delta_step=dstep,
    )


def dequantize(q: Quantized, group_size: int, num_tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rebuild ``(layers, tokens, channels)`` from ``q``; inverse of ``quantize`` up to half a step."""
    layers, _, channels = q.anchors.shape
    is_anchor = anchor_mask(num_tokens, group_size)
    a_hat = q.anchor_min[:, None] + q.anchors.float() * q.anchor_step[:, None]
    out = torch.empty(layers, num_tokens, channels, dtype=torch.float32)
    out[:, is_anchor] = a_hat
    group_of = torch.arange(num_tokens) // group_size
    d = (q.deltas.float() - DELTA_OFFSET) * q.delta_step[:, None]
    out[:, ~is_anchor] = a_hat[:, group_of[~is_anchor]] + d
    return out.to(dtype)
