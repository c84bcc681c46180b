// Fused decoding of a KV chunk: the rANS substreams of each (kind, layer) decoded and dequantised
// in one pass, the values written straight into the caller's KV tensor in its dtype. Threaded over
// (kind, layer) tasks; within a task the anchor substreams go first (their values are the base of
// every delta). The arithmetic is the reference dequantiser's, operation for operation, in float32
// (this file is built with -ffp-contract=off, so no fused multiply-add changes a rounding):
//     anchor value = anchor_min + (symbol - anchor_offset) * anchor_step
//     delta value  = (value of its group's anchor) + (symbol - 128) * delta_step
// then rounded to the output dtype (round to nearest even). Parameters are per (kind, layer,
// channel); the caller has checked they are finite, the steps positive, and every value
// representable in the output dtype, so no pass over the output is needed.
#include <cmath>

#include "rans_cpu_impl.h"

using namespace cg;

namespace {

enum : int32_t { OUT_F32 = 0, OUT_F16 = 1, OUT_BF16 = 2 };

struct F32 {
    using T = float;
    static inline float put(float x) { return x; }
};
struct F16 {
    using T = uint16_t;
    static inline uint16_t put(float x) {
        const _Float16 h = (_Float16)x;  // IEEE conversion: round to nearest even
        uint16_t u;
        std::memcpy(&u, &h, 2);
        return u;
    }
};
struct BF16 {
    using T = uint16_t;
    static inline uint16_t put(float x) {  // round to nearest even (finite inputs: checked by the caller)
        uint32_t u;
        std::memcpy(&u, &x, 4);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (uint16_t)(u >> 16);
    }
};

struct Geometry {
    int32_t layers, channels, head_dim, group_size, anchor_offset, min_anchor_symbol;
    int64_t anchors;                         // anchor rows of the chunk (ceil(tokens / group_size))
    int64_t stride_layer, stride_head, stride_token;  // of the output, in elements
};

// One (kind, layer): its substreams (part 0 = anchors first, then part 1 = deltas), rows from first_row.
template <class Out>
int fused_task(int32_t kind, int32_t layer, const std::vector<int32_t>& streams, const int32_t* desc, const uint8_t* in,
               const int64_t* in_off, const int64_t* sym_off, const int32_t* table_ids, int32_t period, const Tables& T,
               const Geometry& G, const float* params, void* out_k, void* out_v, int32_t* status) {
    const int32_t C = G.channels;
    const float* amin = params + ((0 * 2 + kind) * G.layers + layer) * (int64_t)C;
    const float* astep = params + ((1 * 2 + kind) * G.layers + layer) * (int64_t)C;
    const float* dstep = params + ((2 * 2 + kind) * G.layers + layer) * (int64_t)C;
    typename Out::T* out = (typename Out::T*)(kind == 0 ? out_k : out_v) + layer * G.stride_layer;
    thread_local std::vector<float> ahat;
    thread_local std::vector<uint8_t> sym;
    thread_local std::vector<int32_t> ext;
    ahat.resize((size_t)(G.anchors * C));
    const int32_t heads = C / G.head_dim;
    for (int pass = 0; pass < 2; ++pass) {
        for (const int32_t s : streams) {
            if (desc[4 * s + 2] != pass) continue;
            const int64_t n = sym_off[s + 1] - sym_off[s];
            sym.resize((size_t)std::max<int64_t>(n, 1));
            extend_ids(table_ids + (int64_t)s * period, period, ext);
            int e = decode_stream(in + in_off[s], in_off[s + 1] - in_off[s], n, ext.data(), period, T, sym.data());
            status[s] = e;
            if (e != CG_OK) return e;
            const int64_t rows = n / C, first = desc[4 * s + 3];
            for (int64_t r = 0; r < rows; ++r) {
                const uint8_t* q = sym.data() + r * C;
                const int64_t k = first + r;  // the anchor index (pass 0) or delta index (pass 1)
                int64_t token;
                float* base = nullptr;
                if (pass == 0) {
                    if (k >= G.anchors) return status[s] = CG_ERR_ARGS;
                    token = k * G.group_size;
                    base = ahat.data() + k * C;
                    for (int32_t c = 0; c < C; ++c) {
                        if (q[c] < G.min_anchor_symbol) return status[s] = CG_ERR_SYMBOL;
                        base[c] = amin[c] + (float)((int32_t)q[c] - G.anchor_offset) * astep[c];
                    }
                } else {
                    const int64_t g = k / (G.group_size - 1);
                    if (g >= G.anchors) return status[s] = CG_ERR_ARGS;
                    token = g * G.group_size + k % (G.group_size - 1) + 1;
                    base = nullptr;
                    const float* a = ahat.data() + g * C;
                    for (int32_t h = 0; h < heads; ++h) {
                        typename Out::T* dst = out + h * G.stride_head + token * G.stride_token;
                        const int32_t c0 = h * G.head_dim;
                        for (int32_t d = 0; d < G.head_dim; ++d) {
                            const int32_t c = c0 + d;
                            if (q[c] == 0) return status[s] = CG_ERR_SYMBOL;  // outside the delta radius
                            dst[d] = Out::put(a[c] + (float)((int32_t)q[c] - 128) * dstep[c]);
                        }
                    }
                    continue;
                }
                for (int32_t h = 0; h < heads; ++h) {
                    typename Out::T* dst = out + h * G.stride_head + token * G.stride_token;
                    for (int32_t d = 0; d < G.head_dim; ++d) dst[d] = Out::put(base[h * G.head_dim + d]);
                }
            }
        }
    }
    return CG_OK;
}

}  // namespace

