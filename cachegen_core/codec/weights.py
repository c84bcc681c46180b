"""Step weights: coding without a profile, each component's step set by the model's own sensitivity.

A codec without a profile codes every channel as it is, with one step per (kind, layer) in units
of the layer's RMS in the chunk. The model does not weigh its layers alike: measured on the
reference model, the Fisher information of a layer's keys or values (``kvstats.py``: the KL of
the next-token distributions per unit of squared error) spans three orders of magnitude across
layers, and a factor of ten across the channels of one head, none of which the chunk itself
shows. Given the diagonal of the Fisher, a weight per component makes every component's
error cost the same KL (steps ``proportional to F^-1/2``, the high-rate optimum of
``sum F_ii e_i^2`` at a given rate), as the profile's transform does for its components.

Steps are stored in every blob, so weights only change what the encoder picks: a blob coded with
them decodes like any other, keys and the codec id do not depend on them, and an engine may code
with or without them. ``fitting.fit_weights`` measures them with one short Fisher draw on the
shipped calibration text (``docs/results.md``, "Without a profile").
"""

from __future__ import annotations

import torch

#: Weights are kept within this factor of their geometric mean either way: a channel whose Fisher one
#: short draw underestimates is still coded, and none is coded far finer than the others.
SPREAD = 8.0


def step_weights(fisher_diag: torch.Tensor, variance: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    """Weights float32 ``(2, layers, heads, dim)`` (geometric mean 1) from the Fisher's diagonal and the
    channels' variance about the chunk mean, both ``(2, layers, heads, dim)``.

    The Fisher of each head is regularised as the profile's transform regularises it (``eps`` times its
    mean diagonal added, ``transform.fit_transform``); the codec multiplies the weight by the layer's
    RMS in the chunk, so it is divided by the RMS the statistics saw. A head with no Fisher or a layer
    with no variance (nothing measured there) gets weight 1; ``ValueError`` when nothing was measured."""
    f = fisher_diag.double()
    if f.shape != variance.shape or f.dim() != 4 or f.shape[0] != 2:
        raise ValueError(f"fisher_diag and variance must both be (2, layers, heads, dim), got {tuple(f.shape)} and {tuple(variance.shape)}")
    if not (torch.isfinite(f).all() and torch.isfinite(variance).all()) or (f < 0).any() or (variance < 0).any():
        raise ValueError("fisher_diag and variance must be finite and non-negative")
    f = f + eps * f.mean(dim=-1, keepdim=True)
    rms = variance.double().mean(dim=(2, 3), keepdim=True).sqrt().expand_as(f)
    known = (f > 0) & (rms > 0)
    if not known.any():
        raise ValueError("the statistics measured no sensitivity (no Fisher, or no variance, anywhere)")
    log_w = torch.where(known, -0.5 * f.clamp_min(1e-300).log() - rms.clamp_min(1e-300).log(), 0.0)
    log_w = torch.where(known, log_w - log_w[known].mean(), 0.0)
    return log_w.exp().clamp(1 / SPREAD, SPREAD).float().contiguous()


def check_weights(weights: torch.Tensor) -> torch.Tensor:
    """``weights`` as the codec keeps them (float32 on the CPU, contiguous), or ``ValueError``."""
    if not isinstance(weights, torch.Tensor) or weights.dim() != 4 or weights.shape[0] != 2:
        raise ValueError("step weights must be a tensor of shape (2, layers, heads, dim)")
    w = weights.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if not torch.isfinite(w).all() or not (w > 0).all():
        raise ValueError("step weights must be finite and positive")
    return w
