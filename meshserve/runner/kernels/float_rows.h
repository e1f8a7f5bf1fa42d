// fp32 attention arithmetic for any cache dtype and shape: FloatRows, the kernel's portable path.
// A block's keys are stored [D, B] (transposed, so the scores of 16 keys are one vector FMA per
// head dimension) and its values [B, D].
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "row_state.h"

namespace meshserve_attention {

constexpr int64_t kRowGroup = 4;  // query rows that share each key and value load

// A block's keys [D, B] or values [B, D] as float: the cache itself for fp32, else a converted copy
// shared by every query row that reads the block.
template <typename scalar_t>
inline const float* as_float(const scalar_t* src, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    // A bfloat16 is the high half of a float: widening the bits is the whole conversion, and
    // written on integers it vectorizes (the c10 type's conversion does not).
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    uint32_t* wide = reinterpret_cast<uint32_t*>(buffer);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<uint32_t>(bits[i]) << 16;
    return buffer;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(src[i]);
    return buffer;
  }
}

// Folds one block's scores p [B] of one row, visible over [lo, hi], into the row's running
// softmax: p becomes the block's unnormalised probabilities (0 where masked) and the row's value
// sums are rescaled to the new maximum. A block the row cannot see changes nothing.
inline void fold_scores(float* p, int64_t block_size, int64_t dim, int64_t lo, int64_t hi,
                        RowState& row) {
  float block_max = -kHuge;
  for (int64_t i = lo; i <= hi; ++i) block_max = std::max(block_max, p[i]);
  const float new_max = std::max(row.max, block_max);
  const float correction = expf(row.max - new_max);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < block_size; ++i) {
    const float e = (i >= lo && i <= hi) ? expf(p[i] - new_max) : 0.f;
    p[i] = e;
    sum += e;
  }
  row.max = new_max;
  row.sum = row.sum * correction + sum;
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) row.acc[d] *= correction;
}

