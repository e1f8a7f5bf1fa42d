// What every row-arithmetic of the CPU attention kernel shares: the online-softmax state of one
// query row, and the constants of its masking and vector width.
#pragma once

#include <cstdint>

namespace meshserve_attention {

// Finite stand-in for -inf: the kernel is built with -ffast-math, which assumes no infinities.
constexpr float kHuge = 1e30f;

// Lanes of one accumulator kept in a register (one AVX-512 register of fp32, or two AVX2 ones).
constexpr int64_t kLanes = 16;

// Online-softmax state of one query row.
struct RowState {
  float max;
  float sum;
  float* acc;  // [D]
};

}  // namespace meshserve_attention
