// bf16 attention on AVX-512 BF16 for CPUs without AMX: PairRows, which reads blocks kept paired
// as TileRows does (keys [D/2, B, 2], values [B/2, D, 2]) and multiplies them with vdpbf16ps, the
// instruction that adds the products of a pair of bf16 values to one fp32 lane.
#pragma once

#if defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_state.h"
#include "run_softmax.h"

namespace meshserve_attention {

// bf16 queries and caches, up to four query rows at a time sharing every load: the scores of 16
// keys are one vdpbf16ps per row and pair of head dimensions (the row's pair broadcast against
// the 16 keys' pairs, which the paired layout keeps in one 64-byte line; each broadcast serves
// two chunks of 16 keys), and the value sums one per row, pair of keys and 16 head dimensions
// (the row's two probabilities broadcast against the two keys' values). Products of two bf16
// values are exact in fp32; the probabilities are rounded to bf16 for the value sums, as on the
// tiles. Each row's arithmetic is its own and in a fixed order, so its result does not depend on
// the rows beside it; the softmax folds a run of blocks at once, as TileRows does (see
// TileRows::run for why the runs are aligned).
class PairRows {
 public:
  PairRows(int64_t rows_max, int64_t dim, int64_t block_size, float scale)
      : dim_(dim), block_size_(block_size), scale_(scale), q_(rows_max * dim),
        scores_(kGroup * kRunBlocks * block_size), probs_(kGroup * kRunBlocks * block_size),
        correction_(kGroup) {}

  // Head dimensions in whole 32-dimension chunks (two vectors of value sums at least) and keys in
  // whole vectors; the same shapes the tiles take, so a cache's layout depends on its dtype and
  // shape alone.
  static bool fits(int64_t dim, int64_t block_size) {
    return dim % (2 * kLanes) == 0 && block_size % kLanes == 0;
  }

  void load_row(int64_t r, const c10::BFloat16* src) {
    std::memcpy(q_.data() + r * dim_, src, dim_ * sizeof(uint16_t));
  }

  void run(const BlockRun<c10::BFloat16>& blocks, int64_t rows, RowState* state) {
    for (int64_t r0 = 0; r0 < rows; r0 += kGroup) {
      switch (std::min(kGroup, rows - r0)) {
        case 1: group<1>(blocks, r0, state); break;
        case 2: group<2>(blocks, r0, state); break;
        case 3: group<3>(blocks, r0, state); break;
        default: group<4>(blocks, r0, state); break;
      }
    }
  }

 private:
  static constexpr int64_t kGroup = 4;  // query rows that share each key and value load
  static constexpr int kChunks = 2;  // chunks of 16 keys that share each query broadcast

  // Rows r0 .. r0 + RB over the run: scores, the softmax over the whole run, then the value sums.
  template <int RB>
  void group(const BlockRun<c10::BFloat16>& blocks, int64_t r0, RowState* state) {
    const int64_t B = block_size_, D = dim_, width = kRunBlocks * B;
    const uint32_t* q[RB];  // each row's pairs of head dimensions
    for (int r = 0; r < RB; ++r) q[r] = reinterpret_cast<const uint32_t*>(&q_[(r0 + r) * D]);
    const int64_t chunks = blocks.count * (B / kLanes);  // the run's keys, 16 at a time
    int64_t chunk = 0;
    for (; chunk + kChunks <= chunks; chunk += kChunks) scores<RB, kChunks>(blocks, q, chunk);
    for (; chunk < chunks; ++chunk) scores<RB, 1>(blocks, q, chunk);
    for (int r = 0; r < RB; ++r) {
      correction_[r] = fold_run_to_bf16(&scores_[r * width], scale_, B, blocks.count,
                                        blocks.lo + r0 + r, blocks.hi + r0 + r, blocks.stride,
                                        state[r0 + r], &probs_[r * width]);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 4 * kLanes) {
      if (D - d0 >= 4 * kLanes) {
        value_sums<RB, 4>(blocks, d0, state + r0);
      } else {
        value_sums<RB, 2>(blocks, d0, state + r0);
      }
    }
  }

