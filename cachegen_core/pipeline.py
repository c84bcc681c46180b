"""A chunk's KV to quantised components and back: rotary, exact sink tokens, mean, transform, steps.

Per kind (0 = keys, 1 = values), for a chunk whose first token sits at position ``start``:

1. keys are un-rotated (``rotary.py``) when the codec has the model's rotary embedding;
2. tokens at positions below ``sink_tokens`` (the attention sink: thousands of times more
   sensitive than any other token) are kept exactly, as float32;
3. the other tokens are centred on the chunk mean of each channel (bfloat16) and
   transformed per head into components (``transform.py``);
4. components are quantised with one step per (layer, head, component) (``quantize.py``):
   ``level step x RMS of the kind's layer in the chunk`` with the identity transform of a
   codec without profile, ``level step`` for every component with a fitted transform
   (whose components all weigh the same).

Reconstruction per element: ``x = mean + B @ ((s - 128) * step)``, then the rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv import KVCache
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


def components(
    kv: KVCache, transform: Transform, *, start: int = 0, sink_tokens: int = 1, rotary: RotarySpec | None = None
) -> Components:
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


def quantise(comp: Components, level_step: float, *, fitted: bool, step_cap: float = 0.0) -> Coded:
    """Step 4 of the module docstring; ``fitted``: the transform comes from a profile."""
    symbols, stps = [], []
    for c in comp.values:
        if fitted or not c.shape[2]:
            base = torch.tensor(level_step)
        else:
            base = level_step * c.square().mean(dim=(1, 2, 3)).sqrt()[:, None, None]
        step = steps(c, base, step_cap)
        symbols.append(quantize(c, step))
        stps.append(step)
    return Coded(torch.stack(symbols), comp.mean, torch.stack(stps), comp.exact)


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
    """Keys and values, float32 ``(layers, heads, tokens, dim)``, on the components' device.

    ``comps``: dequantised components float32 ``(2, layers, heads, coded_tokens, dim)``
    (``dequantize``, or the native decoder's); ``mean`` and ``exact`` as in ``Coded``.
    Keys come out at positions from ``start``; the exact tokens were stored at ``encoded_start``
    and are moved when ``start`` differs.
    """
    dev = comps.device
    out = []
    for kind in range(2):
        body = transform.synthesise(comps[kind], kind) + mean[kind].to(dev)[:, :, None, :]
        ex = exact[kind].to(dev)
        if kind == 0 and rotary is not None:
            if start != encoded_start and ex.shape[2]:
                ex = rotary.rotate(rotary.unrotate(ex, encoded_start), start)
            body = rotary.rotate(body, start + ex.shape[2])
        out.append(torch.cat([ex, body], dim=2) if ex.shape[2] else body)
    return out[0], out[1]


def dequantise(coded: Coded) -> torch.Tensor:
    """The components of ``coded``, float32 ``(2, layers, heads, coded_tokens, dim)``."""
    dev = coded.symbols.device
    return torch.stack([dequantize(coded.symbols[k], coded.step[k].to(dev)) for k in range(2)])
