// Threaded CPU encoder/decoder over many independent substreams (see rans_core.h for the format).
// Plain C ABI over raw pointers, loaded from Python with ctypes (which releases the GIL).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "rans_core.h"

namespace {

// Split streams [0, n) into contiguous ranges of about equal symbol counts, one per thread.
template <class F>
int run_parallel(int32_t n_streams, const int64_t* sym_offsets, int32_t n_threads, F&& work) {
    if (n_threads < 1) n_threads = 1;
    int64_t total = sym_offsets[n_streams];
    if (n_threads == 1 || n_streams < 2 || total < (1 << 16)) {
        return work(0, n_streams);
    }
    n_threads = std::min<int32_t>(n_threads, n_streams);
    std::vector<int32_t> cuts{0};
    for (int32_t t = 1; t < n_threads; ++t) {
        int64_t target = total * t / n_threads;
        int32_t s = (int32_t)(std::lower_bound(sym_offsets, sym_offsets + n_streams + 1, target) - sym_offsets);
        cuts.push_back(std::max(cuts.back(), std::min(s, n_streams)));
    }
    cuts.push_back(n_streams);
    std::atomic<int> err{CG_OK};
    std::vector<std::thread> pool;
    for (int32_t t = 0; t + 1 < (int32_t)cuts.size(); ++t) {
        int32_t a = cuts[t], b = cuts[t + 1];
        if (a == b) continue;
        pool.emplace_back([&, a, b] {
            int e = work(a, b);
            if (e != CG_OK) err.store(e);
        });
    }
    for (auto& th : pool) th.join();
    return err.load();
}

int encode_stream(const uint8_t* sym, int64_t n, const int32_t* tids, int32_t period, const uint32_t* cdf,
                  uint32_t alphabet, uint8_t* region, int64_t cap, int64_t* size) {
    if (n == 0) {
        *size = 0;
        return CG_OK;
    }
    uint32_t x[CG_LANES];
    for (int k = 0; k < CG_LANES; ++k) x[k] = CG_RANS_L;
    uint8_t* ptr = region + cap;
    const uint8_t* floor_ptr = region + 4 * CG_LANES;
    if (cap < 4 * CG_LANES) return CG_ERR_CAPACITY;
    int32_t t = (int32_t)((n - 1) % period);
    for (int64_t j = n - 1; j >= 0; --j) {
        uint32_t s = sym[j];
        if (s >= alphabet) return CG_ERR_SYMBOL;
        const uint32_t* c = cdf + (int64_t)tids[t] * (alphabet + 1);
        if (!cg_enc_put(&x[j % CG_LANES], &ptr, floor_ptr, c[s], c[s + 1] - c[s])) return CG_ERR_CAPACITY;
        if (--t < 0) t = period - 1;
    }
    ptr -= 4 * CG_LANES;
    for (int k = 0; k < CG_LANES; ++k) {
        ptr[4 * k + 0] = (uint8_t)(x[k]);
        ptr[4 * k + 1] = (uint8_t)(x[k] >> 8);
        ptr[4 * k + 2] = (uint8_t)(x[k] >> 16);
        ptr[4 * k + 3] = (uint8_t)(x[k] >> 24);
    }
    *size = region + cap - ptr;
    std::memmove(region, ptr, (size_t)*size);
    return CG_OK;
}

}  // namespace

extern "C" {

// Worst-case bytes of a substream of n symbols (16 bits per symbol plus the states).
int64_t cg_encode_bound(int64_t n) { return n == 0 ? 0 : 2 * n + 4 * CG_LANES; }

int32_t cg_lanes(void) { return CG_LANES; }

// Encode every substream s (symbols[sym_offsets[s]:sym_offsets[s+1]]) into
// out[out_offsets[s]:out_offsets[s+1]] (capacity), writing the used size to out_sizes[s].
int cg_encode(const uint8_t* symbols, const int64_t* sym_offsets, int32_t n_streams, const int32_t* table_ids,
              int32_t period, const uint32_t* cdf, uint32_t alphabet, uint8_t* out, const int64_t* out_offsets,
              int64_t* out_sizes, int32_t n_threads) {
    if (n_streams < 0 || period < 1 || alphabet < 2 || alphabet > 256) return CG_ERR_ARGS;
    return run_parallel(n_streams, sym_offsets, n_threads, [&](int32_t a, int32_t b) {
        for (int32_t s = a; s < b; ++s) {
            int e = encode_stream(symbols + sym_offsets[s], sym_offsets[s + 1] - sym_offsets[s],
                                  table_ids + (int64_t)s * period, period, cdf, alphabet, out + out_offsets[s],
                                  out_offsets[s + 1] - out_offsets[s], out_sizes + s);
            if (e != CG_OK) return e;
        }
        return (int)CG_OK;
    });
}

// Decode every substream s (in[in_offsets[s]:in_offsets[s+1]]) into out[sym_offsets[s]:...];
// status[s] gets each stream's result; returns the first error (0 when all decoded).
int cg_decode(const uint8_t* in, const int64_t* in_offsets, int32_t n_streams, const int64_t* sym_offsets,
              const int32_t* table_ids, int32_t period, const uint32_t* cdf, uint32_t alphabet, uint8_t* out,
              int32_t* status, int32_t n_threads) {
    if (n_streams < 0 || period < 1 || alphabet < 2 || alphabet > 256) return CG_ERR_ARGS;
    return run_parallel(n_streams, sym_offsets, n_threads, [&](int32_t a, int32_t b) {
        int first = CG_OK;
        for (int32_t s = a; s < b; ++s) {
            status[s] = cg_decode_stream(in + in_offsets[s], in_offsets[s + 1] - in_offsets[s],
                                         sym_offsets[s + 1] - sym_offsets[s], table_ids + (int64_t)s * period, period,
                                         cdf, alphabet, out + sym_offsets[s]);
            if (status[s] != CG_OK && first == CG_OK) first = status[s];
        }
        return first;
    });
}

}  // extern "C"
