// Native quantisation of a v2 KV chunk, the encode side of kv_fused.cpp: cg_encode_chunk does
// what pipeline.components, pipeline.quantise and substreams.flatten_symbols do (and counts the
// symbols per inline table), in one threaded pass per (kind, layer) over the chunk's keys and
// values, each possibly a token slice of a larger (layers, heads, tokens_buf, head_dim) buffer
// with rows of head_dim contiguous floats. A task reads its layer once from memory and then works
// from the cache: the statistics of the coded tokens (keys un-rotated), the steps, the symbols
// (into a layer-major scratch) and their counts; a last pass puts the symbols in substream order.
// The float arithmetic is torch's, op for op (this file is built with -ffp-contract=off), and sums
// are added in the order of torch's CPU reductions (torch_sum.h): keys are un-rotated as
// RotarySpec.unrotate does, (x * cos - (-x') * sin) / scale2, and means, steps and symbols are
// bit-identical to the torch path's (pipeline.py, quantize.py).
#include <cmath>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
// The passes' loops are also compiled for AVX2 and picked at load time where the CPU has it: the
// same IEEE operations, twice as many per instruction.
#define CG_X86 1
#define CG_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CG_CLONES
#endif

#include "rans_cpu_impl.h"
#include "torch_sum.h"

using namespace cg;

#define CG_EXPORT __attribute__((visibility("default")))

