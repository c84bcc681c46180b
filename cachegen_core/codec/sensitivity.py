"""Layer sensitivity: what each (kind, layer)'s coding error really costs the model, measured.

A profile's transform makes every component cost the same KL per unit of squared error under the
Fisher it was fitted with (``transform.py``), so one step for all would be optimal if that Fisher
were the model's. It is not quite: it is regularised (``fisher_eps`` times its mean diagonal added)
and estimated from a few draws. Measured on the reference model (``docs/history/2026-11-28-bits-per-element.md``),
the KL a layer's error costs per unit of its whitened squared error is ~3x larger for values than
for keys and 2-10x larger in the first layers than in the last, the same pattern on any text
(log ratios of two transcripts correlate at 0.85), and the KL of a whole chunk is the sum of its
layers'.

``layer_sensitivity`` measures that ratio: each (kind, layer) alone is coded at a probe step and the
KL of a continuation's next-token distributions against the exact KV is divided by the layer's
whitened squared error. ``layer_multipliers`` turns the ratios into a step multiplier per (kind,
layer) (``r^(-power / 2)``, the high-rate optimum of ``sum r_l e_l^2`` at ``power`` 1), which
``transform.scale_layers`` folds into the transform: the codec, its format and its decoders do not
change, a layer's components are simply larger or smaller in units of the one step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, ContextManager

import torch

from ..hfcompat import cache_arg
from ..kv import KVCache
from .pipeline import base_step, components, dequantise, quantise, synthesise
from .rotary import RotarySpec
from .transform import Transform

#: Multipliers stay within this factor of their geometric mean either way (as ``weights.SPREAD``).
SPREAD = 4.0


@torch.no_grad()
def _logp(model: Any, kv: KVCache, continuation: list[int]) -> torch.Tensor:
    """Next-token log-probabilities (float32, ``(len(continuation) - 1, vocab)``) of ``continuation`` on ``kv``."""
    dtype = next(model.parameters()).dtype
    past = kv.to(device=model.device, dtype=dtype).to_dynamic_cache(model.config)
    logits = model(torch.tensor([continuation], device=model.device), **cache_arg(model, past)).logits[0, :-1]
    return logits.float().log_softmax(-1)


def coded_layers(
    kv: KVCache,
    transform: Transform,
    step: float,
    *,
    rotary: RotarySpec | None,
    sink_tokens: int,
    chunk_tokens: int,
    weights: torch.Tensor | None = None,
) -> tuple[KVCache, torch.Tensor]:
    """``kv`` (a context from position 0) coded in chunks of ``chunk_tokens`` with ``transform`` at ``step`` and back,
    and each (kind, layer)'s whitened squared error (summed over tokens and components; float64 ``(2, layers)``).

    ``weights`` (``weights.py``; ones for plain steps): code as a codec without a profile does (``transform`` the
    identity, each component's step ``step`` x its layer's RMS x its weight); the error is then whitened by the
    same factors (in units where every component's step is ``step``: what the weights assume each costs)."""
    fitted = weights is None
    parts, err = [], torch.zeros(2, kv.num_layers, dtype=torch.float64)
    for s in range(0, kv.num_tokens, chunk_tokens):
        comp = components(kv.slice(s, s + chunk_tokens), transform, start=s, sink_tokens=sink_tokens, rotary=rotary)
        coded = quantise(comp, step, fitted=fitted, weights=weights)
        deq = dequantise(coded)
        unit = torch.stack([step / base_step(c, step, k, fitted=fitted, weights=weights).expand(c.shape[0], c.shape[1], c.shape[3])
                            for k, c in enumerate(comp.values)])  # fmt: skip
        err += ((deq - comp.values) * unit[:, :, :, None, :]).double().square().sum(dim=(2, 3, 4))
        parts.append(KVCache(*synthesise(deq, coded.mean, coded.exact, transform, start=s, encoded_start=s, rotary=rotary)))
    return KVCache.concat(parts), err


def layer_sensitivity(
    model: Any,
    kv: KVCache,
    continuation: list[int],
    transform: Transform,
    step: float,
    *,
    rotary: RotarySpec | None,
    sink_tokens: int,
    chunk_tokens: int,
    guard: Callable[[], ContextManager[Any]] | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL (nats, summed over the continuation's predictions) when each (kind, layer) of ``kv`` (a context from
    position 0) alone is coded (``coded_layers``, whose arguments these are), and that layer's whitened squared error:
    float64 ``(2, layers)`` each. One forward pass of ``continuation`` per (kind, layer), and one on the exact KV."""
    guard = guard or nullcontext
    coded_kv, err = coded_layers(kv, transform, step, rotary=rotary, sink_tokens=sink_tokens, chunk_tokens=chunk_tokens, weights=weights)
    with guard():
        ref = _logp(model, kv, continuation)
    kl = torch.zeros(2, kv.num_layers, dtype=torch.float64)
    for kind in range(2):
        for layer in range(kv.num_layers):
            mixed = [kv.keys.clone(), kv.values.clone()]
            mixed[kind][layer] = (coded_kv.keys, coded_kv.values)[kind][layer]
            with guard():
                logp = _logp(model, KVCache(*mixed), continuation)
            kl[kind, layer] = float((ref.exp() * (ref - logp)).sum())
    return kl, err


def layer_multipliers(kl: torch.Tensor, err: torch.Tensor, power: float = 1.0) -> torch.Tensor:
    """Step multipliers float32 ``(2, layers)`` (geometric mean 1, within ``SPREAD`` of it) from ``layer_sensitivity``'s
    sums (over any number of texts): ``(r / GM(r))^(-power / 2)`` with ``r = kl / err``; a layer without error or KL
    measured gets 1."""
    if kl.shape != err.shape or kl.dim() != 2 or kl.shape[0] != 2:
        raise ValueError(f"kl and err must both be (2, layers), got {tuple(kl.shape)} and {tuple(err.shape)}")
    known = (kl > 0) & (err > 0)
    if not known.any():
        return torch.ones(kl.shape, dtype=torch.float32)
    log_r = torch.where(known, kl.double().clamp_min(1e-300).log() - err.double().clamp_min(1e-300).log(), 0.0)
    log_m = torch.where(known, -0.5 * power * (log_r - log_r[known].mean()), 0.0)
    return log_m.exp().clamp(1 / SPREAD, SPREAD).float()
