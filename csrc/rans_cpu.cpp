// Threaded CPU encoder/decoder over many independent substreams (format: rans_core.h).
// Plain C ABI over raw pointers, loaded from Python with ctypes (which releases the GIL).
// Every entry point checks its offsets and table ids before touching memory, so bad
// arguments give CG_ERR_ARGS rather than a crash.
#include "rans_cpu_impl.h"

using namespace cg;

// The library is built with -fvisibility=hidden: only these entry points are exported.
#define CG_EXPORT __attribute__((visibility("default")))

extern "C" {

// Format version of rans_core.h's substreams, and the lanes per substream.
CG_EXPORT int32_t cg_format_version(void) { return 1; }
// Version of the entry points' signatures: a build older than the Python binding is refused, not misread.
CG_EXPORT int32_t cg_api_version(void) { return 2; }
CG_EXPORT int32_t cg_lanes(void) { return CG_LANES; }

// Bytes a substream of n symbols may need at most (one word per symbol plus the states).
CG_EXPORT int64_t cg_encode_bound(int64_t n) { return n <= 0 ? 0 : 2 * n + CG_STATE_BYTES; }

// Fill info (n_tables x alphabet) and lut (n_tables x 2^lut_bits) from freqs; see rans_core.h.
CG_EXPORT int cg_build_tables(const uint32_t* freqs, int32_t n_tables, int32_t alphabet, int32_t lut_bits, uint32_t* info,
                    uint8_t* lut) {
    return cg_build_tables_impl(freqs, n_tables, alphabet, lut_bits, info, lut);
}

// Encode every substream s (symbols[sym_offsets[s]:sym_offsets[s+1]], tables
// table_ids[s*period:(s+1)*period]) into out[out_offsets[s]:out_offsets[s+1]], each of
// capacity >= cg_encode_bound(count); out_sizes[s] gets the bytes used.
CG_EXPORT int cg_encode(const uint8_t* symbols, const int64_t* sym_offsets, int32_t n_streams, const int32_t* table_ids,
              int32_t period, const uint32_t* info, int32_t n_tables, int32_t alphabet, uint8_t* out,
              const int64_t* out_offsets, int64_t* out_sizes, int32_t n_threads) {
    if (n_streams < 0 || period < 1 || alphabet < 2 || alphabet > 256 || n_tables < 1) return CG_ERR_ARGS;
    if (!valid_offsets(sym_offsets, n_streams) || !valid_offsets(out_offsets, n_streams)) return CG_ERR_ARGS;
    if (!valid_table_ids(table_ids, (int64_t)n_streams * period, n_tables)) return CG_ERR_ARGS;
    const Tables T{info, nullptr, alphabet, 0};
    return guarded([&] { return for_each_stream(n_streams, sym_offsets[n_streams], n_threads, [&](int32_t s) {
        thread_local std::vector<int32_t> ext;
        extend_ids(table_ids + (int64_t)s * period, period, ext);
        return encode_stream(symbols + sym_offsets[s], sym_offsets[s + 1] - sym_offsets[s], ext.data(), period, T,
                             out + out_offsets[s], out_offsets[s + 1] - out_offsets[s], out_sizes + s);
    }); });
}

// Decode every substream s (in[in_offsets[s]:in_offsets[s+1]]) into out[sym_offsets[s]:...];
// status[s] gets each stream's result; returns the first error (0 when all decoded).
CG_EXPORT int cg_decode(const uint8_t* in, const int64_t* in_offsets, int32_t n_streams, const int64_t* sym_offsets,
              const int32_t* table_ids, int32_t period, const uint32_t* info, const uint8_t* lut, int32_t lut_bits,
              int32_t n_tables, int32_t alphabet, uint8_t* out, int32_t* status, int32_t n_threads) {
    if (n_streams < 0 || period < 1 || alphabet < 2 || alphabet > 256 || n_tables < 1) return CG_ERR_ARGS;
    if (lut_bits < 1 || lut_bits > 16) return CG_ERR_ARGS;
    if (!valid_offsets(sym_offsets, n_streams) || !valid_offsets(in_offsets, n_streams)) return CG_ERR_ARGS;
    if (!valid_table_ids(table_ids, (int64_t)n_streams * period, n_tables)) return CG_ERR_ARGS;
    const Tables T{info, lut, alphabet, lut_bits};
    return guarded([&] { return for_each_stream(n_streams, sym_offsets[n_streams], n_threads, [&](int32_t s) {
        thread_local std::vector<int32_t> ext;
        extend_ids(table_ids + (int64_t)s * period, period, ext);
        status[s] = decode_stream(in + in_offsets[s], in_offsets[s + 1] - in_offsets[s], sym_offsets[s + 1] - sym_offsets[s],
                                  ext.data(), period, T, out + sym_offsets[s]);
        return (int)status[s];
    }); });
}

}  // extern "C"
