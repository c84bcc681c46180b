"""Uniform scalar quantisation of transform components, one step per (layer, head, component).

Every coded token of a chunk is quantised on its own (no anchors or deltas: on the
reference model a token's difference from a neighbour has more variance than the token
about the chunk mean, ``docs/history/``): symbol ``s = round(c / step) + 128`` with
``|s - 128| <= 127``, value ``(s - 128) * step``. The entropy coder's tables, fitted per
component, make a component whose spread is far below its step cost almost nothing.

Steps are per chunk and stored in the blob as bfloat16, rounded up, so that the stored
values themselves guarantee the error bound of half a step per component:

    step = max(min(base, cap * rms), max|c| / 127)

``base``: the level's step times the component's weight (``pipeline.py``); ``cap``
bounds it by the component's own RMS in the chunk, so that no component is quantised to
nothing wholesale (the quadratic distortion model behind the weights does not hold for
errors that large); the last term means no value is ever clipped.
"""

from __future__ import annotations

import torch

ALPHABET = 256
RADIUS = 127
OFFSET = 128  # symbol of a zero component
_TINY = 1e-30


def bf16_round(x: torch.Tensor, direction: float) -> torch.Tensor:
    """Round float32 to the nearest bfloat16 value in ``direction`` (+1: up, -1: down), as float32."""
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


def chunk_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``x`` ``(layers, heads, tokens, dim)``, rounded to bfloat16: ``(layers, heads, dim)``."""
    if x.shape[2] == 0:
        return torch.zeros(x.shape[0], x.shape[1], x.shape[3], device=x.device)
    return x.mean(dim=2).to(torch.bfloat16).float()


def steps(c: torch.Tensor, base: torch.Tensor, cap: float) -> torch.Tensor:
    """The step of every component (see module docstring): ``c`` ``(layers, heads, tokens, dim)``,
    ``base`` broadcastable to ``(layers, heads, dim)``; float32 ``(layers, heads, dim)``, bfloat16-exact."""
    step = base.float().expand(c.shape[0], c.shape[1], c.shape[3])
    if c.shape[2]:
        if cap > 0:
            step = torch.minimum(step, cap * c.square().mean(dim=2).sqrt())
        lo, hi = torch.aminmax(c, dim=2)
        peak = torch.maximum(lo.abs(), hi.abs())  # max |c|, without a copy of c
        step = torch.maximum(step, peak / RADIUS)
    step = bf16_round(torch.where(step > _TINY, step, torch.ones_like(step)), +1.0)
    # bf16 rounding up can land exactly on the bound; one more ulp if max|c| / step still exceeds the radius.
    if c.shape[2]:
        over = peak / step > RADIUS
        step = torch.where(over, torch.nextafter(step.to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)).float(), step)
    return step


def quantize(c: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Symbols (uint8, same shape as ``c``) of components ``c`` ``(layers, heads, tokens, dim)`` at ``step`` ``(layers, heads, dim)``."""
    q = torch.div(c, step[:, :, None, :]).round_().clamp_(-RADIUS, RADIUS).add_(OFFSET)
    return q.to(torch.uint8)


def dequantize(symbols: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Components back from symbols (float32, on the symbols' device); within half a step of ``quantize``'s input."""
    return (symbols.float() - OFFSET) * step[:, :, None, :]