namespace {

// One kind's tensor: element (l, h, t, d) at base[l * sl + h * sh + t * st + d].
struct View {
    const float* base;
    int64_t sl, sh, st;
    const float* row(int32_t l, int32_t h, int64_t t) const { return base + l * sl + h * sh + t * st; }
};

// Whether every element of a (layers, heads, tokens, head_dim) view with these strides lies in
// [0, extent) elements from its base (no int64 overflow on the way).
bool valid_view(const int64_t* strides, int64_t extent, int32_t layers, int32_t heads, int64_t tokens, int32_t head_dim) {
    int64_t last = head_dim - 1, term;
    const int64_t n[3] = {layers - 1, heads - 1, tokens - 1};
    for (int i = 0; i < 3; ++i) {
        if (strides[i] < 0) return false;
        if (__builtin_mul_overflow(n[i], strides[i], &term) || __builtin_add_overflow(last, term, &last)) return false;
    }
    return last < extent;
}

struct Chunk {
    View kind[2];
    int32_t layers, heads, head_dim;
    int64_t tokens, first;
    const float *cos, *sin;  // (tokens - first, head_dim) for the keys, or null: no rotary
    float scale2;
};

int check_chunk(const float* keys, const float* values, const int64_t* strides, const int64_t* extents, int32_t layers,
                int32_t heads, int64_t tokens, int32_t head_dim, int64_t first, const float* cos, const float* sin,
                float scale2, Chunk* c) {
    if (!keys || !values || !strides || !extents) return CG_ERR_ARGS;
    if (layers < 1 || heads < 1 || head_dim < 1 || tokens < 1 || first < 0 || first > tokens) return CG_ERR_ARGS;
    if ((cos == nullptr) != (sin == nullptr)) return CG_ERR_ARGS;
    if (cos && (head_dim % 2 || !(scale2 > 0) || !std::isfinite(scale2))) return CG_ERR_ARGS;
    for (int k = 0; k < 2; ++k)
        if (!valid_view(strides + 3 * k, extents[k], layers, heads, tokens, head_dim)) return CG_ERR_ARGS;
    *c = Chunk{{View{keys, strides[0], strides[1], strides[2]}, View{values, strides[3], strides[4], strides[5]}},
               layers, heads, head_dim, tokens, first, cos, sin, scale2};
    return CG_OK;
}

// Coded token t (from 0) of vector (kind, l, h) as the torch path sees it: keys un-rotated.
// Returns a pointer to the row itself, or to u after writing the un-rotated row there.
inline const float* coded_row(const Chunk& c, int kind, int32_t l, int32_t h, int64_t t, float* u) {
    const float* x = c.kind[kind].row(l, h, c.first + t);
    if (kind != 0 || !c.cos) return x;
    const int32_t half = c.head_dim / 2, d = c.head_dim;
    const float* co = c.cos + t * d;
    const float* si = c.sin + t * d;
    for (int32_t i = 0; i < half; ++i) u[i] = x[i] * co[i] - (-x[i + half]) * si[i];
    for (int32_t i = half; i < d; ++i) u[i] = x[i] * co[i] - x[i - half] * si[i];
    if (c.scale2 != 1.0f)  // x / 1 == x
        for (int32_t i = 0; i < d; ++i) u[i] = u[i] / c.scale2;
    return u;
}

// The first read of a chunk comes from memory, row by row: asking for the row this many tokens
// ahead saves a sixth of the pass.
constexpr int64_t kPrefetchRows = 16;

// q[j] = clamp(round_half_even((x[j] - m[j]) / s[j]), -127, 127) + 128 for j < d, as quantize.py
// computes it (rounding in the current mode, to nearest even unless someone changed it, as torch
// does; clamping before or after rounding to an integer bound is the same). Returns nonzero when
// some quotient is NaN.
int quantise_row(const float* x, const float* m, const float* s, int32_t d, uint8_t* q) {
    int32_t j = 0;
    int bad = 0;
#if defined(CG_X86)
    const __m128 lo = _mm_set1_ps(-127.0f), hi = _mm_set1_ps(127.0f);
    const __m128i offset = _mm_set1_epi32(128);
    __m128 nan = _mm_setzero_ps();
    for (; j + 16 <= d; j += 16) {
        __m128i w[4];
        for (int k = 0; k < 4; ++k) {
            const int32_t i = j + 4 * k;
            __m128 r = _mm_div_ps(_mm_sub_ps(_mm_loadu_ps(x + i), _mm_loadu_ps(m + i)), _mm_loadu_ps(s + i));
            nan = _mm_or_ps(nan, _mm_cmpunord_ps(r, r));
            r = _mm_min_ps(_mm_max_ps(r, lo), hi);
            w[k] = _mm_add_epi32(_mm_cvtps_epi32(r), offset);
        }
        _mm_storeu_si128((__m128i*)(q + j), _mm_packus_epi16(_mm_packs_epi32(w[0], w[1]), _mm_packs_epi32(w[2], w[3])));
    }
    bad = _mm_movemask_ps(nan);
#endif
    for (; j < d; ++j) {
        float r = (x[j] - m[j]) / s[j];
        if (r != r) {
            bad = 1;
            r = 0.0f;
        }
        q[j] = (uint8_t)((int32_t)std::nearbyint(std::min(std::max(r, -127.0f), 127.0f)) + 128);
    }
    return bad;
}

#if defined(CG_X86)
__attribute__((target("avx2"))) int quantise_row_avx2(const float* x, const float* m, const float* s, int32_t d, uint8_t* q) {
    int32_t j = 0;
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i offset = _mm256_set1_epi32(128);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' interleaving of 128-bit lanes
    __m256 nan = _mm256_setzero_ps();
    for (; j + 32 <= d; j += 32) {
        __m256i w[4];
        for (int k = 0; k < 4; ++k) {
            const int32_t i = j + 8 * k;
            __m256 r = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(m + i)), _mm256_loadu_ps(s + i));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
            r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            w[k] = _mm256_add_epi32(_mm256_cvtps_epi32(r), offset);
        }
        const __m256i p = _mm256_packus_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
        _mm256_storeu_si256((__m256i*)(q + j), _mm256_permutevar8x32_epi32(p, order));
    }
    return _mm256_movemask_ps(nan) | (j < d ? quantise_row(x + j, m + j, s + j, d - j, q + j) : 0);
}
#endif

// Counts the n symbols of q in hist: kSubHist interleaved histograms of 256 counts, so that runs
// of one symbol do not wait on one counter. flush adds them to a table's int64 counts and clears them.
constexpr int32_t kSubHist = 8;
inline void count_row(const uint8_t* q, int64_t n, uint32_t* hist) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        uint64_t w;
        std::memcpy(&w, q + j, 8);
        for (int k = 0; k < 8; ++k) ++hist[k * 256 + ((w >> (8 * k)) & 255)];
    }
    for (; j < n; ++j) ++hist[(j & 7) * 256 + q[j]];
}

