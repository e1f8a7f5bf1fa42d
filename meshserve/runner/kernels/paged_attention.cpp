// Paged attention on the CPU for one step's batch, prefills and decodes mixed.
//
// One call per layer writes the step's new keys and values into the paged KV cache in place
// (through the slot mapping) and attends every query token over its sequence's cached context
// (through the block table), reading the blocks where they are: no gathered copy of K/V, and
// grouped-query attention without repeating KV heads (the query heads of one KV head share every
// key and value load). The softmax is an online one over runs of blocks. Built with -ffast-math: no
// infinities are used (kHuge).
//
// Cache tensors, per layer: keys [num_blocks, kv_heads, head_dim, block_size] and values
// [num_blocks, kv_heads, block_size, head_dim]. Three arithmetics read them (``arithmetic`` says
// which one a cache of a given dtype and shape gets on this machine):
// - TileRows (tile_rows.h), for bf16 where the CPU has AMX and Linux grants it: bf16 products on
//   tiles, with each block kept "paired" (keys [D/2, B, 2], values [B/2, D, 2] within the block's
//   memory: the tile instructions' operand layout);
// - PairRows (pair_rows.h), for bf16 where the CPU has AVX-512 BF16 but no AMX: the same paired
//   blocks, multiplied a pair of bf16 values at a time into fp32 vectors;
// - FloatRows (float_rows.h) for everything else: fp32 arithmetic, keys stored [D, B] and values
//   [B, D] as the shapes say.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "float_rows.h"
#include "pair_rows.h"
#include "row_state.h"
#include "tile_rows.h"

namespace {

using namespace meshserve_attention;

// Stores key/value [T, Hkv, D] at their slots; a negative slot is a padding token. A paired
// cache keeps a block's keys as [D/2, B, 2] and its values as [B/2, D, 2] (see TileRows).
template <typename scalar_t>
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slot_mapping, bool paired) {
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
        const scalar_t* vt = v + t * vs0 + h * vs1;
        if (paired) {
          for (int64_t d = 0; d < dim; ++d) {
            kc[base + ((d / 2) * block_size + offset) * 2 + d % 2] = kt[d];
            vc[base + ((offset / 2) * dim + d) * 2 + offset % 2] = vt[d];
          }
        } else {
          for (int64_t d = 0; d < dim; ++d) kc[base + d * block_size + offset] = kt[d];
          std::copy(vt, vt + dim, vc + base + offset * dim);
        }
      }
    }
  });
}

constexpr int64_t kQueryTile = 16;

