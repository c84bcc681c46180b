// Interleaved rANS with static 16-bit frequency tables: the coder core of the threaded CPU
// library (rans_cpu.cpp, kv_fused.cpp). Plain functions over raw pointers. The GPU decoder is
// the Triton port of cg_dec_step and the renormalisation below (cachegen_core/coders/triton_kernels.py).
//
// ---------------------------------------------------------------------------------------
// Substream byte format "native-rans16-v1" (all integers little endian)
//
//   n == 0 symbols:  zero bytes.
//   n >= 1 symbols:  [CG_LANES x u32 initial decoder states] [u16 words ...]
//
// Symbol j of a substream belongs to lane j % CG_LANES and is coded with table
// table_ids[j % period] (16-bit precision: freq >= 1, sum 2^16). Each lane is a 32-bit
// rANS state x in [2^16, 2^32). Decoding symbol j of lane k:
//     slot = x & 0xffff;  s = the symbol with start(s) <= slot < start(s) + freq(s)
//     x    = freq(s) * (x >> 16) + slot - start(s)
// Symbols are decoded in rounds of CG_LANES (j = r*CG_LANES + k, k = 0..CG_LANES-1; the
// last round may be partial); after a round, each lane whose state fell below 2^16, in
// lane order, reads the next u16 word w: x = (x << 16) | w. At most one word per lane
// and round, so a GPU can decode a substream with one lane per thread (a prefix sum over
// the lanes that need a word gives each its word). A complete substream ends with every lane back at 2^16 and
// every byte consumed; the decoder rejects anything else, so truncated, padded or
// garbled input is detected with high probability (and never read out of bounds).
// The encoder starts every lane at 2^16, codes symbols from last to first, and writes
// words backwards; its final states are the decoder's initial states.
// ---------------------------------------------------------------------------------------
//
// Tables in memory (built once per table set by cg_build_tables, never per symbol):
//   info[t * alphabet + s] = start(s) | freq(s) << 16      (u32; start, freq < 2^16)
//   lut[t << lut_bits | b]  = the symbol that holds slot b << (16 - lut_bits)   (u8)
// The decoder finds a symbol with two adjacent lut reads and, when the lut bucket holds
// several symbols, a bisection over info (see cg_lookup).
#pragma once
#include <stdint.h>

#define CG_HD inline

#define CG_LANES 16
#define CG_PREC 16
#define CG_RANS_L (1u << 16)
#define CG_STATE_BYTES (4 * CG_LANES)

enum {
    CG_OK = 0,
    CG_ERR_SHORT = -1,     // payload shorter than its states / ran out of words
    CG_ERR_STATE = -2,     // an initial state outside [2^16, 2^32)
    CG_ERR_TRAILING = -3,  // bytes left over after the last symbol
    CG_ERR_FINAL = -4,     // a lane did not return to the initial state (corrupt)
    CG_ERR_CAPACITY = -5,  // encoder output buffer too small
    CG_ERR_SYMBOL = -6,    // symbol outside the alphabet
    CG_ERR_ARGS = -7,      // inconsistent arguments (offsets, table ids, sizes)
    CG_ERR_TABLE = -8,     // a frequency table with a zero entry or a sum other than 2^16
    CG_ERR_INTERNAL = -9,  // out of memory or no thread could be started
};

CG_HD uint32_t cg_load_u32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

CG_HD uint32_t cg_load_u16(const uint8_t* p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

CG_HD void cg_store_u16(uint8_t* p, uint32_t w) {
    p[0] = (uint8_t)w;
    p[1] = (uint8_t)(w >> 8);
}

CG_HD void cg_store_u32(uint8_t* p, uint32_t w) {
    cg_store_u16(p, w);
    cg_store_u16(p + 2, w >> 16);
}

// The symbol holding `slot` in one table, and its info entry in *e. lut[b] and lut[b + 1]
// (or the last symbol, for the last bucket) bound the symbol; a bucket holding several
// symbols is searched by bisection: at most 8 steps, so a lane that lands among many
// rare symbols never stalls its warp for long (a forward scan did, measured on an H100).
CG_HD uint32_t cg_lookup(const uint32_t* info, const uint8_t* lut, uint32_t lut_shift, uint32_t last, uint32_t slot,
                         uint32_t* e) {
    const uint32_t b = slot >> lut_shift;
    uint32_t lo = lut[b], hi = b < (0xffffu >> lut_shift) ? lut[b + 1] : last;
    while (lo < hi) {
        const uint32_t mid = (lo + hi + 1) >> 1;
        if ((info[mid] & 0xffffu) <= slot) lo = mid;
        else hi = mid - 1;
    }
    *e = info[lo];
    return lo;
}

// Decoder step without renormalisation: the symbol, and the state updated in place.
// `last` is alphabet - 1.
CG_HD uint32_t cg_dec_step(uint32_t* x, const uint32_t* info, const uint8_t* lut, uint32_t lut_shift, uint32_t last) {
    const uint32_t slot = *x & ((1u << CG_PREC) - 1);
    uint32_t e;
    const uint32_t s = cg_lookup(info, lut, lut_shift, last, slot, &e);
    *x = (e >> 16) * (*x >> CG_PREC) + slot - (e & 0xffffu);
    return s;
}

// Encoder step for info entry e: the state update, after the caller emitted the low word
// when *x >= cg_enc_limit(e) (and shifted x right by 16).
CG_HD uint32_t cg_enc_limit(uint32_t e) { return (e >> 16) << 16; }  // 2^16 * freq (freq < 2^16: fits)

CG_HD void cg_enc_step(uint32_t* x, uint32_t e) {
    const uint32_t freq = e >> 16;
    *x = ((*x / freq) << CG_PREC) + (*x % freq) + (e & 0xffffu);
}

// Build info and lut for n_tables rows of freqs (uint32, alphabet per row). Host only.
// Returns CG_ERR_TABLE unless every entry is >= 1 and every row sums to 2^16.
static inline int cg_build_tables_impl(const uint32_t* freqs, int32_t n_tables, int32_t alphabet, int32_t lut_bits,
                                       uint32_t* info, uint8_t* lut) {
    if (n_tables < 1 || alphabet < 2 || alphabet > 256 || lut_bits < 1 || lut_bits > 16) return CG_ERR_ARGS;
    const uint32_t shift = CG_PREC - (uint32_t)lut_bits;
    for (int64_t t = 0; t < n_tables; ++t) {
        const uint32_t* f = freqs + t * alphabet;
        uint32_t* in = info + t * alphabet;
        uint8_t* lt = lut + (t << lut_bits);
        uint32_t start = 0, b = 0;
        for (int32_t s = 0; s < alphabet; ++s) {
            if (f[s] < 1 || f[s] >= (1u << CG_PREC) || start + f[s] > (1u << CG_PREC)) return CG_ERR_TABLE;
            in[s] = start | (f[s] << 16);
            start += f[s];
            for (; b < (1u << lut_bits) && (b << shift) < start; ++b) lt[b] = (uint8_t)s;
        }
        if (start != (1u << CG_PREC)) return CG_ERR_TABLE;
    }
    return CG_OK;
}
