// CUDA decoder for the interleaved-rANS substreams of rans_core.h (same bytes, same symbols
// as the CPU decoder). Each half-warp decodes one substream: thread k of the half runs
// lane k, decoding symbols j = k, k + CG_LANES, ... Within a round the lanes that
// must renormalise read consecutive u16 words in lane order (ballot + popc), exactly as the
// serial CPU decoder does. Substreams are taken in the order given by `order` (the host
// sorts them longest first, so the two halves of a warp get similar lengths).
// Tables (info, lut) are read through the read-only cache. Every payload read is checked
// against the substream's length, so bad input yields a status code, never a bad access.
#include <cuda_runtime.h>
#include <stdint.h>

#include "rans_core.h"

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