// Attends every query token over its sequence's blocks with the arithmetic of ``Rows``
// (FloatRows, PairRows or TileRows). Work items are (sequence, kv head, tile of query tokens); a
// tile's rows are its tokens times the query heads of the kv head, so they share every block read.
template <typename scalar_t, typename Rows>
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

  // A tile of up to kQueryTile query tokens of one sequence and the blocks its rows read.
  struct QueryTile {
    int64_t seq, token, pos, len;  // its first token's index in the step and position; tokens
    int64_t first_block, end_block;  // [first_block, end_block) of the sequence's block table
  };
  std::vector<QueryTile> tiles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    for (int64_t tile = 0; tile < q_len; tile += kQueryTile) {
      const int64_t pos = lens[s] - q_len + tile, len = std::min(kQueryTile, q_len - tile);
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      tiles.push_back({s, starts[s] + tile, pos, len, first / block_size,
                       (pos + len - 1) / block_size + 1});
    }
  }
  // Work items are (tile, kv head). Each thread takes one run of items of about equal cost
  // (blocks read times rows, plus a tile's fixed share), not of equal count: a step's sequences
  // differ in context length, and an even split by count leaves one thread idle at the end while
  // the other finishes.
  const int64_t items = static_cast<int64_t>(tiles.size()) * kv_heads;
  std::vector<int64_t> cost_before(items + 1, 0);
  for (int64_t item = 0; item < items; ++item) {
    const QueryTile& tile = tiles[item / kv_heads];
    cost_before[item + 1] = cost_before[item] + (tile.end_block - tile.first_block) *
                                                    (tile.len * group + kQueryTile);
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> run_start(threads + 1, items);
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t share = cost_before[items] * t / threads;
    run_start[t] = std::lower_bound(cost_before.begin(), cost_before.end() - 1, share) -
                   cost_before.begin();
  }
  at::parallel_for(0, threads, 1, [&](int64_t first_run, int64_t end_run) {
    const int64_t rows_max = kQueryTile * group;
    Rows math(rows_max, dim, block_size, static_cast<float>(scale));
    std::vector<float> acc(rows_max * dim);
    std::vector<RowState> state(rows_max);
    std::vector<int64_t> lo(kRunBlocks * rows_max), hi(kRunBlocks * rows_max);
    BlockRun<scalar_t> run{{}, {}, 0, lo.data(), hi.data(), rows_max};
    for (int64_t item = run_start[first_run]; item < run_start[end_run]; ++item) {
      const int64_t h = item % kv_heads;
      const QueryTile& tile = tiles[item / kv_heads];
      const int64_t rows = tile.len * group;  // row j * group + g: query j, head h * group + g
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = r / group, g = r % group;
        math.load_row(r, q + (tile.token + j) * qs0 + (h * group + g) * qs1);
        state[r] = {-kHuge, 0.f, acc.data() + r * dim};
        std::fill(state[r].acc, state[r].acc + dim, 0.f);
      }
      const int32_t* table = tables + tile.seq * max_blocks;
      // Runs end at multiples of kRunBlocks of the sequence's blocks, whatever the tile: where
      // a run ends is part of a row's arithmetic on paired blocks (see TileRows::run).
      for (int64_t b0 = tile.first_block; b0 < tile.end_block; b0 += run.count) {
        run.count = std::min((b0 / kRunBlocks + 1) * kRunBlocks, tile.end_block) - b0;
        for (int64_t c = 0; c < run.count; ++c) {
          const int64_t b = b0 + c;
          const int64_t offset = (static_cast<int64_t>(table[b]) * kv_heads + h) * block_elems;
          run.keys[c] = kc + offset;
          run.values[c] = vc + offset;
          const int64_t key0 = b * block_size;
          for (int64_t j = 0; j < tile.len; ++j) {  // each row's visible keys, block-relative
            const int64_t pos = tile.pos + j;
            const int64_t last = std::min(pos - key0, block_size - 1);
            const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1 - key0) : 0;
            std::fill_n(hi.data() + c * rows_max + j * group, group, last);
            std::fill_n(lo.data() + c * rows_max + j * group, group, first);
          }
        }
        math.run(run, rows, state.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = r / group, g = r % group;
        scalar_t* dst = o + (tile.token + j) * os0 + (h * group + g) * os1;
        const float inv = state[r].sum > 0.f ? 1.f / state[r].sum : 0.f;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(state[r].acc[d] * inv);
      }
    }
  });
}

// The arithmetics, slowest first (their names are kArithmetics'); floats keeps blocks as the
// shapes say, the other two paired.
enum Arithmetic : int64_t { kFloats = 0, kPairs = 1, kTiles = 2 };
const char* const kArithmetics[] = {"floats", "pairs", "tiles"};

// The fastest arithmetic ``MESHSERVE_CPU_ATTENTION`` allows (unset or "auto": any); read once
// per process, so every cache of the process keeps one layout.
Arithmetic arithmetic_cap() {
  static const Arithmetic cap = [] {
    const char* asked = std::getenv("MESHSERVE_CPU_ATTENTION");
    if (asked == nullptr || *asked == '\0' || std::string(asked) == "auto") return kTiles;
    int64_t i = kFloats;
    while (i <= kTiles && std::string(asked) != kArithmetics[i]) ++i;
    TORCH_CHECK(i <= kTiles, "MESHSERVE_CPU_ATTENTION must be auto, tiles, pairs or floats, got '",
                asked, "'");
    return static_cast<Arithmetic>(i);
  }();
  return cap;
}

