// CUDA decoder for the interleaved-rANS substreams of rans_core.h: one warp per substream,
// lane k < CG_LANES decodes symbols j = k, k + CG_LANES, ... Within a round the lanes that
// must renormalise read consecutive u16 words in lane order (ballot + popc), exactly as the
// serial CPU decoder does, so both accept and produce the same bytes and symbols.
// Errors never read out of bounds: every read is checked against the substream's length.
#include <cuda_runtime.h>
#include <stdint.h>

#include "rans_core.h"

__global__ void cg_decode_kernel(const uint8_t* __restrict__ in, const int64_t* __restrict__ in_off, int32_t n_streams,
                                 const int64_t* __restrict__ sym_off, const int32_t* __restrict__ table_ids,
                                 int32_t period, const uint32_t* __restrict__ cdf, uint32_t alphabet,
                                 uint8_t* __restrict__ out, int32_t* __restrict__ status) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= n_streams) return;
    const uint8_t* src = in + in_off[warp];
    const int64_t len = in_off[warp + 1] - in_off[warp];
    const int64_t n = sym_off[warp + 1] - sym_off[warp];
    uint8_t* dst = out + sym_off[warp];
    const int32_t* tids = table_ids + (int64_t)warp * period;
    const unsigned lanes_mask = (1u << CG_LANES) - 1;
    int err = CG_OK;
    if (n == 0) {
        if (lane == 0) status[warp] = len == 0 ? CG_OK : CG_ERR_TRAILING;
        return;
    }
    if (len < 4 * CG_LANES) {
        if (lane == 0) status[warp] = CG_ERR_SHORT;
        return;
    }
    const bool active = lane < CG_LANES;
    uint32_t x = active ? cg_load_u32(src + 4 * lane) : CG_RANS_L;
    if (__any_sync(0xffffffffu, active && x < CG_RANS_L)) {
        if (lane == 0) status[warp] = CG_ERR_STATE;
        return;
    }
    int64_t pos = 4 * CG_LANES;
    const int64_t stride = alphabet + 1;
    for (int64_t base = 0; base < n; base += CG_LANES) {
        const int64_t j = base + lane;
        const bool mine = active && j < n;
        bool need = false;
        if (mine) {
            const uint32_t* c = cdf + (int64_t)__ldg(tids + (j % period)) * stride;
            dst[j] = (uint8_t)cg_dec_get(&x, c, alphabet);
            need = x < CG_RANS_L;
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, need) & lanes_mask;
        const int64_t my = pos + 2 * __popc(ballot & ((1u << lane) - 1));
        pos += 2 * __popc(ballot);
        if (pos > len) {
            err = CG_ERR_SHORT;
            break;  // uniform across the warp: pos is the same in every lane
        }
        if (need) x = (x << 16) | cg_load_u16(src + my);
    }
    if (err == CG_OK && pos != len) err = CG_ERR_TRAILING;
    if (err == CG_OK && __any_sync(0xffffffffu, active && x != CG_RANS_L)) err = CG_ERR_FINAL;
    if (lane == 0) status[warp] = err;
}

extern "C" int cg_cuda_decode(const uint8_t* in, const int64_t* in_off, int32_t n_streams, const int64_t* sym_off,
                              const int32_t* table_ids, int32_t period, const uint32_t* cdf, uint32_t alphabet,
                              uint8_t* out, int32_t* status, void* stream) {
    if (n_streams <= 0) return 0;
    const int threads = 128;  // 4 warps per block
    const int blocks = (n_streams * 32 + threads - 1) / threads;
    cg_decode_kernel<<<blocks, threads, 0, (cudaStream_t)stream>>>(in, in_off, n_streams, sym_off, table_ids, period,
                                                                   cdf, alphabet, out, status);
    return (int)cudaGetLastError();
}
