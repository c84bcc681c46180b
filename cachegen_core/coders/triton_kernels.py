"""The Triton kernels of the GPU decoder of ``native-rans16-v1`` (the byte format of ``csrc/rans_core.h``).

Imported only by ``triton_decoder.py``, on first use (it imports triton, which decides at import
whether ``@triton.jit`` compiles for the GPU or runs in its interpreter, ``TRITON_INTERPRET=1``).

A program decodes ``S`` substreams at once as an ``(S, 16)`` block: row ``i`` is a substream, column
``k`` its lane ``k``. Each round every live lane decodes one symbol (its slot found by a bisection of
``STEPS = ceil(log2(alphabet))`` reads over the table's cumulative starts, through the substream's
table id of that position), then the lanes whose state fell below ``2^16`` take the next words of
their row in lane order: an exclusive ``tl.cumsum`` over those lanes gives each its word. Every read
is masked by bounds the host checked before the launch (offsets, table ids) or that the kernel
checks itself (a row that would read past its payload stops with ``ERR_SHORT``), so a bad payload
gives a status code per substream, never a read out of bounds. The status codes are
``csrc/rans_core.h``'s.

``decode_kv_kernel`` turns each symbol into its KV element as ``csrc/kv_core.h`` does (one rounding
per operation, in that order; launched without fused multiply-adds): ``(s - 128) * step``, plus the
chunk mean, the keys' rotary embedding, the output dtype, stored at its place in the caller's KV
tensors. Substreams hold whole tokens, so every row of a program is at the same position of the
period in a round. The rotary pair ``(d, d + head_dim / 2)`` of a key is in one round when
``head_dim`` divides 16 (``ROT == 1``: the halves swapped in registers), or the same lane's ``R``
rounds apart when ``head_dim`` is a multiple of 32 (``ROT == 2``: the lower half waits in a
register buffer of ``R`` rounds); ``ROT == 0``: no rotation. Without the mean it writes the float32
components that a profile's transform turns into KV (in torch).
"""

from __future__ import annotations

import triton
import triton.language as tl

LANES = 16
# kernels read module globals only as constexpr (the interpreter accepts plain ints, the compiler does not)
ERR_SHORT, ERR_STATE, ERR_TRAILING = tl.constexpr(-1), tl.constexpr(-2), tl.constexpr(-3)
ERR_FINAL, ERR_SYMBOL = tl.constexpr(-4), tl.constexpr(-6)


@triton.jit
def _word(ptr, mask):
    """The u16 words at ``ptr`` (an int16 tensor's), zero-extended to uint32."""
    return (tl.load(ptr, mask=mask, other=0).to(tl.int32) & 0xFFFF).to(tl.uint32)


@triton.jit
def _rows(pid, order, word_off, sym_off, n_streams, S: tl.constexpr):
    """The substreams of program ``pid``: index, payload start and length in words, first symbol, symbols."""
    row = pid * S + tl.arange(0, S)
    has = row < n_streams
    s = tl.load(order + row, mask=has, other=0)
    base = tl.load(word_off + s, mask=has, other=0)
    n_words = tl.load(word_off + s + 1, mask=has, other=0) - base
    first = tl.load(sym_off + s, mask=has, other=0)
    n = tl.load(sym_off + s + 1, mask=has, other=0) - first
    return s, has, base, n_words, first, n


@triton.jit
def _start(words, base, n_words, n, has):
    """Initial lane states ``(S, 16)``, which rows decode, and each row's status so far."""
    lane = tl.arange(0, 16)
    started = has & (n > 0)
    short = started & (n_words < 32)
    err = tl.where(has & (n == 0) & (n_words != 0), ERR_TRAILING, 0)
    err = tl.where(short, ERR_SHORT, err)
    live = started & (n_words >= 32)
    at = words + base[:, None] + 2 * lane[None, :]
    x = _word(at, live[:, None]) | (_word(at + 1, live[:, None]) << 16)
    bad = tl.max((x < 65536).to(tl.int32), axis=1) > 0
    err = tl.where(live & bad, ERR_STATE, err)
    live = live & (bad == 0)
    x = tl.where(live[:, None], x, 65536)
    return x, live, err


