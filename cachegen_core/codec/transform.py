"""The linear transform between a layer's KV channels and the components the codec quantises.

One matrix per (kind, layer, group of heads): a group is ``group`` consecutive KV heads of a
layer (``CodecConfig.head_group``), its ``n = group * dim`` channels in head-major order. The
heads of a layer are projections of the same hidden state, so their channels correlate; a
matrix across them decorrelates what one per head cannot.

Transform coding under the model's own distortion measure: with ``F`` the Fisher of a
(kind, layer, group) (``kvstats.py``; KL ~ ``e^T F e / 2``) and ``S`` the covariance of its
channels about the chunk mean, the components ``c = A (x - mean)`` with

    F + eps * mean(diag F) * I = Lc Lc^T        (Cholesky; eps keeps every direction finite)
    Lc^T S Lc = U diag(lambda) U^T              (eigendecomposition)
    A = U^T Lc^T / g,   B = A^-1 = Lc^-T U g    (g: one global scale, see below)

are uncorrelated (variances ``lambda / g^2``) and each costs the same KL per unit of
squared error. One uniform step for every component of every layer is then the
rate-distortion optimum of this quadratic model (reverse water-filling: components whose
spread is below the step get no bits at all). ``g`` is the RMS of all components, so a
step is in units of the weighted signal's RMS. Without a Fisher (``fisher=None``) the
same construction with ``F = I`` is a plain PCA.

Components keep the channels' layout ``(layers, heads, tokens, dim)``: a group's ``n``
components fill its heads' slots in order, so the rest of the codec never sees the groups.
Decoding applies ``B``: ``n`` multiply-adds per element. A profile stores ``B`` with about 6 bits
an entry, finer for strong components' columns (``to_stored``), and ``A`` is its exact inverse
(``from_stored``): encoder and decoder use the same matrices whatever the rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .bitpack import pack, unpack


@dataclass(frozen=True, eq=False)
class Transform:
    """``analysis`` A and ``synthesis`` B = A^-1, float32 ``(2, layers, groups, n, n)``; ``spread``:
    float32 ``(2, layers, heads, dim)``, the RMS of each component on the fitting data (the
    components' layout; ``heads = groups * group``, ``n = group * dim``); ``identity``: A = B = I
    (nothing to compute)."""

    analysis: torch.Tensor
    synthesis: torch.Tensor
    spread: torch.Tensor
    identity: bool = False

    def __post_init__(self) -> None:
        shape = self.analysis.shape
        if len(shape) != 5 or shape[0] != 2 or shape[3] != shape[4] or self.synthesis.shape != shape:
            raise ValueError(f"transform matrices must be (2, layers, groups, n, n), got {tuple(shape)}")
        sp = self.spread.shape
        if len(sp) != 4 or sp[:2] != shape[:2] or sp[2] % shape[2] or sp[2] // shape[2] * sp[3] != shape[3]:
            raise ValueError("spread must be (2, layers, heads, dim) with heads * dim = groups * n")

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, heads, dim)`` of the KV it codes."""
        return tuple(self.spread.shape[1:4])  # type: ignore[return-value]

    @property
    def group(self) -> int:
        """KV heads per matrix."""
        return self.spread.shape[2] // self.analysis.shape[2]

    @functools.cached_property
    def synthesis_magnitude(self) -> torch.Tensor:
        """``|B|``, float32: what ``pipeline.magnitude_bound`` multiplies each chunk's steps by (made once, not per chunk)."""
        return self.synthesis.abs()

    def matrices(self, which: str, kind: int, device: torch.device) -> torch.Tensor:
        """``analysis`` or ``synthesis`` of ``kind`` on ``device``: copied to a GPU once, not per chunk (a 7B model's
        are 67 MB per kind)."""
        m = getattr(self, which)
        if device.type == "cpu":
            return m[kind]
        cache = self.__dict__.setdefault("_on_device", {})  # (which, device) -> copy; a race only copies twice
        key = (which, str(device))
        if key not in cache:
            cache[key] = m.to(device)
        return cache[key][kind]

    def analyse(self, x: torch.Tensor, kind: int) -> torch.Tensor:
        """Channels -> components: ``x`` ``(layers, heads, tokens, dim)``, centred."""
        if self.identity:
            return x
        if self.group == 1:
            return torch.matmul(x, self.matrices("analysis", kind, x.device).transpose(-1, -2))
        return _grouped_matmul(x, self.matrices("analysis", kind, x.device), self.group)

    def synthesise(self, c: torch.Tensor, kind: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Components -> channels (inverse of ``analyse``), into ``out`` when given (float32, ``c``'s
        shape): a slice of a KV buffer, already faulted in, where a new tensor's pages would be."""
        if self.identity:
            return c if out is None else out.copy_(c)
        if self.group == 1:
            return torch.matmul(c, self.matrices("synthesis", kind, c.device).transpose(-1, -2), out=out)
        return _grouped_matmul(c, self.matrices("synthesis", kind, c.device), self.group, out)


def _grouped_matmul(x: torch.Tensor, m: torch.Tensor, group: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = M x`` per group of ``group`` heads, ``x`` and ``y`` in the heads' layout ``(layers, heads, tokens, dim)``,
    ``m`` ``(layers, groups, n, n)``: one batched product per (output head, input head) block of ``M``, accumulated
    in ``out`` (any strides whose (layer, group) dims merge; else through a temporary). No copy of ``x`` into
    the groups' side-by-side layout: that copy cost a third of a chunk's synthesis. The same operations in the
    same order with or without ``out``."""
    layers, heads, tokens, dim = x.shape
    groups = heads // group
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    try:
        ys = [y.unflatten(1, (groups, group))[:, :, h].view(layers * groups, tokens, dim) for h in range(group)]
    except RuntimeError:  # strides that do not merge: compute in a fresh tensor, then copy
        return out.copy_(_grouped_matmul(x, m, group))  # type: ignore[union-attr]
    xs = x.unflatten(1, (groups, group))
    mt = m.transpose(-1, -2)
    for ho, yo in enumerate(ys):
        for hi in range(group):
            a = xs[:, :, hi].flatten(0, 1)
            b = mt[:, :, hi * dim : (hi + 1) * dim, ho * dim : (ho + 1) * dim].flatten(0, 1)
            if hi == 0:
                torch.bmm(a, b, out=yo)
            else:
                yo.baddbmm_(a, b)
    return y


def group_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """``(layers, heads, tokens, dim)`` -> ``(layers, heads // group, tokens, group * dim)``: each group's
    heads side by side (a copy unless ``group`` is 1)."""
    if group == 1:
        return x
    layers, heads, tokens, dim = x.shape
    return x.unflatten(1, (heads // group, group)).transpose(2, 3).reshape(layers, heads // group, tokens, group * dim)


def fit_transform(covariance: torch.Tensor, fisher: torch.Tensor | None = None, eps: float = 0.01, *, group: int = 1) -> Transform:
    """The transform of the module docstring from ``covariance`` and ``fisher``, both ``(2, layers, groups, n, n)``
    for groups of ``group`` heads (``kvstats.py`` sums them so). The linear algebra runs in numpy (its own
    LAPACK): torch 2.13's MKL hangs on batched LU and eigh of 192 x 192 float64 matrices after
    ``torch.set_num_threads(2)``."""
    cov = covariance.double().numpy()
    eye = np.eye(cov.shape[-1])
    if fisher is None:
        chol = np.broadcast_to(eye, cov.shape)
    else:
        f = fisher.double().numpy()
        f = 0.5 * (f + np.swapaxes(f, -1, -2))
        scale = np.maximum(np.diagonal(f, axis1=-2, axis2=-1).mean(-1), 1e-300)
        chol = np.linalg.cholesky(f + eps * scale[..., None, None] * eye)
    chol_t = np.swapaxes(chol, -1, -2)
    weighted = chol_t @ cov @ chol
    lam, u = np.linalg.eigh(0.5 * (weighted + np.swapaxes(weighted, -1, -2)))
    lam, u = np.maximum(lam[..., ::-1], 0), u[..., ::-1]  # largest component first
    g = max(float(np.sqrt(lam.mean())), 1e-30)
    analysis = np.swapaxes(u, -1, -2) @ chol_t / g
    synthesis = np.linalg.solve(chol_t, u) * g
    spread = np.sqrt(lam) / g
    spread = spread.reshape(*spread.shape[:2], spread.shape[2] * group, -1)

    def f32(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))

    return Transform(f32(analysis), f32(synthesis), f32(spread))


def scale_layers(t: Transform, multipliers: torch.Tensor) -> Transform:
    """``t`` with each (kind, layer)'s components divided by ``multipliers[kind, layer]`` (float ``(2, layers)``, > 0):
    one step then quantises that layer ``multiplier`` times as coarsely (``sensitivity.py``). ``A / m``, ``B * m``,
    ``spread / m``: the same channels from the same rounded components, a layer's error scaled by ``m``."""
    m = multipliers.to(torch.float64)
    if m.shape != t.analysis.shape[:2] or not (torch.isfinite(m).all() and (m > 0).all()):
        raise ValueError(f"multipliers must be finite, positive and of shape {tuple(t.analysis.shape[:2])}")
    mm = m[:, :, None, None, None]
    return Transform((t.analysis.double() / mm).float(), (t.synthesis.double() * mm).float(), (t.spread.double() / mm[..., 0]).float())


@functools.lru_cache(maxsize=4)
def identity_transform(layers: int, heads: int, dim: int) -> Transform:
    """Components = channels (the codec without a profile); one per shape, shared (never written to)."""
    eye = torch.eye(dim).expand(2, layers, heads, dim, dim).contiguous()
    return Transform(eye, eye, torch.ones(2, layers, heads, dim), identity=True)


#: Bits of a stored synthesis column whose component's spread is its matrix's median: one bit more per doubling
#: of the spread, within ``COLUMN_BITS``. A column's rounding leaks its component's variance into the others, so
#: a strong component's column is kept finer (reverse water-filling, as for the components themselves).
MEDIAN_COLUMN_BITS, COLUMN_BITS = 6, (3, 8)


def column_widths(spread: np.ndarray) -> np.ndarray:
    """Bits of each stored synthesis column from the components' stored ``spread`` in the matrices' layout
    ``(2, layers, groups, n)``: uint8, the same shape."""
    sp = np.maximum(np.asarray(spread, dtype=np.float64), 1e-30)
    rel = np.log2(sp / np.median(sp, axis=-1, keepdims=True))
    return np.clip(np.rint(MEDIAN_COLUMN_BITS + rel), *COLUMN_BITS).astype(np.uint8)


def _radius(widths: np.ndarray) -> np.ndarray:
    """``m = 2 ** (width - 1) - 1``: the largest magnitude a column of ``widths`` bits stores, int64."""
    return (1 << widths.astype(np.int64)) // 2 - 1


def to_stored(t: Transform) -> dict[str, np.ndarray]:
    """The stored form of ``t``: each column ``j`` of each synthesis matrix (component ``j``'s channels) as
    integers of ``widths[j]`` bits (``column_widths``) times ``column_scale[j]`` (its largest magnitude),
    packed end to end (``bitpack``) into ``synthesis`` uint8; ``spread`` float16 ``(2, layers, heads, dim)``.
    About 6 bits an entry: the reference model's matrices take 1.7 MB instead of 4.4 MB in float16, for
    0.1 % more bits per element (``docs/history/2026-11-28-profile-v5.md``)."""
    spread = t.spread.to(torch.float16).numpy()
    b = t.synthesis.double().numpy()
    kinds, layers, groups, n, _ = b.shape
    widths = column_widths(spread.reshape(kinds, layers, groups, n))
    scale = np.maximum(np.abs(b).max(axis=-2), 1e-30).astype(np.float32)
    m = _radius(widths)[..., None, :]
    q = np.clip(np.rint(b / scale.astype(np.float64)[..., None, :] * m), -m, m)
    packed = pack((q + m).astype(np.uint8), np.broadcast_to(widths[..., None, :], b.shape))
    return {"synthesis": packed, "widths": widths, "column_scale": scale, "spread": spread}


def from_stored(synthesis: np.ndarray, widths: np.ndarray, column_scale: np.ndarray, spread: np.ndarray) -> Transform:
    """The transform of a stored form (``to_stored``): ``B = (u - m) * column_scale / m`` in float32 (``u`` the
    packed integers, ``m = 2 ** (width - 1) - 1``: the same value on every platform), ``A`` its inverse
    (computed in float64). ``ValueError`` when the parts do not fit together, or a matrix is singular or too
    ill-conditioned for ``A B = I`` to hold within 1e-4 in float32."""
    widths = np.asarray(widths)
    scale = np.asarray(column_scale, dtype=np.float32)
    if widths.dtype != np.uint8 or widths.ndim != 4 or scale.shape != widths.shape or not widths.size:
        raise ValueError("transform widths and column scales must be (2, layers, groups, n), widths uint8")
    if widths.min() < 2 or widths.max() > 8 or not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError("transform column widths must be in [2, 8] bits and column scales finite and positive")
    shape = (*widths.shape, widths.shape[-1])
    u = unpack(synthesis, np.broadcast_to(widths[..., None, :], shape)).astype(np.float32)
    m = _radius(widths).astype(np.float32)[..., None, :]
    if (u > 2 * m).any():
        raise ValueError("a stored synthesis value is out of its column's range")
    b = torch.from_numpy((u - m) * scale[..., None, :] / m)
    eye = torch.eye(b.shape[-1], dtype=torch.float64)
    try:  # numpy's LAPACK, not torch's: see fit_transform
        a64 = torch.from_numpy(np.linalg.inv(b.double().numpy())) if torch.isfinite(b).all() else None
    except np.linalg.LinAlgError:  # exactly singular
        a64 = None
    if a64 is None or not torch.isfinite(a64).all():
        raise ValueError("transform synthesis is not invertible")
    a = a64.float()
    if (torch.matmul(a.double(), b.double()) - eye).abs().max() > 1e-4:
        raise ValueError("transform synthesis is too ill-conditioned to invert in float32")
    return Transform(a.contiguous(), b.contiguous(), torch.from_numpy(np.asarray(spread, dtype=np.float16).astype(np.float32)))
