// torch's float32 sums on the CPU, in torch's order, so that the native encoder's chunk means and
// sums of squares are bit-identical to the torch path's (kv_encode.cpp). The order is that of
// `cascade_sum` in aten/src/ATen/native/cpu/SumKernel.cpp (checked against torch 2.13 by
// tests/test_fused_encode.py): per output, a cascade of 4 levels of partial sums over rows, and,
// for an inner reduction, kTorchVec lanes and 4 vectors per row. kTorchVec is the floats per
// vector of torch's reduction kernels on x86 (8 with the AVX512, AVX2 and default CPU
// capabilities alike); for outer sums it only matters for head dims not a multiple of 32.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cg {

constexpr int32_t kTorchVec = 8;

// c10::BFloat16(float): round to nearest even, as float (NaN is not rounded here: callers reject it).
inline float bf16_round(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&f, &u, 4);
    return f;
}

// multi_row_sum: `size` rows of `width` floats summed per column. The caller adds row i into
// row() and calls next(); finish() returns the column sums (acc[0] + acc[1] + acc[2] + acc[3]).
class Cascade {
  public:
    void reset(int64_t size, int32_t width) {
        const int64_t log2 = size <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)size - 1);  // c10::CeilLog2
        level_ = (int32_t)std::max<int64_t>(4, log2 / 4);
        mask_ = ((int64_t)1 << level_) - 1;
        full_ = size & ~mask_;
        width_ = width;
        count_ = 0;
        acc_.assign((size_t)4 * width, 0.0f);
    }
    float* row() { return acc_.data(); }
    void next() {
        if (++count_ > full_ || (count_ & mask_)) return;
        for (int32_t j = 1; j < 4; ++j) {
            float* up = acc_.data() + (int64_t)j * width_;
            float* low = up - width_;
            for (int32_t k = 0; k < width_; ++k) {
                up[k] += low[k];
                low[k] = 0.0f;
            }
            if (count_ & (mask_ << (j * level_))) break;
        }
    }
    float* finish() {
        float* a = acc_.data();
        for (int32_t j = 1; j < 4; ++j)
            for (int32_t k = 0; k < width_; ++k) a[k] += a[(int64_t)j * width_ + k];
        return a;
    }

  private:
    std::vector<float> acc_;
    int64_t mask_ = 0, full_ = 0, count_ = 0;
    int32_t level_ = 4, width_ = 0;
};

// The sum of `count` contiguous floats (cascade_sum's inner sums), fed in order in pieces of any
// length. From 8 floats on (vectorized_inner_sum): rows of 4 vectors go through a cascade; whole
// vectors left over are added to the first of its 4 partial vectors, the other three after them;
// the floats past the last whole vector are summed from 0, then every lane of the partial vector
// is added to that. Fewer (scalar_inner_sum): row_sum of the floats.
class InnerSum {
  public:
    void reset(int64_t count) {
        small_ = count < kTorchVec;
        vectors_end_ = count / kTorchVec * kTorchVec;
        rows_end_ = vectors_end_ / (4 * kTorchVec) * (4 * kTorchVec);
        fed_ = 0;
        staged_ = 0;
        scalar_ = 0.0f;
        part_ = nullptr;
        rows_.reset(rows_end_ / (4 * kTorchVec), 4 * kTorchVec);
    }
    void feed(const float* a, int64_t len) {
        constexpr int32_t R = 4 * kTorchVec;
        if (small_) {  // at most 7 floats: kept for finish()
            std::memcpy(stage_ + staged_, a, sizeof(float) * len);
            staged_ += (int32_t)len;
            return;
        }
        while (len > 0) {
            if (fed_ < rows_end_) {
                if (staged_ == 0 && len >= R) {
                    add_row(a);
                    a += R, len -= R, fed_ += R;
                    continue;
                }
                const int64_t take = std::min<int64_t>(len, R - staged_);
                std::memcpy(stage_ + staged_, a, sizeof(float) * take);
                staged_ += (int32_t)take, a += take, len -= take, fed_ += take;
                if (staged_ == R) {
                    add_row(stage_);
                    staged_ = 0;
                }
            } else if (fed_ < vectors_end_) {
                if (!part_) part_ = rows_.finish();
                part_[fed_ % kTorchVec] += *a++;
                --len, ++fed_;
            } else {
                if (!part_) part_ = rows_.finish();
                scalar_ += *a++;
                --len, ++fed_;
            }
        }
    }
    // Whether the next `len` floats fill whole rows of the cascade: the caller may then add them
    // row by row into row() itself, calling next() after each (`len` / (4 * kTorchVec) rows).
    bool whole_rows(int64_t len) const { return !small_ && staged_ == 0 && len % (4 * kTorchVec) == 0 && fed_ + len <= rows_end_; }
    float* row() { return rows_.row(); }
    void next() {
        rows_.next();
        fed_ += 4 * kTorchVec;
    }
    float finish() {
        if (small_) {  // row_sum: one row of 4 (when there are 4), the rest onto the first, then the others
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const int32_t quad = staged_ >= 4 ? 4 : 0;
            for (int32_t k = 0; k < quad; ++k) p[k] += stage_[k];
            for (int32_t k = quad; k < staged_; ++k) p[0] += stage_[k];
            return ((p[0] + p[1]) + p[2]) + p[3];
        }
        if (!part_) part_ = rows_.finish();
        float s = scalar_;
        for (int32_t k = 0; k < kTorchVec; ++k) {
            float lane = part_[k];
            for (int32_t j = 1; j < 4; ++j) lane += part_[j * kTorchVec + k];
            s += lane;
        }
        return s;
    }

