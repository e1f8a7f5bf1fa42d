// Paged attention on the CPU for one step's batch, prefills and decodes mixed.
//
// One call per layer writes the step's new keys and values into the paged KV cache in place
// (through the slot mapping) and attends every query token over its sequence's cached context
// (through the block table), reading the blocks where they are: no gathered copy of K/V, and
// grouped-query attention without repeating KV heads (the query heads of one KV head share every
// key and value load).
//
// Cache layout, per layer: keys [num_blocks, kv_heads, head_dim, block_size] (a block's keys
// transposed, so the scores of 16 keys are one vector FMA per head dimension) and values
// [num_blocks, kv_heads, block_size, head_dim]. Arithmetic is fp32 whatever the cache dtype,
// with an online softmax over blocks. Built with -ffast-math: no infinities are used (kHuge).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Stores key/value [T, Hkv, D] at their slots; a negative slot is a padding token.
template <typename scalar_t>
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t block_size = k_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  scalar_t* kc = k_cache.data_ptr<scalar_t>();
  scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1);
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = (block * heads + h) * block_size * dim;
        const scalar_t* kt = k + t * ks0 + h * ks1;
        for (int64_t d = 0; d < dim; ++d) kc[base + d * block_size + offset] = kt[d];
        std::copy(v + t * vs0 + h * vs1, v + t * vs0 + h * vs1 + dim, vc + base + offset * dim);
      }
    }
  });
}

constexpr int64_t kQueryTile = 16;
// Finite stand-in for -inf: the kernel is built with -ffast-math, which assumes no infinities.
constexpr float kHuge = 1e30f;

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


// Lanes of one accumulator kept in a register (one AVX-512 register of fp32, or two AVX2 ones).
constexpr int64_t kLanes = 16;
constexpr int64_t kRowGroup = 4;  // query rows that share each key and value load

// Online-softmax state of one query row.
struct RowState {
  float max;
  float sum;
  float* acc;  // [D]
};

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
  for (int r = 0; r < RB; ++r) {
    float* pr = p + r * block_size;
    float block_max = -kHuge;
    for (int64_t i = lo[r]; i <= hi[r]; ++i) block_max = std::max(block_max, pr[i]);
    const float new_max = std::max(rows[r].max, block_max);
    const float correction = expf(rows[r].max - new_max);
    float sum = 0.f;
    const int64_t l = lo[r], h = hi[r];
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < block_size; ++i) {
      const float e = (i >= l && i <= h) ? expf(pr[i] - new_max) : 0.f;
      pr[i] = e;
      sum += e;
    }
    rows[r].max = new_max;
    rows[r].sum = rows[r].sum * correction + sum;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) rows[r].acc[d] *= correction;
  }
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

template <typename scalar_t>
void attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start_loc,
            const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = k_cache.size(1), block_size = k_cache.size(3);
  const int64_t group = num_heads / kv_heads;
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t block_elems = block_size * dim;

  // Work items: (sequence, kv head, tile of query tokens).
  std::vector<int64_t> item_seq, item_tile;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    for (int64_t tile = 0; tile < q_len; tile += kQueryTile) {
      item_seq.push_back(s);
      item_tile.push_back(tile);
    }
  }
  const int64_t items = static_cast<int64_t>(item_seq.size()) * kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows_max = kQueryTile * group;
    std::vector<float> qf(rows_max * dim), acc(rows_max * dim);
    std::vector<RowState> state(rows_max);
    std::vector<const float*> qrow(rows_max);
    std::vector<int64_t> lo(rows_max), hi(rows_max);
    std::vector<float> p(kRowGroup * block_size), kbuf(block_elems), vbuf(block_elems);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % kv_heads, w = item / kv_heads;
      const int64_t s = item_seq[w], tile = item_tile[w];
      const int64_t q_start = starts[s], q_len = starts[s + 1] - q_start;
      const int64_t first_pos = lens[s] - q_len + tile;  // position of the tile's first query
      const int64_t tile_len = std::min(kQueryTile, q_len - tile);
      const int64_t rows = tile_len * group;  // row j * group + g: query j, head h * group + g
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = r / group, g = r % group;
        const scalar_t* src = q + (q_start + tile + j) * qs0 + (h * group + g) * qs1;
        float* dst = qf.data() + r * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]) * static_cast<float>(scale);
        qrow[r] = dst;
        state[r] = {-kHuge, 0.f, acc.data() + r * dim};
        std::fill(state[r].acc, state[r].acc + dim, 0.f);
      }
      const int64_t last = first_pos + tile_len - 1;  // the last key any row of the tile sees
      const int64_t first = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const int32_t* table = tables + s * max_blocks;
      for (int64_t b = first / block_size; b * block_size <= last; ++b) {
        const int64_t offset = (static_cast<int64_t>(table[b]) * kv_heads + h) * block_elems;
        const float* keys = as_float(kc + offset, block_elems, kbuf.data());  // [D, B]
        const float* values = as_float(vc + offset, block_elems, vbuf.data());  // [B, D]
        const int64_t key0 = b * block_size;
        for (int64_t r = 0; r < rows; ++r) {  // each row's visible keys, block-relative
          const int64_t pos = first_pos + r / group;
          hi[r] = std::min(pos - key0, block_size - 1);
          lo[r] = window > 0 ? std::max<int64_t>(0, pos - window + 1 - key0) : 0;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
          rows_block(std::min(kRowGroup, rows - r0), qrow.data() + r0, keys, values, dim,
                     block_size, lo.data() + r0, hi.data() + r0, state.data() + r0, p.data());
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = r / group, g = r % group;
        scalar_t* dst = o + (q_start + tile + j) * os0 + (h * group + g) * os1;
        const float inv = state[r].sum > 0.f ? 1.f / state[r].sum : 0.f;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(state[r].acc[d] * inv);
      }
    }
  });
}

}  // namespace

// Writes key/value [T, Hkv, D] at slot_mapping [T] into the caches [N, Hkv, B, D], then attends
// query [T, H, D] over each sequence's cached context; returns [T, H, D].
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "paged_attention: query, key and value must be [tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "paged_attention: head_dim must be the innermost, contiguous dimension");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == query.scalar_type() &&
                  key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              "paged_attention: query, key, value and the caches must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt,
              "paged_attention: slot_mapping, query_start_loc and seq_lens are int64, "
              "block_tables int32");
  TORCH_CHECK(block_tables.is_contiguous() && query_start_loc.is_contiguous() &&
                  seq_lens.is_contiguous() && slot_mapping.is_contiguous(),
              "paged_attention: the step's metadata must be contiguous");
  TORCH_CHECK(query.size(1) % k_cache.size(1) == 0,
              "paged_attention: the query heads must be a multiple of the KV heads");
  auto out = at::zeros_like(query, query.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    write_kv<scalar_t>(key, value, k_cache, v_cache, slot_mapping);
    attend<scalar_t>(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                     window, out);
  });
  return out;
}

TORCH_LIBRARY(meshserve_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
