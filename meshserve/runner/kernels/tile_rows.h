// bf16 attention on AMX tiles: TileRows, which reads blocks kept paired (keys [D/2, B, 2], values
// [B/2, D, 2]: the tile instructions' operand layout, written so by the kernel's write_kv).
#pragma once

#if defined(__AVX512BF16__) && defined(__AMX_BF16__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "row_state.h"
#include "run_softmax.h"

namespace meshserve_attention {

// The AMX tile state is off until a process asks Linux for it; false where the kernel refuses.
inline bool amx_permitted() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;  // XFEATURE_XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return permitted;
}

// ldtilecfg's 64-byte operand (palette 1): bytes per row and rows of each tile register.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// bf16 queries and caches on AMX: for up to 16 query rows (n, the tiles configured for as many
// as an item has), the scores of 16 keys are one tile product per 32 head dimensions (queries
// [n, 32] times the keys paired over D), and the value sums one product per 16 keys and 16 head
// dimensions (probabilities [n, 16] times the values paired over keys). The softmax stays in
// AVX-512 between the two. Products of two bf16 values are exact in fp32; the probabilities are
// rounded to bf16 for the value sums, as flash attention does. Every row's arithmetic is its own
// and in a fixed order (a tile's rows do not mix), so a row's result depends on neither the tile
// nor the step it came in (given the runs, see run). One object per thread: it
// holds that thread's tile configuration until it is destroyed.
class TileRows {
 public:
  TileRows(int64_t rows_max, int64_t dim, int64_t block_size, float scale)
      : dim_(dim), block_size_(block_size), scale_(scale),
        q_((rows_max + kTile - 1) / kTile * kTile * dim),
        scores_(kTile * kRunBlocks * block_size), probs_(kTile * kRunBlocks * block_size),
        sums_(kTile * dim), correction_(kTile) {}
  ~TileRows() { _tile_release(); }  // so the kernel need not save 8 KB of tiles at every switch
  TileRows(const TileRows&) = delete;
  TileRows& operator=(const TileRows&) = delete;

  void load_row(int64_t r, const c10::BFloat16* src) {
    std::copy(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<const uint16_t*>(src) + dim_,
              q_.data() + r * dim_);
  }