struct Params {
    float level_step, cap;
    bool fitted;           // the chunk holds components: no centring, base step = level_step
    bool avx2;             // the CPU has AVX2: quantise_row_avx2 and count_near_avx2 can run
    const float* weights;  // null, or (unfitted) each component's base step multiplier, (2, layers, heads, head_dim)
};

inline int quantise(const Params& p, const float* x, const float* m, const float* s, int32_t d, uint8_t* q) {
#if defined(CG_X86)
    if (p.avx2) return quantise_row_avx2(x, m, s, d, q);
#else
    (void)p;
#endif
    return quantise_row(x, m, s, d, q);
}

#if defined(CG_X86)
// count_row for symbols mostly within 128 +- Near (the coarse levels): those are counted 32 at a
// time in byte counters per symbol, the others one by one.
template <int Near>
__attribute__((target("avx2"))) void drain_near(__m256i* acc, uint32_t* hist) {
    for (int b = 0; b <= 2 * Near; ++b) {
        const __m256i s = _mm256_sad_epu8(acc[b], _mm256_setzero_si256());
        hist[128 - Near + b] += (uint32_t)(_mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 1) + _mm256_extract_epi64(s, 2) +
                                           _mm256_extract_epi64(s, 3));  // fmt: skip
        acc[b] = _mm256_setzero_si256();
    }
}

template <int Near>
__attribute__((target("avx2"), noinline)) void count_near_avx2(const uint8_t* q, int64_t n, uint32_t* hist) {
    const __m256i base = _mm256_set1_epi8((char)(128 - Near)), top = _mm256_set1_epi8(2 * Near);
    __m256i acc[2 * Near + 1];
    for (int b = 0; b <= 2 * Near; ++b) acc[b] = _mm256_setzero_si256();
    int64_t j = 0;
    for (int pending = 0; j + 32 <= n; j += 32) {
        const __m256i v = _mm256_sub_epi8(_mm256_loadu_si256((const __m256i*)(q + j)), base);  // near symbols -> 0 .. 2 Near
        uint32_t far = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(v, top), v));
        for (; far; far &= far - 1) ++hist[q[j + __builtin_ctz(far)]];
        for (int b = 0; b <= 2 * Near; ++b) acc[b] = _mm256_sub_epi8(acc[b], _mm256_cmpeq_epi8(v, _mm256_set1_epi8((char)b)));
        if (++pending == 255) {  // before a byte counter overflows
            drain_near<Near>(acc, hist);
            pending = 0;
        }
    }
    drain_near<Near>(acc, hist);
    for (; j < n; ++j) ++hist[q[j]];
}

// Whether nearly all of a sample of q[0, n) is within 128 +- near.
inline bool mostly_near(const uint8_t* q, int64_t n, int near) {
    const int64_t sample = std::min<int64_t>(n, 4096);
    int64_t in = 0;
    for (int64_t j = 0; j < sample; ++j) in += (uint8_t)(q[j] - (128 - near)) <= 2 * near;
    return in >= sample - sample / 32;
}
#endif

// The counts of q[0, n) added to hist: with count_near_avx2 when p allows and a sample of the
// symbols is near enough to 128 for it to pay (the fewer bins, the faster).
inline void count_symbols(const Params& p, const uint8_t* q, int64_t n, uint32_t* hist) {
#if defined(CG_X86)
    if (p.avx2 && mostly_near(q, n, 3)) return count_near_avx2<3>(q, n, hist);
    if (p.avx2 && mostly_near(q, n, 7)) return count_near_avx2<7>(q, n, hist);
#else
    (void)p;
#endif
    count_row(q, n, hist);
}

inline void flush(std::vector<uint32_t>& hist, int64_t* table) {
    for (int k = 0; k < kSubHist; ++k)
        for (int i = 0; i < 256; ++i) table[i] += hist[k * 256 + i];
    std::fill(hist.begin(), hist.end(), 0u);
}

