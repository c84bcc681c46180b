// Reconstruction of a v2 KV element without a per-head transform (a codec without a profile),
// used by the CPU decoder (kv_fused.cpp) and followed op for op by the Triton GPU decoder
// (cachegen_core/coders/triton_kernels.py). The float operations and their order are those of
// the torch reference (pipeline.synthesise_parts, rotary.rotate), one rounding each, so every
// decoder built without fused multiply-adds (-ffp-contract=off; Triton: enable_fp_fusion=False)
// writes bit-identical KV:
//
//     c = (float)(s - 128) * step               dequantised component
//     x = c + mean                              the chunk mean added back
//     key[d] = x[d] * cos[d] + r[d] * sin[d]    rotary embedding, r = rotate_half(x):
//                                               r[d] = -x[d + half] (d < half), x[d - half]
//
// and the result is rounded once to the output dtype (float32, bfloat16 or float16).
#pragma once
#include <stdint.h>
#include <string.h>

#include "rans_core.h"

enum { CG_OUT_F32 = 0, CG_OUT_BF16 = 1, CG_OUT_F16 = 2 };

CG_HD float cg_dequant(uint32_t symbol, float step) { return (float)((int32_t)symbol - 128) * step; }

// float32 -> bfloat16 bits, round to nearest even (NaN kept a quiet NaN), as torch converts.
CG_HD uint16_t cg_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// Rotary embedding of the pair (lo, hi) = (x[d], x[d + half]) of a head vector (head_dim = 2 * half), with
// cos and sin at d and d + half: torch's x * cos + rotate_half(x) * sin, in its order of operations.
CG_HD void cg_rotate_pair(float lo, float hi, float cos_lo, float sin_lo, float cos_hi, float sin_hi, float* out_lo,
                          float* out_hi) {
    *out_lo = lo * cos_lo + (-hi) * sin_lo;
    *out_hi = hi * cos_hi + lo * sin_hi;
}
