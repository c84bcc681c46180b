// Threaded CPU encoder/decoder over many independent substreams (format: rans_core.h).
// Plain C ABI over raw pointers, loaded from Python with ctypes (which releases the GIL).
// Every entry point checks its offsets and table ids before touching memory, so bad
// arguments give CG_ERR_ARGS rather than a crash.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "rans_core.h"

namespace {

struct Tables {
    const uint32_t* info;  // n_tables x alphabet
    const uint8_t* lut;    // n_tables x 2^lut_bits (decoder only)
    int32_t alphabet;
    int32_t lut_bits;
};

// No C++ exception may cross the C ABI or leave a thread: report it as an error code.
template <class F>
int guarded(F&& f) {
    try {
        return f();
    } catch (...) {
        return CG_ERR_INTERNAL;
    }
}

// Run work(s) for every stream s on up to n_threads threads, streams handed out one at a
// time (they differ a lot in size). Returns the first error any call reported.
template <class F>
int for_each_stream(int32_t n_streams, int64_t total_symbols, int32_t n_threads, F&& work) {
    n_threads = std::max(1, std::min(n_threads, n_streams));
    if (total_symbols < (1 << 16)) n_threads = 1;  // not worth a thread
    std::atomic<int32_t> next{0};
    std::atomic<int> err{CG_OK};
    auto loop = [&] {
        for (int32_t s; (s = next.fetch_add(1, std::memory_order_relaxed)) < n_streams;) {
            const int e = guarded([&] { return work(s); });
            int expected = CG_OK;
            if (e != CG_OK) err.compare_exchange_strong(expected, e);
        }
    };
    std::vector<std::thread> pool;
    try {
        pool.reserve((size_t)n_threads - 1);
        for (int32_t t = 1; t < n_threads; ++t) pool.emplace_back(loop);
    } catch (...) {  // fewer threads than asked: the ones running (and this one) do all the work
    }
    loop();
    for (auto& th : pool) th.join();
    return err.load();
}

bool valid_offsets(const int64_t* off, int32_t n) {
    if (off[0] != 0) return false;
    for (int32_t s = 0; s < n; ++s)
        if (off[s + 1] < off[s]) return false;
    return true;
}

bool valid_table_ids(const int32_t* ids, int64_t count, int32_t n_tables) {
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= n_tables) return false;
    return true;
}

// Table ids of one stream repeated to period + CG_LANES entries, so that lane k of the
// round starting at table index t uses ext[t + k] without a wrap-around test.
void extend_ids(const int32_t* ids, int32_t period, std::vector<int32_t>& ext) {
    ext.resize((size_t)period + CG_LANES);
    for (int32_t i = 0; i < period + CG_LANES; ++i) ext[i] = ids[i % period];
}

inline int32_t advance(int32_t t, int32_t period) {
    t += CG_LANES;
    return t >= period ? t % period : t;
}

int decode_stream(const uint8_t* in, int64_t len, int64_t n, const int32_t* ids, int32_t period, const Tables& T,
                  uint8_t* out) {
    if (n == 0) return len == 0 ? CG_OK : CG_ERR_TRAILING;
    if (len < CG_STATE_BYTES) return CG_ERR_SHORT;
    uint32_t x[CG_LANES];
    for (int k = 0; k < CG_LANES; ++k) {
        x[k] = cg_load_u32(in + 4 * k);
        if (x[k] < CG_RANS_L) return CG_ERR_STATE;
    }
    const uint8_t* pos = in + CG_STATE_BYTES;
    const uint8_t* const end = in + len;
    const uint32_t shift = CG_PREC - (uint32_t)T.lut_bits;
    const uint32_t last = (uint32_t)T.alphabet - 1;
    int32_t t = 0;
    int64_t j = 0;
    for (; j + CG_LANES <= n; j += CG_LANES) {
#pragma GCC unroll 16
        for (int k = 0; k < CG_LANES; ++k) {
            const int64_t id = ids[t + k];
            out[j + k] = (uint8_t)cg_dec_step(&x[k], T.info + id * T.alphabet, T.lut + (id << T.lut_bits), shift, last);
        }
        if (end - pos >= 2 * CG_LANES) {  // room for every lane: branch-free renormalisation
#pragma GCC unroll 16
            for (int k = 0; k < CG_LANES; ++k) {
                const uint32_t w = cg_load_u16(pos);
                const bool need = x[k] < CG_RANS_L;
                x[k] = need ? (x[k] << 16) | w : x[k];
                pos += need ? 2 : 0;
            }
        } else {
            for (int k = 0; k < CG_LANES; ++k) {
                if (x[k] < CG_RANS_L) {
                    if (end - pos < 2) return CG_ERR_SHORT;
                    x[k] = (x[k] << 16) | cg_load_u16(pos);
                    pos += 2;
                }
            }
        }
        t = advance(t, period);
    }
    const int rest = (int)(n - j);
    for (int k = 0; k < rest; ++k) {
        const int64_t id = ids[t + k];
        out[j + k] = (uint8_t)cg_dec_step(&x[k], T.info + id * T.alphabet, T.lut + (id << T.lut_bits), shift, last);
    }
    for (int k = 0; k < rest; ++k) {
        if (x[k] < CG_RANS_L) {
            if (end - pos < 2) return CG_ERR_SHORT;
            x[k] = (x[k] << 16) | cg_load_u16(pos);
            pos += 2;
        }
    }
    if (pos != end) return CG_ERR_TRAILING;
    for (int k = 0; k < CG_LANES; ++k)
        if (x[k] != CG_RANS_L) return CG_ERR_FINAL;
    return CG_OK;
}