  // The rows' dot products with NC chunks of 16 keys of the run from ``first`` on. Each row
  // broadcast serves every chunk, so there is one broadcast per NC products instead of per one.
  // Each score keeps its own two sums, over even and odd pairs (so that consecutive products do
  // not wait on each other), whatever NC: a score's bits do not depend on the chunks beside it.
  template <int RB, int NC>
  void scores(const BlockRun<c10::BFloat16>& blocks, const uint32_t* const* q, int64_t first) {
    const int64_t B = block_size_, D = dim_, width = kRunBlocks * B;
    const uint16_t* keys[NC];  // [D/2, B, 2] from the chunk's first key on
    int64_t at[NC];  // the chunk's first key in the run
    for (int n = 0; n < NC; ++n) {
      const int64_t c = (first + n) / (B / kLanes), i0 = (first + n) % (B / kLanes) * kLanes;
      keys[n] = reinterpret_cast<const uint16_t*>(blocks.keys[c]) + i0 * 2;
      at[n] = c * B + i0;
    }
    __m512 even[RB][NC], odd[RB][NC];
    for (int r = 0; r < RB; ++r) {
      for (int n = 0; n < NC; ++n) even[r][n] = odd[r][n] = _mm512_setzero_ps();
    }
    for (int64_t pair = 0; pair < D / 2; pair += 2) {
      __m512bh k0[NC], k1[NC];
      for (int n = 0; n < NC; ++n) {
        k0[n] = load_pairs(keys[n] + pair * B * 2);
        k1[n] = load_pairs(keys[n] + (pair + 1) * B * 2);
      }
      for (int r = 0; r < RB; ++r) {
        const __m512bh q0 = broadcast(q[r][pair]), q1 = broadcast(q[r][pair + 1]);
        for (int n = 0; n < NC; ++n) {
          even[r][n] = _mm512_dpbf16_ps(even[r][n], q0, k0[n]);
          odd[r][n] = _mm512_dpbf16_ps(odd[r][n], q1, k1[n]);
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      for (int n = 0; n < NC; ++n) {
        _mm512_storeu_ps(&scores_[r * width + at[n]], _mm512_add_ps(even[r][n], odd[r][n]));
      }
    }
  }

  // Head dimensions d0 .. d0 + 16 * NV of the rows' value sums: rescaled once for the run, then
  // every visible key's value added at its probability (masked keys have probability 0).
  template <int RB, int NV>
  void value_sums(const BlockRun<c10::BFloat16>& blocks, int64_t d0, RowState* rows) {
    const int64_t B = block_size_, D = dim_, width = kRunBlocks * B;
    __m512 acc[RB][NV];
    for (int r = 0; r < RB; ++r) {
      const __m512 f = _mm512_set1_ps(correction_[r]);
      for (int v = 0; v < NV; ++v) {
        acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(rows[r].acc + d0 + v * kLanes), f);
      }
    }
    for (int64_t c = 0; c < blocks.count; ++c) {
      const uint16_t* values = reinterpret_cast<const uint16_t*>(blocks.values[c]);  // [B/2, D, 2]
      for (int64_t pair = 0; pair < B / 2; ++pair) {
        __m512bh v_pairs[NV];  // 16 head dimensions of two keys, each
        for (int v = 0; v < NV; ++v) {
          v_pairs[v] = load_pairs(values + (pair * D + d0 + v * kLanes) * 2);
        }
        for (int r = 0; r < RB; ++r) {
          const uint32_t p2 = reinterpret_cast<const uint32_t*>(&probs_[r * width + c * B])[pair];
          const __m512bh p = broadcast(p2);
          for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], p, v_pairs[v]);
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(rows[r].acc + d0 + v * kLanes, acc[r][v]);
    }
  }

  static __m512bh load_pairs(const uint16_t* src) {
    return (__m512bh)_mm512_loadu_si512(src);
  }
  static __m512bh broadcast(uint32_t pair) {
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
  }

  int64_t dim_, block_size_;
  float scale_;
  std::vector<uint16_t> q_;  // [rows, D] bf16 query rows
  std::vector<float> scores_;  // [4, run blocks * B]
  std::vector<uint16_t> probs_;  // [4, run blocks * B] bf16
  std::vector<float> correction_;  // [4]
};

}  // namespace meshserve_attention
#endif