// Symbols counted between flushes of the 32-bit counts (at least one token's), the most heads * dim
// of a layer, and tokens per task of the last pass.
constexpr int64_t kFlushSymbols = (int64_t)1 << 30, kMaxChannels = (int64_t)1 << 20, kTransposeTokens = 64;

// The next bfloat16 above a positive bfloat16 b (torch.nextafter(b, inf) in bfloat16).
inline float bf16_next_up(float b) {
    if (std::isinf(b)) return b;
    uint32_t u;
    std::memcpy(&u, &b, 4);
    u += 0x10000u;
    std::memcpy(&b, &u, 4);
    return b;
}

// quantize.steps for one component from its statistics: base, max |c| (peak) and, when cap > 0,
// its RMS, as torch computes it in float32: max(min(base, cap * rms), peak / 127), 1 where that is
// not above 1e-30, rounded up to bfloat16, one bfloat16 more when peak / step still exceeds 127.
inline float component_step(float base, float peak, float cap, float rms) {
    float step = base;
    if (cap > 0) step = std::min(step, cap * rms);
    step = std::max(step, peak / 127.0f);
    step = step > 1e-30f ? step : 1.0f;
    float b = bf16_round(step);
    if (b < step) b = bf16_next_up(b);
    return peak / b > 127.0f ? bf16_next_up(b) : b;
}

// One (kind, layer) of cg_encode_chunk: its means and steps, its symbols into its part of scratch
// and (counts not null) their counts. Returns 1 when a value is not finite (then nothing is
// quantised), 2 when a quotient is NaN.
CG_CLONES int layer_task(const Chunk& c, const Params& p, int kind, int32_t l, float* mean, float* step, uint8_t* scratch,
                         int64_t* counts) {
    const int64_t n = c.tokens - c.first, d = c.head_dim, heads = c.heads;
    const int64_t vec = heads * d, col0 = ((int64_t)kind * c.layers + l) * vec;
    std::vector<float> u(d), sq(d), sum(d), lo(vec), hi(vec), comp_sq(p.cap > 0 ? vec : 0);
    ColumnSum cols, comp;
    InnerSum layer;
    layer.reset(heads * n * d);
    float* m = mean + col0;
    int nonfinite = 0;  // x - x is 0 unless x is inf or NaN
    for (int32_t h = 0; h < heads; ++h) {
        for (int64_t t = 0; t < c.first; ++t) {
            const float* x = c.kind[kind].row(l, h, t);
            for (int64_t j = 0; j < d; ++j) nonfinite |= !(x[j] - x[j] == 0.0f);
        }
        float *mn = lo.data() + h * d, *mx = hi.data() + h * d, *mh = m + h * d;
        std::fill(mn, mn + d, INFINITY);
        std::fill(mx, mx + d, -INFINITY);
        if (!p.fitted) cols.reset(n, (int32_t)d);
        for (int64_t t = 0; t < n; ++t) {
            if (t + kPrefetchRows < n) {
                const char* ahead = (const char*)c.kind[kind].row(l, h, c.first + t + kPrefetchRows);
                for (int64_t b = 0; b < d * 4; b += 64) __builtin_prefetch(ahead + b);
            }
            const float* x = coded_row(c, kind, l, h, t, u.data());
            for (int64_t j = 0; j < d; ++j) {
                mn[j] = x[j] < mn[j] ? x[j] : mn[j];
                mx[j] = x[j] > mx[j] ? x[j] : mx[j];
                nonfinite |= !(x[j] - x[j] == 0.0f);
            }
            if (!p.fitted) cols.add(x);
        }
        if (p.fitted) {
            std::fill(mh, mh + d, 0.0f);
        } else {
            cols.finish(sum.data());
            for (int64_t j = 0; j < d; ++j) mh[j] = bf16_round(sum[j] / (float)n);  // sum.div_(n).to(bfloat16)
        }
        if (p.fitted && !(p.cap > 0)) continue;
        // c = x - mean: the squares for the layer's RMS (unfitted) and each component's (cap).
        if (p.cap > 0) comp.reset(n, (int32_t)d);
        for (int64_t t = 0; t < n; ++t) {
            const float* x = coded_row(c, kind, l, h, t, u.data());
            if (!(p.cap > 0) && layer.whole_rows(d)) {  // straight into the cascade's rows
                for (int64_t j = 0; j < d; j += 4 * kTorchVec, layer.next()) {
                    float* r = layer.row();
                    for (int32_t k = 0; k < 4 * kTorchVec; ++k) {
                        const float cj = x[j + k] - mh[j + k];
                        r[k] += cj * cj;
                    }
                }
                continue;
            }
            for (int64_t j = 0; j < d; ++j) {
                const float cj = x[j] - mh[j];
                sq[j] = cj * cj;
            }
            if (!p.fitted) layer.feed(sq.data(), d);
            if (p.cap > 0) comp.add(sq.data());
        }
        if (p.cap > 0) comp.finish(comp_sq.data() + h * d);
    }
    if (nonfinite) return 1;
    // Steps: base = level_step * the layer's RMS (c.square().mean(dim=(1, 2, 3)).sqrt()), times the
    // component's weight when there are weights; or level_step.
    const float base = p.fitted ? p.level_step : p.level_step * std::sqrt(layer.finish() / (float)(heads * n * d));
    float* s = step + col0;
    for (int64_t i = 0; i < vec; ++i) {
        const float peak = std::max(std::fabs(lo[i] - m[i]), std::fabs(hi[i] - m[i]));  // x - mean is monotone in x
        const float b = p.weights ? base * p.weights[col0 + i] : base;
        s[i] = component_step(b, peak, p.cap, p.cap > 0 ? std::sqrt(comp_sq[i] / (float)n) : 0.0f);
    }
    // Symbols into this layer's part of scratch (token-major rows of heads * dim), counted there.
    uint8_t* own = scratch + ((int64_t)kind * c.layers + l) * n * vec;
    int bad = 0;
    for (int32_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < n; ++t)
            bad |= quantise(p, coded_row(c, kind, l, h, t, u.data()), m + h * d, s + h * d, (int32_t)d, own + t * vec + h * d);
    if (counts) {
        std::vector<uint32_t> hist(kSubHist * 256, 0u);
        int64_t* table = counts + ((int64_t)kind * c.layers + l) * 256;
        const int64_t tokens = std::max<int64_t>(1, kFlushSymbols / vec);
        for (int64_t t0 = 0; t0 < n; t0 += tokens) {  // so that no 32-bit count overflows
            count_symbols(p, own + t0 * vec, std::min(n - t0, tokens) * vec, hist.data());
            flush(hist, table);
        }
    }
    return bad ? 2 : 0;
}

}  // namespace

