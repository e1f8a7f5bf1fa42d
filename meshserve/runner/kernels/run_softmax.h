// The softmax step both bf16 arithmetics share (TileRows on AMX, PairRows on AVX-512 BF16): a
// row's scores over a run of blocks folded into its running softmax, with the probabilities
// rounded to bf16 for the value sums.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "row_state.h"

namespace meshserve_attention {

// exp(x) for x in [-87, 0] (clamped there): 2^n * e^r with |r| <= ln2 / 2 and a degree-6 Taylor
// polynomial, relative error below 2e-7. One fixed sequence of instructions, so it gives the same
// bits wherever a row is computed.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_setzero_ps());
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);  // and the rest
  __m512 poly = _mm512_set1_ps(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) {
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(poly, n);
}

// Folds one row's dot products over a run of blocks, p [count * B] (scaled here, in place), into
// its running softmax: block c's keys are visible over [lo[c * stride], hi[c * stride]]
// (block-relative). Writes the run's probabilities, rounded to bf16, to pb [count * B] (0 where
// masked) and returns the factor the row's value sums are rescaled by. One maximum, one sum and
// one rescale per run, not per block. Keys the row cannot see change nothing, so a block it
// cannot see may be in the run or not: the result is the same.
inline float fold_run_to_bf16(float* p, float scale, int64_t block_size, int64_t count,
                              const int64_t* lo, const int64_t* hi, int64_t stride,
                              RowState& row, uint16_t* pb) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const auto visible = [&](int64_t c, int64_t i0) {
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i0)));
    const __m512i first = _mm512_set1_epi32(static_cast<int>(lo[c * stride]));
    const __m512i last = _mm512_set1_epi32(static_cast<int>(hi[c * stride]));
    return static_cast<__mmask16>(_mm512_cmpge_epi32_mask(key, first) &
                                  _mm512_cmple_epi32_mask(key, last));
  };
  __m512 run_max = _mm512_set1_ps(-kHuge);
  for (int64_t c = 0; c < count; ++c) {
    for (int64_t i0 = 0; i0 < block_size; i0 += kLanes) {
      float* key = p + c * block_size + i0;
      const __m512 scores = _mm512_mul_ps(_mm512_loadu_ps(key), _mm512_set1_ps(scale));
      _mm512_storeu_ps(key, scores);
      run_max = _mm512_mask_max_ps(run_max, visible(c, i0), run_max, scores);
    }
  }
  const float new_max = std::max(row.max, _mm512_reduce_max_ps(run_max));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < count; ++c) {
    for (int64_t i0 = 0; i0 < block_size; i0 += kLanes) {
      const int64_t k = c * block_size + i0;
      const __m512 e = _mm512_maskz_mov_ps(
          visible(c, i0),
          exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p + k), _mm512_set1_ps(new_max))));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + k), (__m256i)_mm512_cvtneps_pbh(e));
    }
  }
  const float correction =
      _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(row.max - new_max)));
  row.max = new_max;
  row.sum = row.sum * correction + _mm512_reduce_add_ps(sum);
  return correction;
}

}  // namespace meshserve_attention
#endif
