// What every row-arithmetic of the CPU attention kernel shares: the online-softmax state of one
// query row, and the constants of its masking and vector width.
#pragma once

#include <cstdint>

namespace meshserve_attention {

// Finite stand-in for -inf: the kernel is built with -ffast-math, which assumes no infinities.
constexpr float kHuge = 1e30f;

// Lanes of one accumulator kept in a register (one AVX-512 register of fp32, or two AVX2 ones).
constexpr int64_t kLanes = 16;

// Blocks one work item hands its row arithmetic at once: consecutive blocks of its sequence, in
// order, within one aligned group of kRunBlocks (blocks [8k, 8k + 8) of the sequence). Row r may
// see keys [lo[c * stride + r], hi[c * stride + r]] of block c (block-relative). The paired
// arithmetics (tiles, pairs) fold a run's keys into the softmax at once (one maximum, one rescale
// per run); the fp32 arithmetic takes the run's blocks one at a time.
constexpr int64_t kRunBlocks = 8;

template <typename scalar_t>
struct BlockRun {
  const scalar_t* keys[kRunBlocks];
  const scalar_t* values[kRunBlocks];
  int64_t count;
  const int64_t* lo;
  const int64_t* hi;
  int64_t stride;
};

// Online-softmax state of one query row.
struct RowState {
  float max;
  float sum;
  float* acc;  // [D]
};

}  // namespace meshserve_attention