extern "C" {

// Quantise the coded tokens [first, tokens) of a chunk as pipeline.components and pipeline.quantise
// do: keys and values with strides[0..2] and strides[3..5] (layer, head, token; in elements),
// extents[k] elements readable from each base; cos, sin: float (tokens - first, head_dim) for the
// keys, or both null (keys as they are). fitted = 0: per (kind, layer, head, dim) the bfloat16 mean
// of the coded tokens is written to mean, and base steps are level_step times the layer's RMS;
// fitted = 1: the chunk holds components (no exact tokens, no rotary), mean gets zeros and base
// steps are level_step. weights (fitted = 0 only; or null): float (2, layers, heads, head_dim), finite
// and positive, each component's base step multiplied by its weight. cap > 0: no step above cap times
// its component's RMS. mean, step: float
// (2, layers, heads, head_dim) outputs. out (out_len = (tokens - first) * 2 * layers * heads *
// head_dim bytes) gets the symbols in substream order (token, kind, layer, head, dim), through
// scratch (out_len bytes, layer-major: each task writes its own part); counts (or
// null): int64 (2 * layers, 256), the symbols' counts per table kind * layers + layer.
// *finite: 0 when a value (exact tokens included) or an un-rotated key is not finite (nothing is
// then quantised), else 1. Returns CG_ERR_SYMBOL when a quotient is NaN.
CG_EXPORT int cg_encode_chunk(const float* keys, const float* values, const int64_t* strides, const int64_t* extents,
                              int32_t layers, int32_t heads, int64_t tokens, int32_t head_dim, int64_t first,
                              const float* cos, const float* sin, float scale2, float level_step, float cap,
                              int32_t fitted, const float* weights, float* mean, float* step, uint8_t* out, int64_t out_len, uint8_t* scratch,
                              int64_t* counts, int32_t* finite, int32_t n_threads) {
    Chunk c;
    if (int e = check_chunk(keys, values, strides, extents, layers, heads, tokens, head_dim, first, cos, sin, scale2, &c))
        return e;
    const int64_t n = tokens - first, period = 2 * (int64_t)layers * heads * head_dim;
    if (!mean || !step || !finite || !out || !scratch || out_len != n * period || n < 1) return CG_ERR_ARGS;
    if ((int64_t)heads * head_dim > kMaxChannels) return CG_ERR_ARGS;
    if (!(level_step > 0) || !std::isfinite(level_step) || !(cap >= 0) || !std::isfinite(cap)) return CG_ERR_ARGS;
    if (fitted != 0 && (fitted != 1 || first != 0 || cos || weights)) return CG_ERR_ARGS;
    for (int64_t i = 0; weights && i < period; ++i)
        if (!(weights[i] > 0) || !std::isfinite(weights[i])) return CG_ERR_ARGS;
    if (counts) std::fill(counts, counts + 2 * layers * 256, (int64_t)0);
#if defined(CG_X86)
    const Params p{level_step, cap, fitted == 1, (bool)__builtin_cpu_supports("avx2"), weights};
#else
    const Params p{level_step, cap, fitted == 1, false, weights};
#endif
    const int64_t vec = (int64_t)heads * head_dim;
    std::atomic<int> status{0};
    int err = guarded([&] { return for_each_stream(2 * layers, n * period, n_threads, [&](int32_t task) {
        status.fetch_or(layer_task(c, p, task / layers, task % layers, mean, step, scratch, counts), std::memory_order_relaxed);
        return (int)CG_OK;
    }); });
    *finite = status.load() & 1 ? 0 : 1;
    if (err || status.load()) return err ? err : status.load() & 2 ? CG_ERR_SYMBOL : CG_OK;
    // Layer-major to token-major (the substream order), a block of tokens per task.
    const int64_t blocks = (n + kTransposeTokens - 1) / kTransposeTokens;
    if (blocks > INT32_MAX) return CG_ERR_ARGS;
    err = guarded([&] { return for_each_stream((int32_t)blocks, n * period, n_threads, [&](int32_t b) {
        for (int64_t t = b * kTransposeTokens; t < std::min(n, (b + 1) * kTransposeTokens); ++t)
            for (int64_t table = 0; table < 2 * layers; ++table)
                std::memcpy(out + t * period + table * vec, scratch + (table * n + t) * vec, (size_t)vec);
        return (int)CG_OK;
    }); });
    return err;
}

// For tests of torch_sum.h against torch itself. x: `outer` contiguous (rows, cols) matrices;
// col_sums[o * cols + j] gets the sum of column j of matrix o (torch: x.sum(dim=1)) and inner[o]
// the sum of all of matrix o (torch: x.sum(dim=(1, 2))), in torch's order.
CG_EXPORT int cg_torch_sums(const float* x, int64_t outer, int64_t rows, int32_t cols, float* col_sums, float* inner) {
    if (!x || !col_sums || !inner || outer < 1 || rows < 1 || cols < 1) return CG_ERR_ARGS;
    return guarded([&] {
        ColumnSum column;
        InnerSum all;
        for (int64_t o = 0; o < outer; ++o) {
            column.reset(rows, cols);
            all.reset(rows * cols);
            for (int64_t r = 0; r < rows; ++r) {
                const float* row = x + (o * rows + r) * cols;
                column.add(row);
                all.feed(row, cols);
            }
            column.finish(col_sums + o * cols);
            inner[o] = all.finish();
        }
        return (int)CG_OK;
    });
}

}  // extern "C"