#define CG_EXPORT __attribute__((visibility("default")))

extern "C" {

// Decode a chunk's substreams and write the dequantised KV into out_k / out_v (shape (layers,
// C / head_dim, tokens, head_dim) with the given strides, dtype out_dtype: 0 float32, 1 float16,
// 2 bfloat16). desc: per substream (kind, layer, part, first row). params: float32 (3, 2,
// layers, channels) = anchor_min, anchor_step, delta_step. status: per substream result.
CG_EXPORT int cg_decode_kv(const uint8_t* in, const int64_t* in_offsets, int32_t n_streams, const int64_t* sym_offsets,
                           const int32_t* table_ids, int32_t period, const uint32_t* info, const uint8_t* lut,
                           int32_t lut_bits, int32_t n_tables, int32_t alphabet, const int32_t* desc, int32_t layers,
                           int32_t tokens, int32_t channels, int32_t head_dim, int32_t group_size, int32_t anchor_offset,
                           int32_t min_anchor_symbol, const float* params, void* out_k, void* out_v, int32_t out_dtype,
                           int64_t stride_layer, int64_t stride_head, int64_t stride_token, int32_t* status,
                           int32_t n_threads) {
    if (n_streams < 0 || period != channels || alphabet < 2 || alphabet > 256 || n_tables < 1) return CG_ERR_ARGS;
    if (lut_bits < 1 || lut_bits > 16 || layers < 1 || tokens < 1 || channels < 1 || head_dim < 1 ||
        channels % head_dim != 0 || group_size < 2 || out_dtype < 0 || out_dtype > 2)
        return CG_ERR_ARGS;
    if (!valid_offsets(sym_offsets, n_streams) || !valid_offsets(in_offsets, n_streams)) return CG_ERR_ARGS;
    if (!valid_table_ids(table_ids, (int64_t)n_streams * period, n_tables)) return CG_ERR_ARGS;
    const int64_t anchors = (tokens + group_size - 1) / group_size;
    std::vector<std::vector<int32_t>> tasks((size_t)2 * layers);
    for (int32_t s = 0; s < n_streams; ++s) {
        const int32_t kind = desc[4 * s], layer = desc[4 * s + 1], part = desc[4 * s + 2], first = desc[4 * s + 3];
        const int64_t n = sym_offsets[s + 1] - sym_offsets[s];
        if (kind < 0 || kind > 1 || layer < 0 || layer >= layers || part < 0 || part > 1 || first < 0 || n % channels)
            return CG_ERR_ARGS;
        const int64_t rows = n / channels, limit = part == 0 ? anchors : tokens - anchors;
        if (first + rows > limit) return CG_ERR_ARGS;
        tasks[(size_t)kind * layers + layer].push_back(s);
    }
    const Tables T{info, lut, alphabet, lut_bits};
    const Geometry G{layers, channels, head_dim, group_size, anchor_offset, min_anchor_symbol, anchors,
                     stride_layer, stride_head, stride_token};
    for (int32_t s = 0; s < n_streams; ++s) status[s] = CG_OK;
    return guarded([&] {
        return for_each_stream(2 * layers, sym_offsets[n_streams], n_threads, [&](int32_t t) {
            const int32_t kind = t / layers, layer = t % layers;
            switch (out_dtype) {
                case OUT_F32:
                    return fused_task<F32>(kind, layer, tasks[t], desc, in, in_offsets, sym_offsets, table_ids, period, T, G,
                                           params, out_k, out_v, status);
                case OUT_F16:
                    return fused_task<F16>(kind, layer, tasks[t], desc, in, in_offsets, sym_offsets, table_ids, period, T, G,
                                           params, out_k, out_v, status);
                default:
                    return fused_task<BF16>(kind, layer, tasks[t], desc, in, in_offsets, sym_offsets, table_ids, period, T, G,
                                            params, out_k, out_v, status);
            }
        });
    });
}

}  // extern "C"