// One group of RB query rows against one block: scores for every key of the block (keys stored
// [D, B], so each step over D is one vector FMA per 16 keys and no horizontal sum), masked to each
// row's visible range [lo[r], hi[r]] (block-relative), then folded into the rows' running softmax
// and value sums. Requires B % 16 == 0 and D % 16 == 0 (see the generic path below).
template <int RB>
void row_group_block(const float* const* q, const float* keys, const float* values,
                     int64_t dim, int64_t block_size, const int64_t* lo, const int64_t* hi,
                     RowState* rows, float* p) {
  for (int64_t i0 = 0; i0 < block_size; i0 += kLanes) {
    float s0[RB][kLanes] = {}, s1[RB][kLanes] = {};
    for (int64_t d = 0; d < dim; d += 2) {
      const float* k0 = keys + d * block_size + i0;
      const float* k1 = k0 + block_size;
      for (int r = 0; r < RB; ++r) {
        const float a = q[r][d], b = q[r][d + 1];
#pragma omp simd
        for (int64_t i = 0; i < kLanes; ++i) {
          s0[r][i] += a * k0[i];
          s1[r][i] += b * k1[i];
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      for (int64_t i = 0; i < kLanes; ++i) p[r * block_size + i0 + i] = s0[r][i] + s1[r][i];
    }
  }
  for (int r = 0; r < RB; ++r) fold_scores(p + r * block_size, block_size, dim, lo[r], hi[r], rows[r]);
  for (int64_t d0 = 0; d0 < dim; d0 += kLanes) {
    float o[RB][kLanes];
    for (int r = 0; r < RB; ++r) {
      for (int64_t d = 0; d < kLanes; ++d) o[r][d] = rows[r].acc[d0 + d];
    }
    for (int64_t i = 0; i < block_size; ++i) {
      const float* v = values + i * dim + d0;
      for (int r = 0; r < RB; ++r) {
        const float pi = p[r * block_size + i];
#pragma omp simd
        for (int64_t d = 0; d < kLanes; ++d) o[r][d] += pi * v[d];
      }
    }
    for (int r = 0; r < RB; ++r) {
      for (int64_t d = 0; d < kLanes; ++d) rows[r].acc[d0 + d] = o[r][d];
    }
  }
}

// Any block size and head size: the same arithmetic, one row at a time, without the register
// tiling.
void row_block_generic(const float* q, const float* keys, const float* values, int64_t dim,
                       int64_t block_size, int64_t lo, int64_t hi, RowState& row, float* p) {
  float block_max = -kHuge;
  for (int64_t i = lo; i <= hi; ++i) {
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) dot += q[d] * keys[d * block_size + i];
    p[i] = dot;
    block_max = std::max(block_max, dot);
  }
  const float new_max = std::max(row.max, block_max);
  const float correction = expf(row.max - new_max);
  float sum = 0.f;
  for (int64_t i = lo; i <= hi; ++i) {
    p[i] = expf(p[i] - new_max);
    sum += p[i];
  }
  row.max = new_max;
  row.sum = row.sum * correction + sum;
  for (int64_t d = 0; d < dim; ++d) {
    float acc = row.acc[d] * correction;
    for (int64_t i = lo; i <= hi; ++i) acc += p[i] * values[i * dim + d];
    row.acc[d] = acc;
  }
}

void rows_block(int64_t count, const float* const* q, const float* keys, const float* values,
                int64_t dim, int64_t block_size, const int64_t* lo, const int64_t* hi,
                RowState* rows, float* p) {
  if (block_size % kLanes != 0 || dim % kLanes != 0) {
    for (int64_t r = 0; r < count; ++r) {
      if (lo[r] <= hi[r]) {
        row_block_generic(q[r], keys, values, dim, block_size, lo[r], hi[r], rows[r], p);
      }
    }
    return;
  }
  switch (count) {
    case 1: return row_group_block<1>(q, keys, values, dim, block_size, lo, hi, rows, p);
    case 2: return row_group_block<2>(q, keys, values, dim, block_size, lo, hi, rows, p);
    case 3: return row_group_block<3>(q, keys, values, dim, block_size, lo, hi, rows, p);
    default: return row_group_block<4>(q, keys, values, dim, block_size, lo, hi, rows, p);
  }
}

// fp32 arithmetic for any dtype: each query row is scaled into an fp32 copy, and each block read
// as fp32 (converted once per block and tile).
template <typename scalar_t>
class FloatRows {
 public:
  FloatRows(int64_t rows_max, int64_t dim, int64_t block_size, float scale)
      : dim_(dim), block_size_(block_size), scale_(scale), q_(rows_max * dim), ptrs_(rows_max),
        p_(kRowGroup * block_size), keys_(block_size * dim), values_(block_size * dim) {}

  void load_row(int64_t r, const scalar_t* src) {
    float* dst = q_.data() + r * dim_;
    for (int64_t d = 0; d < dim_; ++d) dst[d] = static_cast<float>(src[d]) * scale_;
    ptrs_[r] = dst;
  }

  void run(const BlockRun<scalar_t>& blocks, int64_t rows, RowState* state) {
    for (int64_t c = 0; c < blocks.count; ++c) {
      block(blocks.keys[c], blocks.values[c], rows, blocks.lo + c * blocks.stride,
            blocks.hi + c * blocks.stride, state);
    }
  }

 private:
  void block(const scalar_t* k, const scalar_t* v, int64_t rows, const int64_t* lo,
             const int64_t* hi, RowState* state) {
    const int64_t n = block_size_ * dim_;
    const float* keys = as_float(k, n, keys_.data());  // [D, B]
    const float* values = as_float(v, n, values_.data());  // [B, D]
    for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
      rows_block(std::min(kRowGroup, rows - r0), ptrs_.data() + r0, keys, values, dim_,
                 block_size_, lo + r0, hi + r0, state + r0, p_.data());
    }
  }

  int64_t dim_, block_size_;
  float scale_;
  std::vector<float> q_;
  std::vector<const float*> ptrs_;
  std::vector<float> p_, keys_, values_;
};

}  // namespace meshserve_attention
