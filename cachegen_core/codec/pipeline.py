"""A chunk's KV to quantised components and back: rotary, exact sink tokens, mean, transform, steps.

Per kind (0 = keys, 1 = values), for a chunk whose first token sits at position ``start``:

1. keys are un-rotated (``rotary.py``) when the codec has the model's rotary embedding;
2. tokens at positions below ``sink_tokens`` (the attention sink: thousands of times more
   sensitive than any other token) are kept exactly, as float32;
3. the other tokens are centred on the chunk mean of each channel (bfloat16) and
   transformed into components, one matrix per group of a layer's heads (``transform.py``);
4. components are quantised with one step per (layer, head, component) (``quantize.py``):
   ``level step x RMS of the kind's layer in the chunk`` with the identity transform of a
   codec without profile, times the component's weight when the codec has step weights
   (``weights.py``: the model's measured sensitivity, so that every component's error costs
   the same), ``level step`` for every component with a fitted transform (whose components
   all weigh the same).

Reconstruction per element: ``x = mean + B @ ((s - 128) * step)``, then the rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv import KVCache
from .quantize import chunk_mean, dequantize, quantize, steps
from .rotary import RotarySpec
from .transform import Transform


@dataclass(frozen=True)
class Coded:
    """One chunk after quantisation, both kinds stacked on the first axis.

    ``symbols``: uint8 ``(2, layers, heads, coded_tokens, dim)`` (component order);
    ``mean``, ``step``: float32 ``(2, layers, heads, dim)``, bfloat16-exact;
    ``exact``: float32 ``(2, layers, heads, exact_tokens, dim)``, the sink tokens as given
    (keys after rotation).
    """

    symbols: torch.Tensor
    mean: torch.Tensor
    step: torch.Tensor
    exact: torch.Tensor


def exact_tokens(start: int, tokens: int, sink_tokens: int) -> int:
    """How many leading tokens of a chunk at ``start`` are attention-sink tokens kept exactly."""
    return max(0, min(tokens, sink_tokens - start))


@dataclass(frozen=True)
class Components:
    """A chunk before quantisation: components float32 ``(2, layers, heads, coded_tokens, dim)``,
    chunk ``mean`` and ``exact`` tokens as in ``Coded``."""

    values: torch.Tensor
    mean: torch.Tensor
    exact: torch.Tensor


def components(kv: KVCache, transform: Transform, *, start: int = 0, sink_tokens: int = 1, rotary: RotarySpec | None = None) -> Components:
    """Steps 1-3 of the module docstring."""
    n_exact = exact_tokens(start, kv.num_tokens, sink_tokens)
    comps, means, exact = [], [], []
    for kind, x in enumerate((kv.keys, kv.values)):
        x = x.float()
        exact.append(x[:, :, :n_exact])
        if kind == 0 and rotary is not None:
            x = rotary.unrotate(x, start)
        body = x[:, :, n_exact:]
        mean = chunk_mean(body)
        comps.append(transform.analyse(body - mean[:, :, None, :], kind))
        means.append(mean)
    return Components(torch.stack(comps), torch.stack(means), torch.stack(exact))


def quantise(comp: Components, level_step: float, *, fitted: bool, step_cap: float = 0.0, weights: torch.Tensor | None = None) -> Coded:
    """Step 4 of the module docstring; ``fitted``: the transform comes from a profile; ``weights``: float32
    ``(2, layers, heads, dim)``, each component's step multiplier without one (None: 1)."""
    symbols, stps = [], []
    for kind, c in enumerate(comp.values):
        step = steps(c, base_step(c, level_step, kind, fitted=fitted, weights=weights), step_cap)
        symbols.append(quantize(c, step))
        stps.append(step)
    return Coded(torch.stack(symbols), comp.mean, torch.stack(stps), comp.exact)