@triton.jit
def _step(x, row_ptr, active, last, STEPS: tl.constexpr, POW2: tl.constexpr):
    """One decoder step of every active lane: the symbols, and the states updated (``cg_dec_step``)."""
    slot = x & 0xFFFF
    sym = tl.zeros(x.shape, tl.uint32)
    for b in tl.static_range(STEPS):  # the last symbol s with start(s) <= slot, one bit at a time
        cand = sym | (1 << (STEPS - 1 - b))
        if POW2:
            e = tl.load(row_ptr + cand, mask=active, other=0)
            sym = tl.where((e & 0xFFFF) <= slot, cand, sym)
        else:
            ok = active & (cand <= last)
            e = tl.load(row_ptr + cand, mask=ok, other=0)
            sym = tl.where(ok & ((e & 0xFFFF) <= slot), cand, sym)
    e = tl.load(row_ptr + sym, mask=active, other=0)
    x = tl.where(active, (e >> 16) * (x >> 16) + slot - (e & 0xFFFF), x)
    return sym, x


@triton.jit
def _renorm(words, base, n_words, x, pos, live, err, active):
    """The lanes below ``2^16`` read their row's next words in lane order; a row out of words stops short."""
    need = active & (x < 65536)
    need_i = need.to(tl.int32)
    total = tl.sum(need_i, axis=1)
    rank = tl.cumsum(need_i, axis=1) - need_i
    fits = pos + total <= n_words
    err = tl.where(live & (fits == 0), ERR_SHORT, err)
    live = live & fits
    take = need & live[:, None]
    w = _word(words + base[:, None] + pos[:, None] + rank, take)
    x = tl.where(take, (x << 16) | w, x)
    pos = tl.where(live, pos + total, pos)
    return x, pos, live, err


@triton.jit
def _finish(status, s, has, x, pos, n_words, live, err, bad_symbol):
    """Each row's status: a complete row consumed every word and brought every lane back to ``2^16``."""
    final = tl.max((x != 65536).to(tl.int32), axis=1) > 0
    err = tl.where(live & (pos != n_words), ERR_TRAILING, tl.where(live & final, ERR_FINAL, err))
    err = tl.where(live & (err == 0) & bad_symbol, ERR_SYMBOL, err)
    tl.store(status + s, err, mask=has)


