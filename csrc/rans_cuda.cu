// CUDA decoder for the interleaved-rANS substreams of rans_core.h (same bytes, same symbols
// as the CPU decoder). Each half-warp decodes one substream: thread k of the half runs
// lane k, decoding symbols j = k, k + CG_LANES, ... Within a round the lanes that
// must renormalise read consecutive u16 words in lane order (ballot + popc), exactly as the
// serial CPU decoder does. Substreams are taken in the order given by `order` (the host
// sorts them longest first, so the two halves of a warp get similar lengths).
// Tables (info, lut) are read through the read-only cache. Every payload read is checked
// against the substream's length, so bad input yields a status code, never a bad access.
//
// cg_decode_kv_kernel is the same decoder fused with the reconstruction of kv_core.h (a codec
// without a per-head transform): each decoded symbol becomes (s - 128) * step + mean, keys are
// rotated, and the result is written in the output dtype straight into the caller's KV tensors.
// With head_dim a multiple of 16, lane k of a half-warp decodes elements d = k, k + 16, ... of
// every head vector, so the rotary pair (d, d + head_dim / 2) of a key is the same lane's, two
// or more rounds apart: the lower half waits in a per-lane buffer for its partner.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kv_core.h"
#include "rans_core.h"

// Keys need head_dim / 32 buffered lower-half elements per lane: head dims up to this many.
#define CG_KV_MAX_DIM 256

#define CG_FULL_MASK 0xffffffffu

__global__ void cg_decode_kernel(const uint8_t* __restrict__ in, const int64_t* __restrict__ in_off,
                                 int32_t n_streams, const int64_t* __restrict__ sym_off,
                                 const int32_t* __restrict__ table_ids, int32_t period,
                                 const uint32_t* __restrict__ info, const uint8_t* __restrict__ lut,
                                 int32_t lut_bits, int32_t alphabet, const int32_t* __restrict__ order,
                                 uint8_t* __restrict__ out, int32_t* __restrict__ status) {
    const int64_t half_id = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / CG_LANES;
    const int k = threadIdx.x % CG_LANES;
    const int half_shift = (threadIdx.x % 32) & ~(CG_LANES - 1);  // 0 or 16: this half's bits in a ballot
    const bool has = half_id < n_streams;
    const int32_t s = has ? order[half_id] : 0;
    const int64_t len = has ? in_off[s + 1] - in_off[s] : 0;
    const int64_t n = has ? sym_off[s + 1] - sym_off[s] : 0;
    const uint8_t* src = in + (has ? in_off[s] : 0);
    uint8_t* dst = out + (has ? sym_off[s] : 0);
    const int32_t* tids = table_ids + (int64_t)s * period;
    const uint32_t shift = CG_PREC - (uint32_t)lut_bits;
    const uint32_t last = (uint32_t)alphabet - 1;

    int err = CG_OK;
    bool live = has && n > 0 && len >= CG_STATE_BYTES;
    if (has && n == 0 && len != 0) err = CG_ERR_TRAILING;
    if (has && n > 0 && len < CG_STATE_BYTES) err = CG_ERR_SHORT;
    uint32_t x = live ? cg_load_u32(src + 4 * k) : CG_RANS_L;
    const unsigned bad_state = (__ballot_sync(CG_FULL_MASK, live && x < CG_RANS_L) >> half_shift) & 0xffffu;
    if (live && bad_state) {
        err = CG_ERR_STATE;
        live = false;
    }
    const bool started = live;
    int64_t pos = CG_STATE_BYTES, j = k;  // j: this lane's symbol in the current round
    int32_t tk = k % period;              // table index of symbol j
    int64_t id = live ? __ldg(tids + tk) : 0;  // its table, loaded a round ahead
    while (__any_sync(CG_FULL_MASK, live)) {
        bool need = false;
        if (live && j < n) {
            const uint32_t sym = cg_dec_step(&x, info + id * alphabet, lut + (id << lut_bits), shift, last);
            dst[j] = (uint8_t)sym;
            need = x < CG_RANS_L;
        }
        tk += CG_LANES;
        if (tk >= period) tk = tk - period < period ? tk - period : tk % period;
        if (live && j + CG_LANES < n) id = __ldg(tids + tk);
        const unsigned words = (__ballot_sync(CG_FULL_MASK, need) >> half_shift) & 0xffffu;
        if (live) {
            const int64_t mine = pos + 2 * __popc(words & ((1u << k) - 1));
            pos += 2 * __popc(words);
            if (pos > len) {  // pos is the same in every thread of the half: it stops as a whole
                err = CG_ERR_SHORT;
                live = false;
            } else {
                if (need) x = (x << 16) | cg_load_u16(src + mine);
                j += CG_LANES;
                live = j - k < n;
            }
        }
    }
    const unsigned not_final = (__ballot_sync(CG_FULL_MASK, x != CG_RANS_L) >> half_shift) & 0xffffu;
    if (started && err == CG_OK) {
        if (pos != len) err = CG_ERR_TRAILING;
        else if (not_final) err = CG_ERR_FINAL;
    }
    if (has && k == 0) status[s] = err;
}