def base_step(c: torch.Tensor, level_step: float, kind: int, *, fitted: bool, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The step step 4 gives the components ``c`` ``(layers, heads, tokens, dim)`` of ``kind`` before ``steps``' bounds:
    ``level_step`` with a fitted transform, else ``level_step`` x the layer's RMS in the chunk (x ``weights[kind]``),
    broadcastable to ``(layers, heads, dim)``."""
    if fitted and weights is not None:
        raise ValueError("step weights apply to coding without a profile only")
    if fitted or not c.shape[2]:
        return torch.tensor(level_step)
    base = level_step * c.square().mean(dim=(1, 2, 3)).sqrt()[:, None, None]
    return base if weights is None else base * weights[kind].to(base.device)


def synthesise_parts(
    comps: torch.Tensor,
    mean: torch.Tensor,
    exact: torch.Tensor,
    transform: Transform,
    *,
    start: int = 0,
    encoded_start: int = 0,
    rotary: RotarySpec | None = None,
    bodies: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per kind (keys, values), the exact tokens and the coded ones, float32 ``(layers, heads, n, dim)``
    on the components' device: the two token ranges of :func:`synthesise`, not yet joined.

    ``comps``: dequantised components float32 ``(2, layers, heads, coded_tokens, dim)``
    (``dequantize``, or the native decoder's); ``mean`` and ``exact`` as in ``Coded``.
    Keys come out at positions from ``start``; the exact tokens were stored at ``encoded_start``
    and are moved when ``start`` differs. ``bodies``: float32 keys and values ``(layers, heads,
    coded_tokens, dim)`` on that device (the coded tokens' slice of a KV buffer) the coded tokens
    are computed in, with the same numbers, and returned as; else new tensors.
    """
    dev = comps.device
    out = []
    for kind in range(2):
        dst = bodies[kind] if bodies is not None else None
        body, m = transform.synthesise(comps[kind], kind, out=dst), mean[kind].to(dev)[:, :, None, :]
        body = body + m if transform.identity and dst is None else body.add_(m)  # in place on the matmul's own output
        ex = exact_part(exact, kind, start=start, encoded_start=encoded_start, rotary=rotary).to(dev)
        if kind == 0 and rotary is not None:
            body = rotary.rotate(body, start + ex.shape[2], in_place=dst is not None)
        out.append((ex, body))
    return out


def exact_part(exact: torch.Tensor, kind: int, *, start: int, encoded_start: int, rotary: RotarySpec | None) -> torch.Tensor:
    """The exact tokens of ``kind`` (``exact`` as in ``Coded``), keys moved from ``encoded_start`` to ``start``."""
    ex = exact[kind]
    if kind == 0 and rotary is not None and start != encoded_start and ex.shape[2]:
        ex = rotary.rotate(rotary.unrotate(ex, encoded_start), start)
    return ex


def synthesise(
    comps: torch.Tensor,
    mean: torch.Tensor,
    exact: torch.Tensor,
    transform: Transform,
    *,
    start: int = 0,
    encoded_start: int = 0,
    rotary: RotarySpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values, float32 ``(layers, heads, tokens, dim)``: :func:`synthesise_parts` joined."""
    parts = synthesise_parts(comps, mean, exact, transform, start=start, encoded_start=encoded_start, rotary=rotary)
    keys, values = (torch.cat([ex, body], dim=2) if ex.shape[2] else body for ex, body in parts)
    return keys, values


def magnitude_bound(transform: Transform, mean: torch.Tensor, step: torch.Tensor, exact: torch.Tensor, rotary: RotarySpec | None) -> float:
    """An upper bound on ``|x|`` over every value :func:`synthesise` can return for these parameters.

    A component is ``(s - 128) * step`` with ``s`` in ``[0, 255]``, so ``|c| <= 128 step`` and a
    channel ``|x_i| <= |mean_i| + sum_j |B_ij| 128 step_j`` (``j`` over its group's components); a
    rotation by cos and sin (scaled by ``attention_scaling``) at most doubles a key channel's bound. Computed from the
    parameters alone: what lets the decoder skip a pass over the output to look for overflow. The products run in
    float32 on the transform's cached ``|B|`` (made in float64 per chunk, it and the matrices' GPU copy cost a
    7B-shaped chunk's H100 decode 28 of 86 ms): a sum of ``n`` non-negative float32 terms is within ``n * 2^-24``
    (1.5e-5 for ``n = 256``) of the exact one, inside the 0.1 % the decoder adds; the rest in float64.
    """
    if transform.identity:  # |I| step = step: no products over a 7B model's eye matrices (3-7 ms a chunk on 2 cores)
        body = mean.double().abs() + 128 * step.double()
    else:
        synth = transform.synthesis_magnitude.to(step.device)  # (2, layers, groups, n, n)
        grouped = synth.shape[:4]  # a group's steps and means side by side, as its matrix reads them
        body = mean.double().abs().reshape(grouped) + 128 * (synth @ step.float().reshape(grouped)[..., None])[..., 0].double()
    ex = exact.double().abs().flatten(1).amax(dim=1) if exact.numel() else torch.zeros(2, dtype=torch.float64, device=step.device)
    per_kind = torch.maximum(body.flatten(1).amax(dim=1), ex.to(body.device))
    key_factor = 2.0 * abs(rotary.attention_scaling) if rotary is not None else 1.0
    return float(max(per_kind[0] * key_factor, per_kind[1]))


def dequantise(coded: Coded) -> torch.Tensor:
    """The components of ``coded``, float32 ``(2, layers, heads, coded_tokens, dim)``."""
    dev = coded.symbols.device
    return torch.stack([dequantize(coded.symbols[k], coded.step[k].to(dev)) for k in range(2)])
