"""The per-head linear transform between a head's channels and the components the codec quantises.

Transform coding under the model's own distortion measure: with ``F`` the Fisher of a
(kind, layer, head) (``kvstats.py``; KL ~ ``e^T F e / 2``) and ``S`` the covariance of its
channels about the chunk mean, the components ``c = A (x - mean)`` with

    F + eps * mean(diag F) * I = Lc Lc^T        (Cholesky; eps keeps every direction finite)
    Lc^T S Lc = U diag(lambda) U^T              (eigendecomposition)
    A = U^T Lc^T / g,   B = A^-1 = Lc^-T U g    (g: one global scale, see below)

are uncorrelated (variances ``lambda / g^2``) and each costs the same KL per unit of
squared error. One uniform step for every component of every layer is then the
rate-distortion optimum of this quadratic model (reverse water-filling: components whose
spread is below the step get no bits at all). ``g`` is the RMS of all components, so a
step is in units of the weighted signal's RMS. Without a Fisher (``fisher=None``) the
same construction with ``F = I`` is a plain per-head PCA.

Decoding applies ``B``: 64 multiply-adds per element for 64-dim heads. A profile stores ``B``
in 16 bits (``to_half``): float16 scaled per matrix, ``A`` its exact inverse (``from_half``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class Transform:
    """``analysis`` A and ``synthesis`` B = A^-1, float32 ``(2, layers, heads, dim, dim)``; ``spread``:
    float32 ``(2, layers, heads, dim)``, the RMS of each component on the fitting data;
    ``identity``: A = B = I (nothing to compute)."""

    analysis: torch.Tensor
    synthesis: torch.Tensor
    spread: torch.Tensor
    identity: bool = False

    def __post_init__(self) -> None:
        shape = self.analysis.shape
        if len(shape) != 5 or shape[0] != 2 or shape[3] != shape[4] or self.synthesis.shape != shape:
            raise ValueError(f"transform matrices must be (2, layers, heads, dim, dim), got {tuple(shape)}")
        if self.spread.shape != shape[:4]:
            raise ValueError("spread must be (2, layers, heads, dim)")

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, heads, dim)``."""
        return tuple(self.analysis.shape[1:4])  # type: ignore[return-value]

    def analyse(self, x: torch.Tensor, kind: int) -> torch.Tensor:
        """Channels -> components: ``x`` ``(layers, heads, tokens, dim)``, centred."""
        if self.identity:
            return x
        return torch.matmul(x, self.analysis[kind].to(x.device).transpose(-1, -2))

    def synthesise(self, c: torch.Tensor, kind: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Components -> channels (inverse of ``analyse``), into ``out`` when given (float32, ``c``'s
        shape): a slice of a KV buffer, already faulted in, where a new tensor's pages would be."""
        if self.identity:
            return c if out is None else out.copy_(c)
        return torch.matmul(c, self.synthesis[kind].to(c.device).transpose(-1, -2), out=out)


def fit_transform(covariance: torch.Tensor, fisher: torch.Tensor | None = None, eps: float = 0.01) -> Transform:
    """The transform of the module docstring from ``covariance`` and ``fisher``, both ``(2, layers, heads, dim, dim)``."""
    cov = covariance.double()
    dim = cov.shape[-1]
    eye = torch.eye(dim, dtype=torch.float64)
    if fisher is None:
        chol = eye.expand_as(cov)
    else:
        f = fisher.double()
        f = 0.5 * (f + f.transpose(-1, -2))
        scale = f.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-300)
        chol = torch.linalg.cholesky(f + eps * scale[..., None, None] * eye)
    weighted = chol.transpose(-1, -2) @ cov @ chol
    lam, u = torch.linalg.eigh(0.5 * (weighted + weighted.transpose(-1, -2)))
    lam, u = lam.flip(-1).clamp_min(0), u.flip(-1)  # largest component first
    g = lam.mean().sqrt().clamp_min(1e-30)
    analysis = u.transpose(-1, -2) @ chol.transpose(-1, -2) / g
    synthesis = torch.linalg.solve(chol.transpose(-1, -2), u) * g
    return Transform(analysis.float().contiguous(), synthesis.float().contiguous(), (lam.sqrt() / g).float().contiguous())


@functools.lru_cache(maxsize=4)
def identity_transform(layers: int, heads: int, dim: int) -> Transform:
    """Components = channels (the codec without a profile); one per shape, shared (never written to)."""
    eye = torch.eye(dim).expand(2, layers, heads, dim, dim).contiguous()
    return Transform(eye, eye, torch.ones(2, layers, heads, dim), identity=True)


def to_half(t: Transform) -> dict[str, np.ndarray]:
    """The 16-bit stored form of ``t``: ``synthesis`` float16 ``(2, layers, heads, dim, dim)``, each
    matrix divided by ``scale`` float32 ``(2, layers, heads)`` (its largest magnitude, so nothing
    overflows), and ``spread`` float16."""
    b = t.synthesis.double()
    scale = b.abs().amax(dim=(-2, -1)).clamp_min(1e-30).float()
    half = (b / scale.double()[..., None, None]).to(torch.float16)
    return {"synthesis": half.numpy(), "scale": scale.numpy(), "spread": t.spread.to(torch.float16).numpy()}


def from_half(synthesis: np.ndarray, scale: np.ndarray, spread: np.ndarray) -> Transform:
    """The transform of a 16-bit stored form (``to_half``): ``B = synthesis * scale`` in float32, ``A``
    its inverse (computed in float64). ``ValueError`` when a matrix is singular or too ill-conditioned
    for ``A B = I`` to hold within 1e-4 in float32."""
    b = torch.from_numpy(np.asarray(synthesis, dtype=np.float16).astype(np.float32)) * torch.from_numpy(
        np.asarray(scale, dtype=np.float32))[..., None, None]
    dim = b.shape[-1]
    eye = torch.eye(dim, dtype=torch.float64)
    try:
        a64 = torch.linalg.solve(b.double(), eye.expand_as(b).clone()) if torch.isfinite(b).all() else None
    except RuntimeError:  # torch.linalg.LinAlgError: exactly singular
        a64 = None
    if a64 is None or not torch.isfinite(a64).all():
        raise ValueError("transform synthesis is not invertible")
    a = a64.float()
    if (torch.matmul(a.double(), b.double()) - eye).abs().max() > 1e-4:
        raise ValueError("transform synthesis is too ill-conditioned to invert in float32")
    return Transform(a.contiguous(), b.contiguous(), torch.from_numpy(np.asarray(spread, dtype=np.float16).astype(np.float32)))