  // A run of blocks in four passes, for up to 16 rows at a time: every 16 keys' scores (tile
  // products), then each row's softmax over the whole run, then the value sums of the run's
  // keys (one tile accumulation over all of them), then each row's rescale-and-add, once per
  // run. A row's result depends on which of its visible keys each run holds, and on nothing
  // else: attend aligns runs to the sequence's blocks, so a row meets the same runs in any tile
  // and step.
  void run(const BlockRun<c10::BFloat16>& blocks, int64_t rows, RowState* state) {
    const int64_t B = block_size_, D = dim_, count = blocks.count;
    const int64_t width = kRunBlocks * B;  // row stride of scores_ and probs_
    for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
      const int64_t n = std::min(kTile, rows - r0);
      fit_rows(n);
      for (int64_t c = 0; c < count; ++c) {  // scores [n, count * B]: rows x keys
        const uint16_t* keys = reinterpret_cast<const uint16_t*>(blocks.keys[c]);  // [D/2, B, 2]
        for (int64_t i0 = 0; i0 < B; i0 += kTile) {
          _tile_zero(0);
          for (int64_t d0 = 0; d0 < D; d0 += 2 * kTile) {
            _tile_loadd(1, q_.data() + r0 * D + d0, D * 2);
            _tile_loadd(2, keys + (d0 / 2 * B + i0) * 2, B * 4);
            _tile_dpbf16ps(0, 1, 2);
          }
          _tile_stored(0, scores_.data() + c * B + i0, width * 4);
        }
      }
      for (int64_t r = 0; r < n; ++r) {  // softmax over the run
        correction_[r] = fold_run_to_bf16(scores_.data() + r * width, scale_, B, count,
                                          blocks.lo + r0 + r, blocks.hi + r0 + r, blocks.stride,
                                          state[r0 + r], probs_.data() + r * width);
      }
      // Value sums [n, D]: rows x head dims, 64 at a time in four tiles (32 in two where D
      // leaves them), so that each 16 keys' probabilities load once for them all and the four
      // accumulations run side by side.
      for (int64_t d0 = 0; d0 < D; d0 += 4 * kTile) {
        const bool wide = D - d0 >= 4 * kTile;
        _tile_zero(0);
        _tile_zero(5);
        if (wide) {
          _tile_zero(6);
          _tile_zero(7);
        }
        for (int64_t c = 0; c < count; ++c) {
          // [B/2, D, 2]
          const uint16_t* values = reinterpret_cast<const uint16_t*>(blocks.values[c]);
          for (int64_t i0 = 0; i0 < B; i0 += kTile) {
            const uint16_t* pairs = values + (i0 / 2 * D + d0) * 2;  // 8 key pairs x 16 dims
            _tile_loadd(3, probs_.data() + c * B + i0, width * 2);
            _tile_loadd(4, pairs, D * 4);
            _tile_dpbf16ps(0, 3, 4);
            _tile_loadd(4, pairs + 2 * kTile, D * 4);
            _tile_dpbf16ps(5, 3, 4);
            if (wide) {
              _tile_loadd(4, pairs + 4 * kTile, D * 4);
              _tile_dpbf16ps(6, 3, 4);
              _tile_loadd(4, pairs + 6 * kTile, D * 4);
              _tile_dpbf16ps(7, 3, 4);
            }
          }
        }
        _tile_stored(0, sums_.data() + d0, D * 4);
        _tile_stored(5, sums_.data() + d0 + kTile, D * 4);
        if (wide) {
          _tile_stored(6, sums_.data() + d0 + 2 * kTile, D * 4);
          _tile_stored(7, sums_.data() + d0 + 3 * kTile, D * 4);
        }
      }
      for (int64_t r = 0; r < n; ++r) {  // acc = acc * correction + the run's sums
        float* acc = state[r0 + r].acc;
        const float* sums = sums_.data() + r * D;
        const __m512 f = _mm512_set1_ps(correction_[r]);
        for (int64_t d = 0; d < D; d += kLanes) {
          _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), f,
                                                    _mm512_loadu_ps(sums + d)));
        }
      }
    }
  }

 private:
  // Configures the tiles for ``m`` query rows: a decode's rows are its query heads per KV head
  // (3 for SmolLM2), and a tile of 16 rows would load, multiply and store 13 rows for nothing.
  // Rows never mix in a tile product, so a row's result is the same whatever ``m`` is.
  // Reconfiguring zeroes every tile, so it happens only when the row count changes.
  void fit_rows(int64_t m) {
    if (m == rows_) return;
    TileConfig config;
    for (const int t : {kScores, kQuery, kValueSums, kValueSums + 1, kValueSums + 2}) {
      config.colsb[t] = 64;
      config.rows[t] = static_cast<uint8_t>(m);
    }
    config.colsb[kKeys] = 64;
    config.rows[kKeys] = kTile;
    config.colsb[kProbs] = kTile * 2;  // 16 keys of bf16
    config.rows[kProbs] = static_cast<uint8_t>(m);
    config.colsb[kValues] = 64;
    config.rows[kValues] = kTile / 2;  // 8 pairs of keys
    _tile_loadconfig(&config);
    rows_ = m;
  }

  static constexpr int64_t kTile = 16;
  // Tile registers, written as literals in the tile instructions (their operands are register
  // names): 0 scores, 1 queries, 2 keys, 3 probabilities, 4 values, 5-7 (and 0, free by then)
  // value sums.
  static constexpr int kScores = 0, kQuery = 1, kKeys = 2, kProbs = 3, kValues = 4, kValueSums = 5;
  int64_t dim_, block_size_;
  float scale_;
  std::vector<uint16_t> q_;  // [rows, D] the tile's query rows, copied so tiles load them evenly
  std::vector<float> scores_;  // [16, run blocks * B]
  std::vector<uint16_t> probs_;  // [16, run blocks * B] bf16
  std::vector<float> sums_;  // [16, D]
  std::vector<float> correction_;  // [16]
  int64_t rows_ = 0;  // query rows the tiles are configured for (0: not yet)
};

}  // namespace meshserve_attention
#endif
