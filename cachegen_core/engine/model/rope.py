"""Moving cached keys to other positions: the rotary embedding (RoPE) re-applied to post-RoPE keys.

A Llama-style model stores keys already rotated by their position ``p``: ``k_p = R(p θ) k``,
``R`` a rotation of each pair of channels ``(i, i + d/2)`` by ``p · inv_freq[i]``. When the
frequencies are fixed (they do not depend on the sequence length), rotations compose:
``R(δ θ) k_p = k_{p+δ}``, so a document's keys computed at positions ``[p0, p0 + n)`` are
moved to ``[p0 + δ, p0 + δ + n)`` by one more rotation, exactly up to float rounding. The
attention scaling some RoPE types fold into cos/sin (YaRN) is already in the cached keys and
is not applied twice: the extra rotation is a pure rotation.

Rope types whose frequencies change with the sequence (``dynamic``, ``longrope``) are refused:
:func:`rope_of` returns the reason, and the engine recomputes instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...codec.rotary import apply_rotary

#: RoPE types with frequencies fixed at load time (shifting post-RoPE keys composes exactly).
FIXED_FREQUENCY_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


@dataclass(frozen=True)
class Rope:
    """The rotary embedding of a model: its fixed inverse frequencies (``head_dim / 2`` of them)."""

    inv_freq: torch.Tensor

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()


def rope_of(model: Any) -> Rope | str:
    """The model's RoPE when shifting its cached keys is exact, else the reason it is not."""
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return f"{type(model).__name__} has no rotary embedding with fixed inverse frequencies (model.model.rotary_emb.inv_freq)"
    kind = getattr(rotary, "rope_type", "default")
    if kind not in FIXED_FREQUENCY_TYPES:
        return f"rope type {kind!r} changes its frequencies with the sequence length: cached keys cannot be moved exactly"
    return Rope(rotary.inv_freq.detach().to(device="cpu", dtype=torch.float64).clone())


def shift_keys(keys: torch.Tensor, delta: int, rope: Rope) -> None:
    """Move post-RoPE ``keys`` (``(..., tokens, head_dim)``) by ``delta`` positions, in place.

    The rotation's cos and sin are computed in float64 (``delta · inv_freq`` may be thousands of
    radians) and applied in float32 at least, then written back in the keys' dtype.
    """
    if delta == 0 or keys.numel() == 0:
        return
    if keys.shape[-1] != rope.head_dim:
        raise ValueError(f"keys of head dim {keys.shape[-1]} do not match a RoPE of head dim {rope.head_dim}")
    angle = torch.cat([rope.inv_freq, rope.inv_freq]) * float(delta)
    work = torch.promote_types(keys.dtype, torch.float32)
    cos = angle.cos().to(device=keys.device, dtype=work)
    sin = angle.sin().to(device=keys.device, dtype=work)
    x = keys.to(work)
    keys.copy_(apply_rotary(x, cos, sin))