__device__ __forceinline__ void cg_store_kv(void* base, int64_t at, float y, int32_t dtype) {
    if (dtype == CG_OUT_F32) ((float*)base)[at] = y;
    else if (dtype == CG_OUT_BF16) ((uint16_t*)base)[at] = cg_bf16_bits(y);
    else ((__half*)base)[at] = __float2half_rn(y);
}

struct CgKvArgs {
    int32_t layers, heads, head_dim, min_symbol, out_dtype;
    const float *steps, *means, *cos, *sin;  // steps, means: one per position in the period; cos, sin: (tokens, head_dim) or null
    void *out_keys, *out_values;
    int64_t stride_layer, stride_head, stride_token, first_token;
};

__global__ void cg_decode_kv_kernel(const uint8_t* __restrict__ in, const int64_t* __restrict__ in_off, int32_t n_streams,
                                    const int64_t* __restrict__ sym_off, const int32_t* __restrict__ table_ids,
                                    int32_t period, const uint32_t* __restrict__ info, const uint8_t* __restrict__ lut,
                                    int32_t lut_bits, int32_t alphabet, const int32_t* __restrict__ order, CgKvArgs a,
                                    int32_t* __restrict__ status) {
    const int64_t half_id = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / CG_LANES;
    const int k = threadIdx.x % CG_LANES;
    const int half_shift = (threadIdx.x % 32) & ~(CG_LANES - 1);
    const bool has = half_id < n_streams;
    const int32_t s = has ? order[half_id] : 0;
    const int64_t len = has ? in_off[s + 1] - in_off[s] : 0;
    const int64_t n = has ? sym_off[s + 1] - sym_off[s] : 0;
    const uint8_t* src = in + (has ? in_off[s] : 0);
    const int32_t* tids = table_ids + (int64_t)s * period;
    const uint32_t shift = CG_PREC - (uint32_t)lut_bits;
    const uint32_t last = (uint32_t)alphabet - 1;
    const int32_t dim = a.head_dim, half = dim / 2, vectors_per_kind = a.layers * a.heads;
    const bool rotary = a.cos != nullptr;
    float lower[CG_KV_MAX_DIM / 32];  // this lane's lower-half key elements of the current head vector

    int err = CG_OK;
    bool live = has && n > 0 && len >= CG_STATE_BYTES, bad_symbol = false;
    if (has && n == 0 && len != 0) err = CG_ERR_TRAILING;
    if (has && n > 0 && len < CG_STATE_BYTES) err = CG_ERR_SHORT;
    uint32_t x = live ? cg_load_u32(src + 4 * k) : CG_RANS_L;
    const unsigned bad_state = (__ballot_sync(CG_FULL_MASK, live && x < CG_RANS_L) >> half_shift) & 0xffffu;
    if (live && bad_state) {
        err = CG_ERR_STATE;
        live = false;
    }
    const bool started = live;
    int64_t pos = CG_STATE_BYTES, j = k;
    int32_t tk = k;  // position in the period of symbol j (period is a multiple of CG_LANES)
    int64_t token = has ? sym_off[s] / period : 0;  // coded token of symbol j
    int64_t id = live ? __ldg(tids + tk) : 0;
    while (__any_sync(CG_FULL_MASK, live)) {
        bool need = false;
        if (live && j < n) {
            const uint32_t sym = cg_dec_step(&x, info + id * alphabet, lut + (id << lut_bits), shift, last);
            need = x < CG_RANS_L;
            bad_symbol |= (int32_t)sym < a.min_symbol;
            const float v = cg_dequant(sym, __ldg(a.steps + tk)) + __ldg(a.means + tk);
            const int32_t vec = tk / dim, d = tk - vec * dim, kind = vec / vectors_per_kind;
            const int32_t layer = (vec / a.heads) % a.layers, head = vec % a.heads;
            const int64_t row = layer * a.stride_layer + head * a.stride_head + (a.first_token + token) * a.stride_token;
            if (kind == 1 || !rotary) {
                cg_store_kv(kind ? a.out_values : a.out_keys, row + d, v, a.out_dtype);
            } else if (d < half) {
                lower[d / CG_LANES] = v;
            } else {
                const int32_t dl = d - half;
                const float* c = a.cos + token * dim;
                const float* sn = a.sin + token * dim;
                float y_lo, y_hi;
                cg_rotate_pair(lower[dl / CG_LANES], v, __ldg(c + dl), __ldg(sn + dl), __ldg(c + d), __ldg(sn + d), &y_lo, &y_hi);
                cg_store_kv(a.out_keys, row + dl, y_lo, a.out_dtype);
                cg_store_kv(a.out_keys, row + d, y_hi, a.out_dtype);
            }
        }
        tk += CG_LANES;
        if (tk >= period) {
            tk -= period;
            ++token;
        }
        if (live && j + CG_LANES < n) id = __ldg(tids + tk);
        const unsigned words = (__ballot_sync(CG_FULL_MASK, need) >> half_shift) & 0xffffu;
        if (live) {
            const int64_t mine = pos + 2 * __popc(words & ((1u << k) - 1));
            pos += 2 * __popc(words);
            if (pos > len) {
                err = CG_ERR_SHORT;
                live = false;
            } else {
                if (need) x = (x << 16) | cg_load_u16(src + mine);
                j += CG_LANES;
                live = j - k < n;
            }
        }
    }
    const unsigned not_final = (__ballot_sync(CG_FULL_MASK, x != CG_RANS_L) >> half_shift) & 0xffffu;
    const unsigned any_bad = (__ballot_sync(CG_FULL_MASK, bad_symbol) >> half_shift) & 0xffffu;
    if (started && err == CG_OK) {
        if (pos != len) err = CG_ERR_TRAILING;
        else if (not_final) err = CG_ERR_FINAL;
        else if (any_bad) err = CG_ERR_SYMBOL;
    }
    if (has && k == 0) status[s] = err;
}

