// The CPU side of the native coder, shared by the entry points of rans_cpu.cpp (substreams of
// symbols) and kv_fused.cpp (KV chunks decoded and dequantised in one pass): table views, the
// thread pool over independent tasks, argument checks, and one substream's encoder and decoder.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "rans_core.h"

namespace cg {

struct Tables {
    const uint32_t* info;  // n_tables x alphabet
    const uint8_t* lut;    // n_tables x 2^lut_bits (decoder only)
    int32_t alphabet;
    int32_t lut_bits;
};

// No C++ exception may cross the C ABI or leave a thread: report it as an error code.
template <class F>
inline int guarded(F&& f) {
    try {
        return f();
    } catch (...) {
        return CG_ERR_INTERNAL;
    }
}

// Run work(s) for every task s on up to n_threads threads, tasks handed out one at a time
// (they differ a lot in size). Returns the first error any call reported.
template <class F>
inline int for_each_stream(int32_t n_streams, int64_t total_symbols, int32_t n_threads, F&& work) {
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

inline bool valid_offsets(const int64_t* off, int32_t n) {
    if (off[0] != 0) return false;
    for (int32_t s = 0; s < n; ++s)
        if (off[s + 1] < off[s]) return false;
    return true;
}

inline bool valid_table_ids(const int32_t* ids, int64_t count, int32_t n_tables) {
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= n_tables) return false;
    return true;
}

// Table ids of one stream repeated to period + CG_LANES entries, so that lane k of the
// round starting at table index t uses ext[t + k] without a wrap-around test.
inline void extend_ids(const int32_t* ids, int32_t period, std::vector<int32_t>& ext) {
    ext.resize((size_t)period + CG_LANES);
    for (int32_t i = 0; i < period + CG_LANES; ++i) ext[i] = ids[i % period];
}

inline int32_t advance(int32_t t, int32_t period) {
    t += CG_LANES;
    return t >= period ? t % period : t;
}

inline int decode_stream(const uint8_t* in, int64_t len, int64_t n, const int32_t* ids, int32_t period, const Tables& T,
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
inline int encode_stream(const uint8_t* sym, int64_t n, const int32_t* ids, int32_t period, const Tables& T, uint8_t* region,
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

}  // namespace cg
