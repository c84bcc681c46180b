// Interleaved rANS with static 16-bit frequency tables: the one coder core shared by the
// threaded CPU library (rans_cpu.cpp) and the CUDA decoder (rans_cuda.cu).
//
// Substream byte format (little endian):
//   [LANES x u32 final encoder states][u16 words, in the order the decoder reads them]
// Symbol j of a substream belongs to lane j % LANES and is coded with table
// table_ids[j % period]. Decoding walks j = 0..n-1; after decoding symbol j its lane
// renormalises by reading one u16 word when its state fell below 2^16. Within a round of
// LANES symbols the lanes read in lane order, so a warp can decode a substream with one
// lane per thread (ballot + popc gives each lane its word offset).
// A complete substream ends with every lane back at the initial state RANS_L and every
// byte consumed: truncated, padded or garbled input is detected with high probability.
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define CG_HD __host__ __device__ __forceinline__
#define CG_UNROLL _Pragma("unroll")
#else
#define CG_HD inline
#define CG_UNROLL _Pragma("GCC unroll 16")
#endif

#define CG_LANES 16
#define CG_PREC 16
#define CG_RANS_L (1u << 16)

enum {
    CG_OK = 0,
    CG_ERR_SHORT = -1,      // payload shorter than its states / ran out of words
    CG_ERR_STATE = -2,      // an initial state outside [2^16, 2^32)
    CG_ERR_TRAILING = -3,   // bytes left over after the last symbol
    CG_ERR_FINAL = -4,      // a lane did not return to the initial state (corrupt)
    CG_ERR_CAPACITY = -5,   // encoder output buffer too small
    CG_ERR_SYMBOL = -6,     // symbol outside the alphabet
    CG_ERR_ARGS = -7,       // inconsistent arguments
};

// Largest s in [0, alphabet) with cdf[s] <= slot (cdf has alphabet + 1 entries, cdf[0] = 0).
CG_HD uint32_t cg_find(const uint32_t* cdf, uint32_t alphabet, uint32_t slot) {
    uint32_t lo = 0, len = alphabet;
    while (len > 1) {
        uint32_t half = len >> 1;
        lo = (cdf[lo + half] <= slot) ? lo + half : lo;
        len -= half;
    }
    return lo;
}

// Encoder step for one symbol; *ptr moves backwards (u16 words, little endian). False when out of room.
CG_HD bool cg_enc_put(uint32_t* x, uint8_t** ptr, const uint8_t* floor_ptr, uint32_t start, uint32_t freq) {
    uint32_t x_max = ((CG_RANS_L >> CG_PREC) << 16) * freq;  // freq < 2^16 so this fits
    if (*x >= x_max) {
        if (*ptr - floor_ptr < 2) return false;
        *ptr -= 2;
        (*ptr)[0] = (uint8_t)(*x & 0xff);
        (*ptr)[1] = (uint8_t)((*x >> 8) & 0xff);
        *x >>= 16;
    }
    *x = ((*x / freq) << CG_PREC) + (*x % freq) + start;
    return true;
}

// Decoder step: returns the symbol and updates the state (renormalisation done by caller).
CG_HD uint32_t cg_dec_get(uint32_t* x, const uint32_t* cdf, uint32_t alphabet) {
    uint32_t slot = *x & ((1u << CG_PREC) - 1);
    uint32_t s = cg_find(cdf, alphabet, slot);
    uint32_t start = cdf[s], freq = cdf[s + 1] - start;
    *x = freq * (*x >> CG_PREC) + slot - start;
    return s;
}

CG_HD uint32_t cg_load_u32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

CG_HD uint32_t cg_load_u16(const uint8_t* p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

// Decode one substream of n symbols (CPU path; the CUDA kernel runs one lane per thread instead).
// Rounds of CG_LANES symbols are unrolled so the lanes' table searches overlap.
CG_HD int cg_decode_stream(const uint8_t* in, int64_t in_len, int64_t n, const int32_t* table_ids, int32_t period,
                           const uint32_t* cdf, uint32_t alphabet, uint8_t* out) {
    if (n == 0) return in_len == 0 ? CG_OK : CG_ERR_TRAILING;
    if (in_len < 4 * CG_LANES) return CG_ERR_SHORT;
    uint32_t x[CG_LANES];
    for (int k = 0; k < CG_LANES; ++k) {
        x[k] = cg_load_u32(in + 4 * k);
        if (x[k] < CG_RANS_L) return CG_ERR_STATE;
    }
    const uint8_t* pos = in + 4 * CG_LANES;
    const uint8_t* end = in + in_len;
    const int64_t stride = alphabet + 1;
    int32_t t = 0;  // j % period, carried incrementally
    int64_t j = 0;
    for (; j + CG_LANES <= n; j += CG_LANES) {
        uint32_t sym[CG_LANES];
CG_UNROLL
        for (int k = 0; k < CG_LANES; ++k) {
            int32_t tk = t + k;
            tk -= (tk >= period) ? period : 0;
            if (tk >= period) tk %= period;  // only when period < CG_LANES
            sym[k] = cg_dec_get(&x[k], cdf + (int64_t)table_ids[tk] * stride, alphabet);
        }
CG_UNROLL
        for (int k = 0; k < CG_LANES; ++k) {
            out[j + k] = (uint8_t)sym[k];
            if (x[k] < CG_RANS_L) {
                if (end - pos < 2) return CG_ERR_SHORT;
                x[k] = (x[k] << 16) | cg_load_u16(pos);
                pos += 2;
            }
        }
        t = (int32_t)((t + CG_LANES) % period);
    }
    for (int k = 0; j < n; ++j, ++k) {
        out[j] = (uint8_t)cg_dec_get(&x[k], cdf + (int64_t)table_ids[t] * stride, alphabet);
        if (x[k] < CG_RANS_L) {
            if (end - pos < 2) return CG_ERR_SHORT;
            x[k] = (x[k] << 16) | cg_load_u16(pos);
            pos += 2;
        }
        if (++t == period) t = 0;
    }
    if (pos != end) return CG_ERR_TRAILING;
    for (int k = 0; k < CG_LANES; ++k)
        if (x[k] != CG_RANS_L) return CG_ERR_FINAL;
    return CG_OK;
}
