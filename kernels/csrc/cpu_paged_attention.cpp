// Paged attention for the CPU, beside its torch reference in kernels/torch_paged_attention.py:
// the KV store (quantizing to int8 when the cache is int8) and decode attention, one query token per
// sequence over the sequence's blocks, for every sequence of a step in one call.
//
// Decode reads each cached key and value once and uses it for every query head of its group. Work
// items are sequences (or, with fewer sequences than threads, a sequence's KV heads), handed out
// dynamically to torch's own OpenMP threads (torch ships libgomp.so.1, so this library binds to the
// same runtime, not a second one): contexts differ in length, and a static split would leave one
// core idle.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace kvserve {
namespace {

constexpr float kInt8Max = 127.0f;

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  FloatVec acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(q + i) * load(k + i);
  float sum = horizontal_sum(acc);
  for (; i < n; ++i) sum += q[i] * to_float(k[i]);
  return sum;
}

template <typename T>
inline void add_scaled(float a, const T* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    store(y + i, load(y + i) + a * load(x + i));
  }
  for (; i < n; ++i) y[i] += a * to_float(x[i]);
}

// Where token `position` of a sequence sits in a [num_blocks, block_size, kv_heads, head_dim] cache.
struct CacheLayout {
  int64_t block_size, block_stride, slot_stride, head_stride;
  int64_t offset(const int32_t* block_table, int64_t position, int64_t head) const {
    const int64_t block = block_table[position / block_size];
    return block * block_stride + (position % block_size) * slot_stride + head * head_stride;
  }
};

// Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one: ask for it
// while the current one is computed. `first` is the next block's first position.
template <typename cache_t>
inline void prefetch_block(const cache_t* base, const CacheLayout& layout, const int32_t* table, int64_t first,
                           int64_t seq_len) {
  if (first >= seq_len) return;
  constexpr int64_t kLineBytes = 64;
  const int64_t num_rows = std::min(layout.block_size, seq_len - first);
  const char* start = reinterpret_cast<const char*>(base + layout.offset(table, first, 0));
  const int64_t num_bytes = num_rows * layout.slot_stride * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t byte = 0; byte < num_bytes; byte += kLineBytes) __builtin_prefetch(start + byte);
}

CacheLayout layout_of(const at::Tensor& cache) {
  return {cache.size(1), cache.stride(0), cache.stride(1), cache.stride(2)};
}

template <typename scalar_t, typename cache_t>
void decode(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, const float* key_scale, const float* value_scale,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2), group = num_heads / num_kv_heads;
  const CacheLayout keys = layout_of(key_cache), values = layout_of(value_cache);
  // Scales are [num_blocks, block_size, kv_heads], contiguous: the cache's layout without head_dim.
  const CacheLayout scales{keys.block_size, keys.block_size * num_kv_heads, num_kv_heads, 1};
  const scalar_t* q_base = query.data_ptr<scalar_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  const cache_t* k_base = key_cache.data_ptr<cache_t>();
  const cache_t* v_base = value_cache.data_ptr<cache_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const float score_scale = static_cast<float>(scale);

  // One work item per sequence: its blocks hold every KV head of a token side by side, so reading them all in one
  // pass walks each block front to back. With fewer sequences than threads (a single user), one per sequence and
  // KV head instead, so every thread has a share (a lone sequence took one of two cores).
  const int64_t threads = at::get_num_threads();
  const int64_t head_parts = num_seqs < threads ? num_kv_heads : 1;
  const int64_t kv_heads_per_item = num_kv_heads / head_parts;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < num_seqs * head_parts; ++item) {
    const int64_t seq = item / head_parts;
    const int64_t kv_first = item % head_parts * kv_heads_per_item, kv_end = kv_first + kv_heads_per_item;
    const int64_t h_first = kv_first * group, heads = kv_heads_per_item * group;
    const int64_t seq_len = lens[seq];
    const int32_t* table = tables + seq * table_stride;
    // Rows of q, scores and acc are this item's heads, h - h_first.
    std::vector<float> q(heads * head_dim), scores(heads * seq_len), acc(heads * head_dim, 0.f);
    std::vector<float> row_max(heads, -std::numeric_limits<float>::infinity()), row_sum(heads, 0.f);
    for (int64_t i = 0; i < heads; ++i) {
      const scalar_t* row = q_base + seq * query.stride(0) + (h_first + i) * query.stride(1);
      for (int64_t d = 0; d < head_dim; ++d) q[i * head_dim + d] = to_float(row[d]);
    }
    for (int64_t t = 0; t < seq_len; ++t) {
      if (t % keys.block_size == 0) prefetch_block(k_base, keys, table, t + keys.block_size, seq_len);
      for (int64_t kv_head = kv_first; kv_head < kv_end; ++kv_head) {
        const cache_t* k = k_base + keys.offset(table, t, kv_head);
        const float k_scale = key_scale ? key_scale[scales.offset(table, t, kv_head)] : 1.f;
        for (int64_t i = kv_head * group - h_first; i < (kv_head + 1) * group - h_first; ++i) {
          const float s = dot(q.data() + i * head_dim, k, head_dim) * score_scale * k_scale;
          scores[i * seq_len + t] = s;
          row_max[i] = std::max(row_max[i], s);
        }
      }
    }
    for (int64_t i = 0; i < heads; ++i) {
      float* s = scores.data() + i * seq_len;
      FloatVec vec_sum = {};
      int64_t t = 0;
      for (; t + kLanes <= seq_len; t += kLanes) {
        const FloatVec e = exp_nonpositive(load(s + t) - row_max[i]);
        std::memcpy(s + t, &e, sizeof e);
        vec_sum += e;
      }
      float sum = horizontal_sum(vec_sum);
      for (; t < seq_len; ++t) {
        s[t] = std::exp(s[t] - row_max[i]);
        sum += s[t];
      }
      row_sum[i] = sum;
    }
    for (int64_t t = 0; t < seq_len; ++t) {
      if (t % values.block_size == 0) prefetch_block(v_base, values, table, t + values.block_size, seq_len);
      for (int64_t kv_head = kv_first; kv_head < kv_end; ++kv_head) {
        const cache_t* v = v_base + values.offset(table, t, kv_head);
        const float v_scale = value_scale ? value_scale[scales.offset(table, t, kv_head)] : 1.f;
        for (int64_t i = kv_head * group - h_first; i < (kv_head + 1) * group - h_first; ++i) {
          add_scaled(scores[i * seq_len + t] * v_scale, v, acc.data() + i * head_dim, head_dim);
        }
      }
    }
    for (int64_t i = 0; i < heads; ++i) {
      scalar_t* row = out_base + seq * out.stride(0) + (h_first + i) * out.stride(1);
      for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<scalar_t>(acc[i * head_dim + d] / row_sum[i]);
    }
  }
}