// Launch the decoder on `stream` (a cudaStream_t); every pointer is a device pointer.
// Returns the launch's cudaError_t (0 on success); per-substream results land in status.
extern "C" int cg_cuda_decode(const uint8_t* in, const int64_t* in_off, int32_t n_streams, const int64_t* sym_off,
                              const int32_t* table_ids, int32_t period, const uint32_t* info, const uint8_t* lut,
                              int32_t lut_bits, int32_t alphabet, const int32_t* order, uint8_t* out,
                              int32_t* status, void* stream, int32_t threads_per_block) {
    if (n_streams <= 0) return 0;
    if (period < 1 || lut_bits < 1 || lut_bits > 16 || alphabet < 2 || alphabet > 256) return (int)cudaErrorInvalidValue;
    const int threads = threads_per_block > 0 ? ((threads_per_block + 31) / 32) * 32 : 64;
    const int64_t total = (int64_t)n_streams * CG_LANES;
    const unsigned blocks = (unsigned)((total + threads - 1) / threads);
    cg_decode_kernel<<<blocks, threads, 0, (cudaStream_t)stream>>>(in, in_off, n_streams, sym_off, table_ids, period,
                                                                   info, lut, lut_bits, alphabet, order, out, status);
    return (int)cudaGetLastError();
}

// Launch the fused KV decoder (arguments as cg_cuda_decode, then kv_core.h's parameters as in the CPU
// library's cg_decode_kv, all device pointers). head_dim must be a multiple of CG_LANES, and of
// 2 * CG_LANES (at most CG_KV_MAX_DIM) when cos is given; else cudaErrorInvalidValue.
extern "C" int cg_cuda_decode_kv(const uint8_t* in, const int64_t* in_off, int32_t n_streams, const int64_t* sym_off,
                                 const int32_t* table_ids, int32_t period, const uint32_t* info, const uint8_t* lut,
                                 int32_t lut_bits, int32_t alphabet, const int32_t* order, int32_t layers, int32_t heads,
                                 int32_t head_dim, int32_t min_symbol, const float* steps, const float* means,
                                 const float* cos, const float* sin, void* out_keys, void* out_values, int32_t out_dtype,
                                 int64_t stride_layer, int64_t stride_head, int64_t stride_token, int64_t first_token,
                                 int32_t* status, void* stream, int32_t threads_per_block) {
    if (n_streams <= 0) return 0;
    if (lut_bits < 1 || lut_bits > 16 || alphabet < 2 || alphabet > 256 || layers < 1 || heads < 1) return (int)cudaErrorInvalidValue;
    if (head_dim < CG_LANES || head_dim % CG_LANES || (int64_t)period != 2 * (int64_t)layers * heads * head_dim) return (int)cudaErrorInvalidValue;
    if ((cos != nullptr) != (sin != nullptr) || (cos && (head_dim % (2 * CG_LANES) || head_dim > CG_KV_MAX_DIM))) return (int)cudaErrorInvalidValue;
    if (out_dtype < CG_OUT_F32 || out_dtype > CG_OUT_F16 || !out_keys || !out_values) return (int)cudaErrorInvalidValue;
    const CgKvArgs a{layers, heads, head_dim, min_symbol, out_dtype, steps, means, cos, sin, out_keys, out_values,
                     stride_layer, stride_head, stride_token, first_token};
    const int threads = threads_per_block > 0 ? ((threads_per_block + 31) / 32) * 32 : 64;
    const int64_t total = (int64_t)n_streams * CG_LANES;
    const unsigned blocks = (unsigned)((total + threads - 1) / threads);
    cg_decode_kv_kernel<<<blocks, threads, 0, (cudaStream_t)stream>>>(in, in_off, n_streams, sym_off, table_ids, period, info,
                                                                      lut, lut_bits, alphabet, order, a, status);
    return (int)cudaGetLastError();
}
