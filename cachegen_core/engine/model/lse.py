"""Attention that also returns its log-sum-exp: what the packed forward's cascade attention combines a shared prefix's
attention and a tail's by (``packed.py``).

torch's fused kernels return it without materialising the scores (:data:`KERNELS`: the CPU's flash attention, CUDA's
memory-efficient attention, both reading 16-bit keys and values as they are); :func:`manual` computes it by hand in
float32 where none applies (soft-capping, another device) or after one failed, which is said once (:data:`UNFUSED`).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("cachegen_core.engine")

#: Why torch's fused attention with a log-sum-exp failed on a kind of device (there it is computed by hand from then on).
UNFUSED: dict[str, str] = {}


def manual(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
           softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention of ``q`` (1, h, m, d) over ``k``/``v`` (1, h, n, d) in float32, with soft-capping: (output, log-sum-exp)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.float()).to(q.dtype), lse


def _cpu_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
    return out, lse


def _cuda_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)[:2]
    return out, lse[..., : q.shape[2]]  # its log-sum-exp padded to a multiple of 32 queries


#: torch's fused attention returning its log-sum-exp, by kind of device: ``(q, k, v, bias, scale) -> (out, lse)``.
KERNELS = {"cpu": _cpu_kernel, "cuda": _cuda_kernel}
#: What the length of the keys (and of an additive bias) must be a multiple of, by kind of device (CUDA's memory-efficient
#: kernel wants a bias's rows 16-element aligned).
ALIGN = {"cuda": 16}


def fuses(q: torch.Tensor, k: torch.Tensor, softcap: float | None) -> bool:
    """Whether :func:`fused` applies: no soft-capping, keys of the queries' dtype, a device with a kernel that has not failed."""
    kind = q.device.type
    return not softcap and q.dtype == k.dtype and kind in KERNELS and kind not in UNFUSED


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of ``q`` (b, h, m, d) over ``k``/``v`` (b, h, n, d) plus the additive ``bias`` (broadcast to (b, h, m,
    n)), with its log-sum-exp (b, h, m) float32, by torch's fused kernel for the device (:data:`KERNELS`: the CPU's flash
    attention, CUDA's memory-efficient one, reading 16-bit keys and values once where :func:`manual` copies them to
    float32); None when it failed (said once: the device's attention is then computed by hand)."""
    kind = q.device.type
    try:
        out, lse = KERNELS[kind](q, k, v, bias, scale)
    except (RuntimeError, NotImplementedError) as e:
        UNFUSED[kind] = f"{type(e).__name__}: {e}"
        log.warning("torch's fused attention failed on %s (%s): shared prefixes' attention computed in float32 by hand", kind, e)
        return None
    return out, lse.float()


def with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
             softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention of ``q`` (1, h, m, d) over ``k``/``v`` (1, h, n, d) (as many heads), with its log-sum-exp (1, h, m),
    float32: the device's fused kernel where it applies (with a mask: where keys need no alignment), else in float32
    by hand."""
    if fuses(q, k, softcap) and (mask is None or q.device.type not in ALIGN):
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        done = fused(q, k, v, bias, scale)
        if done is not None:
            return done
    return manual(q, k, v, scale, mask, softcap)