@triton.jit
def _put(ptr, y, mask, BF16: tl.constexpr):
    """Store float32 ``y`` in ``ptr``'s dtype, rounded to nearest even; ``BF16``: ``ptr`` holds bfloat16 bits (int16),
    rounded as ``cg_bf16_bits`` does (the interpreter's own conversion to bfloat16 truncates)."""
    if BF16:
        u = y.to(tl.uint32, bitcast=True)
        bits = tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        tl.store(ptr, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def decode_symbols_kernel(
    words,
    word_off,
    sym_off,
    order,
    prog_rounds,
    n_streams,
    table_ids,
    ids_stride,
    period,
    info,
    alphabet,
    out,
    status,
    S: tl.constexpr,
    STEPS: tl.constexpr,
    POW2: tl.constexpr,
):
    """Substream ``order[i]`` (payload ``words[word_off[s]:word_off[s + 1]]``) into ``out[sym_off[s]:sym_off[s + 1]]``
    as uint8, symbol ``j`` with table ``table_ids[s * ids_stride + j % period]`` (0: one row for all) of ``info``
    (uint32 ``start | freq << 16`` per symbol)."""
    pid = tl.program_id(0)
    s, has, base, n_words, first, n = _rows(pid, order, word_off, sym_off, n_streams, S)
    x, live, err = _start(words, base, n_words, n, has)
    pos = tl.zeros(base.shape, tl.int64) + 32
    lane = tl.arange(0, 16).to(tl.int64)
    last = (alphabet - 1).to(tl.uint32)
    for r in range(0, tl.load(prog_rounds + pid)):
        j = r * 16 + lane
        active = live[:, None] & (j[None, :] < n[:, None])
        tid = tl.load(table_ids + s[:, None].to(tl.int64) * ids_stride + (j % period)[None, :], mask=active, other=0)
        sym, x = _step(x, info + tid.to(tl.int64) * alphabet, active, last, STEPS, POW2)
        tl.store(out + first[:, None] + j[None, :], sym.to(tl.uint8), mask=active)
        x, pos, live, err = _renorm(words, base, n_words, x, pos, live, err, active)
    _finish(status, s, has, x, pos, n_words, live, err, n < 0)


@triton.jit
def decode_kv_kernel(
    words,
    word_off,
    sym_off,
    order,
    prog_rounds,
    n_streams,
    table_ids,
    ids_stride,
    period,
    info,
    alphabet,
    steps,
    means,
    cos,
    sin,
    out_k,
    out_v,
    stride_l,
    stride_h,
    stride_t,
    first_token,
    layers,
    heads,
    min_symbol,
    status,
    S: tl.constexpr,
    STEPS: tl.constexpr,
    POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    R: tl.constexpr,
    ADD_MEAN: tl.constexpr,
    BF16: tl.constexpr,
):
    """Substreams of whole tokens (``period = 2 * layers * heads * HEAD_DIM`` symbols each, from coded token
    ``sym_off[s] / period``) decoded into KV: see the module docstring. ``steps``, ``means``: float32 per position
    of the period; ``cos``, ``sin``: float32 ``(coded tokens, HEAD_DIM)``; ``out_k``, ``out_v``: ``(layers, heads,
    tokens, HEAD_DIM)`` with strides ``stride_*`` (elements, the last 1), coded token ``t`` at ``first_token + t``."""
    pid = tl.program_id(0)
    s, has, base, n_words, first, n = _rows(pid, order, word_off, sym_off, n_streams, S)
    x, live, err = _start(words, base, n_words, n, has)
    pos = tl.zeros(base.shape, tl.int64) + 32
    lane = tl.arange(0, 16).to(tl.int64)
    last = (alphabet - 1).to(tl.uint32)
    token0 = first // period
    per_kind = layers * heads * HEAD_DIM
    HALF: tl.constexpr = HEAD_DIM // 2
    bad_symbol = n < 0
    lower = tl.zeros([S, R, 16], tl.int32)  # ROT == 2: the lower half of the current key vectors, as float bits
    slots = tl.arange(0, R)[:, None][None, :, :]
    for r in range(0, tl.load(prog_rounds + pid)):
        j = r * 16 + lane
        tk = j % period
        active = live[:, None] & (j[None, :] < n[:, None])
        tid = tl.load(table_ids + s[:, None].to(tl.int64) * ids_stride + tk[None, :], mask=active, other=0)
        sym, x = _step(x, info + tid.to(tl.int64) * alphabet, active, last, STEPS, POW2)
        bad_symbol = bad_symbol | (tl.max((active & (sym.to(tl.int32) < min_symbol)).to(tl.int32), axis=1) > 0)
        v = (sym.to(tl.int32) - 128).to(tl.float32) * tl.load(steps + tk)[None, :]
        if ADD_MEAN:
            v = v + tl.load(means + tk)[None, :]
        kind = tk // per_kind
        vec = (tk - kind * per_kind) // HEAD_DIM
        d = tk % HEAD_DIM
        t = token0[:, None] + (j // period)[None, :]
        at = (vec // heads) * stride_l + (vec % heads) * stride_h + (first_token + t) * stride_t + d[None, :]
        key = active & (kind == 0)[None, :]
        y = v
        if ROT == 1:  # the pair (d, d + HALF) in this round: swap the halves of each head vector
            g: tl.constexpr = 16 // HEAD_DIM
            p = tl.reshape(tl.flip(tl.reshape(v, [S, g, 2, HALF]), 2), [S, 16])
            p = tl.where((d < HALF)[None, :], -p, p)
            c = tl.load(cos + t * HEAD_DIM + d[None, :], mask=key, other=0.0)
            sn = tl.load(sin + t * HEAD_DIM + d[None, :], mask=key, other=0.0)
            y = tl.where(key, v * c + p * sn, v)
        if ROT == 2:  # lanes d < HALF wait for their partners d + HALF, R rounds later and in the same lane
            here = slots == ((d % HALF) // 16)[None, None, :]
            lower = tl.where(here & (d < HALF)[None, None, :], v.to(tl.int32, bitcast=True)[:, None, :], lower)
            lo = tl.sum(tl.where(here, lower, 0), axis=1).to(tl.float32, bitcast=True)  # one term: exact
            upper = key & (d >= HALF)[None, :]
            at_t = t * HEAD_DIM + d[None, :]
            c = tl.load(cos + at_t, mask=upper, other=0.0)
            sn = tl.load(sin + at_t, mask=upper, other=0.0)
            c_lo = tl.load(cos + at_t - HALF, mask=upper, other=0.0)
            sn_lo = tl.load(sin + at_t - HALF, mask=upper, other=0.0)
            y = tl.where(upper, v * c + lo * sn, v)
            _put(out_k + at - HALF, lo * c_lo + (-v) * sn_lo, upper, BF16)
            key = upper
        _put(out_k + at, y, key, BF16)
        _put(out_v + at, y, active & (kind == 1)[None, :], BF16)
        x, pos, live, err = _renorm(words, base, n_words, x, pos, live, err, active)
    _finish(status, s, has, x, pos, n_words, live, err, bad_symbol)