void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const c10::optional<at::Tensor>& key_scale,
                            const c10::optional<at::Tensor>& value_scale, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && out.stride(2) == 1, "query/out: [seqs, heads, head_dim]");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "cache rows must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables and lens");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  const bool quantized = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == key_scale.has_value(), "an int8 cache, and only an int8 cache, has scales");
  const float* k_scale = quantized ? key_scale->data_ptr<float>() : nullptr;
  const float* v_scale = quantized ? value_scale->data_ptr<float>() : nullptr;
  KVSERVE_DISPATCH_MODEL_DTYPES(query.scalar_type(), "paged_decode_attention", [&] {
    if (quantized) {
      decode<scalar_t, int8_t>(out, query, key_cache, value_cache, k_scale, v_scale, block_tables, seq_lens, scale);
    } else {
      TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(), "cache dtype must be the query's, or int8");
      decode<scalar_t, scalar_t>(out, query, key_cache, value_cache, nullptr, nullptr, block_tables, seq_lens, scale);
    }
  });
}

// Rounding to nearest with halves away from zero, as quantize_per_token_head does.
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t n, int8_t* data, float* scale) {
  float absmax = 0.f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(to_float(x[i])));
  *scale = absmax / kInt8Max;
  const float divisor = *scale > 0.f ? *scale : 1.f;
  for (int64_t i = 0; i < n; ++i) {
    const float scaled = to_float(x[i]) / divisor;
    const float rounded = std::copysign(std::floor(std::fabs(scaled) + 0.5f), scaled);
    data[i] = static_cast<int8_t>(std::min(kInt8Max, std::max(-kInt8Max, rounded)));
  }
}

template <typename scalar_t>
void store(const at::Tensor& new_rows, const at::Tensor& cache, float* scales, const int64_t* slots) {
  const int64_t num_tokens = new_rows.size(0), num_kv_heads = new_rows.size(1), head_dim = new_rows.size(2);
  const int64_t block_size = cache.size(1);
  const scalar_t* src = new_rows.data_ptr<scalar_t>();
  const bool quantized = scales != nullptr;
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;  // padding rows
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const scalar_t* x = src + i * new_rows.stride(0) + h * new_rows.stride(1);
        const int64_t dst = block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2);
        if (quantized) {
          quantize_row(x, head_dim, cache.data_ptr<int8_t>() + dst, scales + slot * num_kv_heads + h);
        } else {
          std::copy(x, x + head_dim, cache.data_ptr<scalar_t>() + dst);
        }
      }
    }
  });
}

void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const c10::optional<at::Tensor>& key_scale,
              const c10::optional<at::Tensor>& value_scale, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1, "rows must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "int64 slot mapping");
  const bool quantized = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == key_scale.has_value(), "an int8 cache, and only an int8 cache, has scales");
  TORCH_CHECK(quantized || key_cache.scalar_type() == key.scalar_type(), "cache dtype must be the keys', or int8");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  KVSERVE_DISPATCH_MODEL_DTYPES(key.scalar_type(), "store_kv", [&] {
    store<scalar_t>(key, key_cache, quantized ? key_scale->data_ptr<float>() : nullptr, slots);
    store<scalar_t>(value, value_cache, quantized ? value_scale->data_ptr<float>() : nullptr, slots);
  });
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor? key_scale, Tensor? value_scale, Tensor block_tables, Tensor seq_lens, float scale) -> ()");
  m.def(
      "store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor(c!)? key_scale, "
      "Tensor(d!)? value_scale, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &kvserve::paged_decode_attention);
  m.impl("store_kv", &kvserve::store_kv);
}