// One encoder step of lane state x for symbol s under table row `row`; writes at most one
// word just below *ptr. The caller guarantees 2 bytes of room below *ptr.
inline void enc_put(uint32_t& x, uint8_t*& ptr, const uint32_t* row, uint32_t s, uint32_t alphabet, uint32_t& bad) {
    bad |= s >= alphabet ? 1u : 0u;
    const uint32_t e = row[s < alphabet ? s : 0];
    const bool need = x >= cg_enc_limit(e);
    cg_store_u16(ptr - 2, x);  // harmless when not needed: below *ptr, overwritten later
    ptr -= need ? 2 : 0;
    x = need ? x >> 16 : x;
    cg_enc_step(&x, e);
}

// Encode n symbols into region[0, cap) (cap >= cg_encode_bound(n)); *size gets the length.
int encode_stream(const uint8_t* sym, int64_t n, const int32_t* ids, int32_t period, const Tables& T, uint8_t* region,
                  int64_t cap, int64_t* size) {
    *size = 0;
    if (n == 0) return CG_OK;
    if (cap < 2 * n + CG_STATE_BYTES) return CG_ERR_CAPACITY;
    uint32_t x[CG_LANES];
    for (int k = 0; k < CG_LANES; ++k) x[k] = CG_RANS_L;
    uint8_t* ptr = region + cap;
    const uint32_t alphabet = (uint32_t)T.alphabet;
    uint32_t bad = 0;
    const int64_t full = n / CG_LANES;
    int32_t t = (int32_t)((full * CG_LANES) % period);  // table index of the first symbol of round `full`
    for (int k = (int)(n - full * CG_LANES) - 1; k >= 0; --k)
        enc_put(x[k], ptr, T.info + (int64_t)ids[t + k] * alphabet, sym[full * CG_LANES + k], alphabet, bad);
    for (int64_t r = full - 1; r >= 0; --r) {
        t -= CG_LANES;
        if (t < 0) t = (int32_t)(((int64_t)t % period + period) % period);
        const uint8_t* sr = sym + r * CG_LANES;
#pragma GCC unroll 16
        for (int k = CG_LANES - 1; k >= 0; --k) enc_put(x[k], ptr, T.info + (int64_t)ids[t + k] * alphabet, sr[k], alphabet, bad);
    }
    if (bad) return CG_ERR_SYMBOL;
    ptr -= CG_STATE_BYTES;
    for (int k = 0; k < CG_LANES; ++k) cg_store_u32(ptr + 4 * k, x[k]);
    *size = region + cap - ptr;
    std::memmove(region, ptr, (size_t)*size);
    return CG_OK;
}

}  // namespace

// The library is built with -fvisibility=hidden: only these entry points are exported.
#define CG_EXPORT __attribute__((visibility("default")))

extern "C" {

// Format version of rans_core.h's substreams, and the lanes per substream.
CG_EXPORT int32_t cg_format_version(void) { return 1; }
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