  private:
    void add_row(const float* x) {
        float* r = rows_.row();
        for (int32_t k = 0; k < 4 * kTorchVec; ++k) r[k] += x[k];
        rows_.next();
    }
    Cascade rows_;
    float stage_[4 * kTorchVec];
    float* part_;
    float scalar_ = 0.0f;
    int64_t vectors_end_ = 0, rows_end_ = 0, fed_ = 0;
    int32_t staged_ = 0;
    bool small_ = false;
};

// The sum over `rows` rows of each of `width` contiguous columns (cascade_sum's outer sums): with
// 8 columns or more (vectorized_outer_sum) those below the last multiple of 4 vectors, with fewer
// (scalar_outer_sum) those below the last multiple of 4, are cascades over the rows; the others are
// row_sum: 4 cascades over every 4th row, the rows left over added to the first, then the other
// three. One column is an inner sum (torch folds the column away).
class ColumnSum {
  public:
    void reset(int64_t rows, int32_t width) {
        const int32_t group = width >= kTorchVec ? 4 * kTorchVec : 4;
        split_ = width == 1 ? 0 : width / group * group;
        rest_ = width == 1 ? 0 : width - split_;
        quads_ = rows / 4;
        row_ = 0;
        part_ = nullptr;
        head_.reset(rows, split_);
        tail_.reset(quads_, 4 * rest_);
        single_ = width == 1;
        if (single_) one_.reset(rows);
    }
    void add(const float* x) {
        if (single_) {
            one_.feed(x, 1);
            return;
        }
        float* a = head_.row();
        for (int32_t k = 0; k < split_; ++k) a[k] += x[k];
        head_.next();
        if (rest_) {
            x += split_;
            if (row_ < 4 * quads_) {
                float* b = tail_.row() + (row_ % 4) * rest_;
                for (int32_t k = 0; k < rest_; ++k) b[k] += x[k];
                if (row_ % 4 == 3) tail_.next();
            } else {
                if (!part_) part_ = tail_.finish();
                for (int32_t k = 0; k < rest_; ++k) part_[k] += x[k];
            }
        }
        ++row_;
    }
    void finish(float* out) {
        if (single_) {
            out[0] = one_.finish();
            return;
        }
        if (split_) std::memcpy(out, head_.finish(), sizeof(float) * split_);
        if (!rest_) return;
        if (!part_) part_ = tail_.finish();
        for (int32_t k = 0; k < rest_; ++k) {
            float s = part_[k];
            for (int32_t j = 1; j < 4; ++j) s += part_[j * rest_ + k];
            out[split_ + k] = s;
        }
    }

  private:
    Cascade head_, tail_;
    InnerSum one_;
    float* part_;
    int64_t quads_ = 0, row_ = 0;
    int32_t split_ = 0, rest_ = 0;
    bool single_ = false;
};

}  // namespace cg
