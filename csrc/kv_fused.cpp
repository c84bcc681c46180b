// Fused decoding of a v2 KV chunk: every rANS substream (a block of tokens holding all kinds,
// layers and components) decoded and dequantised in one pass by one thread, the components
// written as float32 into the caller's buffer of shape (2, layers, heads, tokens, head_dim).
// The arithmetic is the reference dequantiser's: value = (float)(symbol - 128) * step (one
// rounding; this file is built with -ffp-contract=off), so the result is bit-identical to the
// torch path. The per-head synthesis, mean, rotary embedding and output dtype are left to torch.
// cg_decode_kv goes all the way for a codec without a per-head transform: the mean, the rotary
// embedding and the output dtype too (kv_core.h), written straight into the caller's KV tensors.
#include "kv_core.h"
#include "rans_cpu_impl.h"

using namespace cg;

#define CG_EXPORT __attribute__((visibility("default")))

// Substreams of whole tokens: valid offsets, `tokens` tokens of `period` symbols in all, each
// substream starting at a token, table ids in range. Checked before any memory is touched.
static bool valid_token_streams(const int64_t* in_offsets, const int64_t* sym_offsets, int32_t n_streams,
                                const int32_t* table_ids, int32_t period, int32_t n_tables, int64_t tokens) {
    if (!valid_offsets(sym_offsets, n_streams) || !valid_offsets(in_offsets, n_streams)) return false;
    if (sym_offsets[n_streams] != tokens * period) return false;
    for (int32_t s = 0; s < n_streams; ++s)
        if (sym_offsets[s] % period) return false;
    return valid_table_ids(table_ids, (int64_t)n_streams * period, n_tables);
}

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
    if (!valid_token_streams(in_offsets, sym_offsets, n_streams, table_ids, period, n_tables, tokens)) return CG_ERR_ARGS;
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

// Decode every substream (arguments as cg_decode_components) and write the finished KV of its
// tokens: for vector v = (kind * layers + layer) * heads + head of token t, element d is
// kv_core.h's reconstruction with steps[v * head_dim + d] and means[v * head_dim + d], keys
// (kind 0) rotated with cos/sin[t * head_dim + d] unless cos is null, stored as out_dtype
// (CG_OUT_*) at out[kind] + layer * stride_layer + head * stride_head + (first_token + t) *
// stride_token + d (strides in elements). A symbol below min_symbol is CG_ERR_SYMBOL.
CG_EXPORT int cg_decode_kv(const uint8_t* in, const int64_t* in_offsets, int32_t n_streams, const int64_t* sym_offsets,
                           const int32_t* table_ids, int32_t period, const uint32_t* info, const uint8_t* lut,
                           int32_t lut_bits, int32_t n_tables, int32_t alphabet, int32_t layers, int32_t heads,
                           int32_t head_dim, int64_t tokens, int32_t min_symbol, const float* steps, const float* means,
                           const float* cos, const float* sin, void* out_keys, void* out_values, int32_t out_dtype,
                           int64_t stride_layer, int64_t stride_head, int64_t stride_token, int64_t first_token,
                           int32_t* status, int32_t n_threads) {
    if (n_streams < 0 || alphabet < 2 || alphabet > 256 || n_tables < 1 || lut_bits < 1 || lut_bits > 16) return CG_ERR_ARGS;
    if (layers < 1 || heads < 1 || head_dim < 1 || tokens < 0 || first_token < 0) return CG_ERR_ARGS;
    if (cos && head_dim % 2) return CG_ERR_ARGS;  // rotate_half pairs the two halves of a head
    if ((int64_t)period != 2 * (int64_t)layers * heads * head_dim) return CG_ERR_ARGS;
    if (out_dtype < CG_OUT_F32 || out_dtype > CG_OUT_F16 || !out_keys || !out_values || (cos == nullptr) != (sin == nullptr))
        return CG_ERR_ARGS;
    if (!valid_token_streams(in_offsets, sym_offsets, n_streams, table_ids, period, n_tables, tokens)) return CG_ERR_ARGS;
    const Tables T{info, lut, alphabet, lut_bits};
    const int32_t half = head_dim / 2;
    const size_t esize = out_dtype == CG_OUT_F32 ? 4 : 2;
    uint8_t* const out[2] = {(uint8_t*)out_keys, (uint8_t*)out_values};
    for (int32_t s = 0; s < n_streams; ++s) status[s] = CG_OK;
    return guarded([&] { return for_each_stream(n_streams, sym_offsets[n_streams], n_threads, [&](int32_t s) {
        thread_local std::vector<int32_t> ext;
        thread_local std::vector<uint8_t> sym;
        thread_local std::vector<float> x, y;
        const int64_t n = sym_offsets[s + 1] - sym_offsets[s];
        sym.resize((size_t)std::max<int64_t>(n, 1));
        x.resize((size_t)head_dim);
        y.resize((size_t)head_dim);
        extend_ids(table_ids + (int64_t)s * period, period, ext);
        int e = decode_stream(in + in_offsets[s], in_offsets[s + 1] - in_offsets[s], n, ext.data(), period, T, sym.data());
        status[s] = e;
        if (e != CG_OK) return e;
        const int64_t first = sym_offsets[s] / period, rows = n / period;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = first + r;
            const uint8_t* q = sym.data() + r * period;
            for (int32_t v = 0; v < period / head_dim; ++v, q += head_dim) {
                const int32_t kind = v / (layers * heads), layer = (v / heads) % layers, head = v % heads;
                const float* st = steps + (int64_t)v * head_dim;
                const float* mu = means + (int64_t)v * head_dim;
                uint8_t bad = 0;
                for (int32_t d = 0; d < head_dim; ++d) {
                    bad |= (uint8_t)(q[d] < min_symbol);
                    x[d] = cg_dequant(q[d], st[d]) + mu[d];
                }
                if (bad) return (int)(status[s] = CG_ERR_SYMBOL);
                const float* src = x.data();
                if (kind == 0 && cos) {
                    const float *c = cos + t * head_dim, *sn = sin + t * head_dim;
                    for (int32_t d = 0; d < half; ++d)
                        cg_rotate_pair(x[d], x[d + half], c[d], sn[d], c[d + half], sn[d + half], &y[d], &y[d + half]);
                    src = y.data();
                }
                uint8_t* dst = out[kind] + (layer * stride_layer + head * stride_head + (first_token + t) * stride_token) * (int64_t)esize;
                if (out_dtype == CG_OUT_F32) {
                    memcpy(dst, src, (size_t)head_dim * 4);
                } else if (out_dtype == CG_OUT_BF16) {
                    uint16_t* o = (uint16_t*)dst;
                    for (int32_t d = 0; d < head_dim; ++d) o[d] = cg_bf16_bits(src[d]);
                } else {
                    _Float16* o = (_Float16*)dst;
                    for (int32_t d = 0; d < head_dim; ++d) o[d] = (_Float16)src[d];
                }
            }
        }
        return (int)CG_OK;
    }); });
}

}  // extern "C"
