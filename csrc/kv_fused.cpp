// Fused decoding of a v2 KV chunk: every rANS substream (a block of tokens holding all kinds,
// layers and components) decoded and dequantised in one pass by one thread, the components
// written as float32 into the caller's buffer of shape (2, layers, heads, tokens, head_dim).
// The arithmetic is the reference dequantiser's: value = (float)(symbol - 128) * step (one
// rounding; this file is built with -ffp-contract=off), so the result is bit-identical to the
// torch path. The per-head synthesis, mean, rotary embedding and output dtype are left to torch.
#include "rans_cpu_impl.h"

using namespace cg;

#define CG_EXPORT __attribute__((visibility("default")))

extern "C" {

// Decode substream s (in[in_offsets[s]:in_offsets[s+1]], symbols sym_offsets[s].. in token-major
// order, period = 2 * layers * heads * head_dim symbols per token, coded tokens from
// sym_offsets[s] / period) and write (symbol - 128) * steps[j] (j: position in the period) into
// out[j / head_dim][token][j % head_dim] with out of shape (2 * layers * heads, tokens,
// head_dim). A symbol below min_symbol is CG_ERR_SYMBOL. status: per substream result.
CG_EXPORT int cg_decode_components(const uint8_t* in, const int64_t* in_offsets, int32_t n_streams,
                                   const int64_t* sym_offsets, const int32_t* table_ids, int32_t period,
                                   const uint32_t* info, const uint8_t* lut, int32_t lut_bits, int32_t n_tables,
                                   int32_t alphabet, int32_t head_dim, int64_t tokens, int32_t min_symbol,
                                   const float* steps, float* out, int32_t* status, int32_t n_threads) {
    if (n_streams < 0 || period < 1 || alphabet < 2 || alphabet > 256 || n_tables < 1) return CG_ERR_ARGS;
    if (lut_bits < 1 || lut_bits > 16 || head_dim < 1 || period % head_dim != 0 || tokens < 0) return CG_ERR_ARGS;
    if (!valid_offsets(sym_offsets, n_streams) || !valid_offsets(in_offsets, n_streams)) return CG_ERR_ARGS;
    if (sym_offsets[n_streams] != tokens * period) return CG_ERR_ARGS;
    for (int32_t s = 0; s < n_streams; ++s)
        if (sym_offsets[s] % period) return CG_ERR_ARGS;
    if (!valid_table_ids(table_ids, (int64_t)n_streams * period, n_tables)) return CG_ERR_ARGS;
    const Tables T{info, lut, alphabet, lut_bits};
    for (int32_t s = 0; s < n_streams; ++s) status[s] = CG_OK;
    return guarded([&] { return for_each_stream(n_streams, sym_offsets[n_streams], n_threads, [&](int32_t s) {
        thread_local std::vector<int32_t> ext;
        thread_local std::vector<uint8_t> sym;
        const int64_t n = sym_offsets[s + 1] - sym_offsets[s];
        sym.resize((size_t)std::max<int64_t>(n, 1));
        extend_ids(table_ids + (int64_t)s * period, period, ext);
        int e = decode_stream(in + in_offsets[s], in_offsets[s + 1] - in_offsets[s], n, ext.data(), period, T, sym.data());
        status[s] = e;
        if (e != CG_OK) return e;
        const int64_t first = sym_offsets[s] / period, rows = n / period, row_stride = tokens * head_dim;
        const int32_t vectors = period / head_dim;
        for (int64_t r = 0; r < rows; ++r) {
            const uint8_t* q = sym.data() + r * period;
            float* dst = out + (first + r) * head_dim;
            for (int32_t v = 0; v < vectors; ++v, q += head_dim, dst += row_stride) {
                const float* st = steps + (int64_t)v * head_dim;
                for (int32_t d = 0; d < head_dim; ++d) {
                    if (q[d] < min_symbol) return (int)(status[s] = CG_ERR_SYMBOL);
                    dst[d] = (float)((int32_t)q[d] - 128) * st[d];
                }
            }
        }
        return (int)CG_OK;
    }); });
}

}  // extern "C"