// The arithmetic that attends a cache of this dtype and shape here: kTiles (TileRows) or kPairs
// (PairRows), both on paired blocks, or kFloats (FloatRows); the fastest the CPU and Linux
// offer, no faster than MESHSERVE_CPU_ATTENTION allows.
Arithmetic arithmetic_for(at::ScalarType dtype, int64_t head_dim, int64_t block_size) {
  Arithmetic best = kFloats;
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16 && PairRows::fits(head_dim, block_size)) {
    best = kPairs;
#if defined(__AMX_BF16__)
    if (amx_permitted()) best = kTiles;
#endif
  }
#endif
  return std::min(best, arithmetic_cap());
}

// ``arithmetic_for`` by name, for Python (``ops.arithmetic``).
std::string arithmetic(at::ScalarType dtype, int64_t head_dim, int64_t block_size) {
  return kArithmetics[arithmetic_for(dtype, head_dim, block_size)];
}

template <typename scalar_t>
void attend_any(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out,
                Arithmetic kind) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
#if defined(__AMX_BF16__)
    if (kind == kTiles) {
      return attend<scalar_t, TileRows>(query, k_cache, v_cache, block_tables, query_start_loc,
                                        seq_lens, scale, window, out);
    }
#endif
    if (kind == kPairs) {
      return attend<scalar_t, PairRows>(query, k_cache, v_cache, block_tables, query_start_loc,
                                        seq_lens, scale, window, out);
    }
  }
#endif
  attend<scalar_t, FloatRows<scalar_t>>(query, k_cache, v_cache, block_tables, query_start_loc,
                                        seq_lens, scale, window, out);
}

}  // namespace

// Writes key/value [T, Hkv, D] at slot_mapping [T] into the caches (see the top), then attends
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
  const Arithmetic kind = arithmetic_for(query.scalar_type(), query.size(2), k_cache.size(3));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    write_kv<scalar_t>(key, value, k_cache, v_cache, slot_mapping, kind != kFloats);
    attend_any<scalar_t>(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                         scale, window, out, kind);
  });
  return out;
}

namespace {

// Every layer's cache by the id its layer passes to ``layer_attention``, held weakly: the runner
// that allocated the caches owns them, and an engine that is dropped frees its caches although
// their ids stay here (until the next registration sweeps them).
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
struct LayerCache {
  WeakTensor keys, values;
};
std::mutex caches_lock;
std::unordered_map<int64_t, LayerCache> caches;
int64_t next_cache_id = 0;

int64_t register_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  std::lock_guard<std::mutex> guard(caches_lock);
  for (auto it = caches.begin(); it != caches.end();) {
    it = it->second.keys.expired() ? caches.erase(it) : std::next(it);
  }
  const int64_t id = next_cache_id++;
  caches.emplace(id, LayerCache{WeakTensor(k_cache.getIntrusivePtr()),
                                WeakTensor(v_cache.getIntrusivePtr())});
  return id;
}

}  // namespace

// ``paged_attention`` on the cache registered as ``cache_id``: what a compiled forward calls, so
// that the cache is never among its graph's inputs (see ``ops.py``).
at::Tensor layer_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           int64_t cache_id, double scale, int64_t window) {
  at::Tensor k_cache, v_cache;
  {
    std::lock_guard<std::mutex> guard(caches_lock);
    const auto found = caches.find(cache_id);
    TORCH_CHECK(found != caches.end(), "paged_attention: no KV cache has id ", cache_id);
    k_cache = at::Tensor(found->second.keys.lock());
    v_cache = at::Tensor(found->second.values.lock());
  }
  TORCH_CHECK(k_cache.defined() && v_cache.defined(), "KV cache ", cache_id,
              " was freed while its model still runs");
  return paged_attention(query, key, value, k_cache, v_cache, slot_mapping, block_tables,
                         query_start_loc, seq_lens, scale, window);
}

TORCH_LIBRARY(meshserve_cpu, m) {
  m.def("arithmetic(ScalarType dtype, int head_dim, int block_size) -> str", &arithmetic);
  m.def("paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int window) -> Tensor");
  m.def("register_kv_cache(Tensor k_cache, Tensor v_cache) -> int", &register_kv_cache);
  m.def("layer_attention(Tensor query, Tensor key, Tensor value, Tensor slot_mapping, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, int cache_id, "
        "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("layer_attention", &layer_attention);
}
