"""The Triton kernel of ``own_decode.py``: every decoding request's attention over its own KV buffer in one launch.

Imported only by ``own_decode.py``, on first use (it imports triton, which decides at import whether ``@triton.jit``
compiles for the GPU or runs in its interpreter, ``TRITON_INTERPRET=1``).

A program is one request (a *part*) and one KV head: the ``G`` query heads that share that KV head (grouped-query
attention) read its keys ``[first, filled)`` from the request's buffer once, in blocks of ``BLOCK`` tokens, with an
online softmax (FlashAttention's running maximum and sum, in float32), then the request's new token, whose key and value
come from the model's projections and are written into the buffer at ``filled`` (for the next steps). The buffers are
separate allocations: a part's buffer is found by its address in a table (an int64 cast to a pointer of the keys'
type), with its layer and head strides (tokens are ``D`` elements apart, elements contiguous). The output rows are
stored in the caller's tensor; ``WRITE_LSE``: the log-sum-exp of each row too (natural log), to combine with a shared
prefix's attention.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def own_decode_kernel(q_ptr, q_stride_h, q_stride_t, kn_ptr, kn_stride_h, kn_stride_t, vn_ptr, vn_stride_h, vn_stride_t,
                      qrow_ptr, orow_ptr, kaddr_ptr, vaddr_ptr, stride_l_ptr, stride_h_ptr, first_ptr, filled_ptr,
                      out_ptr, o_stride_t, o_stride_h, lse_ptr, layer, scale,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                      WRITE_LSE: tl.constexpr):  # fmt: skip
    part = tl.program_id(0)
    kv = tl.program_id(1)
    qrow = tl.load(qrow_ptr + part)
    orow = tl.load(orow_ptr + part)
    first = tl.load(first_ptr + part)
    filled = tl.load(filled_ptr + part)
    base = layer * tl.load(stride_l_ptr + part) + kv * tl.load(stride_h_ptr + part)
    keys = tl.load(kaddr_ptr + part).to(kn_ptr.dtype) + base  # this layer's and head's keys of the part's buffer
    values = tl.load(vaddr_ptr + part).to(vn_ptr.dtype) + base

    gs = tl.arange(0, GP)
    ds = tl.arange(0, DP)
    heads = kv * G + gs
    dmask = ds < D
    qmask = (gs < G)[:, None] & dmask[None, :]
    q = tl.load(q_ptr + heads[:, None] * q_stride_h + qrow * q_stride_t + ds[None, :], mask=qmask, other=0.0).to(tl.float32)
    q = q * scale
    kn = tl.load(kn_ptr + kv * kn_stride_h + qrow * kn_stride_t + ds, mask=dmask, other=0.0)
    vn = tl.load(vn_ptr + kv * vn_stride_h + qrow * vn_stride_t + ds, mask=dmask, other=0.0)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for start in range(first, filled, BLOCK):
        ns = start + tl.arange(0, BLOCK)
        nmask = ns < filled
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(keys + ns[:, None] * D + ds[None, :], mask=kvmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (GP, BLOCK)
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(values + ns[:, None] * D + ds[None, :], mask=kvmask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    # the new token: its score, then its key and value stored for the next steps
    s_new = tl.sum(q * kn.to(tl.float32)[None, :], axis=1)  # (GP,)
    m_new = tl.maximum(m_i, s_new)
    alpha = tl.exp(m_i - m_new)
    p_new = tl.exp(s_new - m_new)
    l_i = l_i * alpha + p_new
    acc = acc * alpha[:, None] + p_new[:, None] * vn.to(tl.float32)[None, :]
    tl.store(keys + filled * D + ds, kn, mask=dmask)
    tl.store(values + filled * D + ds, vn, mask=dmask)

    out = acc / l_i[:, None]
    tl.store(out_ptr + orow * o_stride_t + heads[:, None] * o_stride_h + ds[None, :], out.to(out_ptr.dtype.element_ty), mask=qmask)
    if WRITE_LSE:
        tl.store(lse_ptr + orow * (G * tl.num_programs(1)) + heads, m_new + tl.log(l_i), mask=gs < G)
