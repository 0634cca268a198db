// Paged decode attention for CPUs: each (sequence, kv head) pair reads its KV blocks in place, once
// per step; no gathered copy of the cache is ever made.
//
// Two passes per sequence: the scores of every cached key (reading the K blocks), one softmax over
// them, then the weighted sum of the values (reading the V blocks). Each pass streams one half of the
// cache block after block, and the softmax runs once over whole rows instead of once per block. The
// cache holds float32 or bf16 (half the bytes: decode attention is bound by reading the cache); a
// block's bf16 rows are widened to float32 once, in L1, and shared by all query heads of the group.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx2_math.h"

namespace tokenmill::attn {

#if defined(__AVX2__) && defined(__FMA__)
#define TM_ATTN_AVX2 1
#endif

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// ---------------------------------------------------------------- the inner loops, portable
// scores[t] = q . k[t] for the n keys of one block.
inline void block_scores(const float* q, const float* k, int64_t k_stride, int64_t n, int64_t head_dim,
                         float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    float s = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) s += q[d] * k[t * k_stride + d];
    scores[t] = s;
  }
}

// acc += sum_t p[t] * v[t].
inline void block_accumulate(float* acc, const float* p, const float* v, int64_t v_stride, int64_t n,
                             int64_t head_dim) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[t] * v[t * v_stride + d];
}

// p[t] <- exp(p[t] - max(p)) over a whole row; returns 1 / sum.
inline float softmax_row(float* p, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) max = std::max(max, p[t]);
  float sum = 0.0f;
  int64_t t = 0;
#ifdef TM_ATTN_AVX2
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = tokenmill::exp256(_mm256_sub_ps(_mm256_loadu_ps(p + t), m));
    _mm256_storeu_ps(p + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; t < n; ++t) {
    p[t] = std::exp(p[t] - max);
    sum += p[t];
  }
  return 1.0f / sum;
}

#ifdef TM_ATTN_AVX2
// ---------------------------------------------------------------- AVX2 versions (head_dim % 8 == 0)
// Eight vectors in, one out: lane j holds the sum of the lanes of v[j].
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

inline float sum_lanes(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline void block_scores_avx2(const float* q, const float* k, int64_t k_stride, int64_t n, int64_t head_dim,
                              float* scores) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {  // eight keys at a time, reduced together
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + (t + j) * k_stride + d), acc[j]);
    }
    _mm256_storeu_ps(scores + t, sum_lanes8(acc));
  }
  for (; t < n; ++t) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + t * k_stride + d), acc);
    scores[t] = sum_lanes(acc);
  }
}

inline void block_accumulate_avx2(float* acc, const float* p, const float* v, int64_t v_stride, int64_t n,
                                  int64_t head_dim) {
  int64_t d0 = 0;
  // 64 columns at a time: eight independent accumulators stay in registers across the block, so the
  // FMAs of one token do not wait on each other.
  for (; d0 + 64 <= head_dim; d0 += 64) {
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(acc + d0 + 8 * j);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pt = _mm256_broadcast_ss(p + t);
      const float* vt = v + t * v_stride + d0;
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * j), a[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
  }
  for (; d0 < head_dim; d0 += 8) {
    __m256 a = _mm256_loadu_ps(acc + d0);
    for (int64_t t = 0; t < n; ++t)
      a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), _mm256_loadu_ps(v + t * v_stride + d0), a);
    _mm256_storeu_ps(acc + d0, a);
  }
}

// Eight bf16 values -> float32: a bf16 is the top half of a float32.
inline __m256 widen_bf16(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// One kv head's rows of a block as float32 [n][head_dim] with stride `stride`: float cache rows in
// place, bf16 rows widened into `buffer` (L1-resident, read again by every query head of the group).
template <typename T>
inline const float* block_rows(const T* src, int64_t n, int64_t head_dim, int64_t token_stride, float* buffer,
                               int64_t& stride) {
  if constexpr (std::is_same_v<T, float>) {
    stride = token_stride;
    return src;
  } else {
    for (int64_t t = 0; t < n; ++t) {
      int64_t d = 0;
#ifdef TM_ATTN_AVX2
      for (; d + 8 <= head_dim; d += 8)
        _mm256_storeu_ps(buffer + t * head_dim + d, widen_bf16(src + t * token_stride + d));
#endif
      for (; d < head_dim; ++d) buffer[t * head_dim + d] = to_float(src[t * token_stride + d]);
    }
    stride = head_dim;
    return buffer;
  }
}

// The item's rows of the next block: the blocks are scattered over the pool, beyond the reach of
// the hardware prefetcher.
template <typename T>
inline void prefetch_rows(const T* first, int64_t block_size, int64_t token_stride, int64_t row_bytes) {
  for (int64_t t = 0; t < block_size; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(first + t * token_stride) + b);
}

// Work items (sequence, or (sequence, kv-head group) with `splits` > 1) dealt to the threads longest
// first, each to the least loaded: sequences differ in length, and a static split of the item range
// would leave one thread waiting on another. Each item is computed the same way wherever it runs.
inline std::vector<std::vector<int64_t>> balance(const int32_t* seq_lens, int64_t num_seqs, int64_t splits,
                                                 int64_t block_size) {
  const int64_t num_items = num_seqs * splits;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::vector<int64_t> order(num_items);
  for (int64_t i = 0; i < num_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return seq_lens[a / splits] > seq_lens[b / splits]; });
  std::vector<std::vector<int64_t>> plan(workers);
  std::vector<int64_t> load(workers, 0);
  for (const int64_t item : order) {
    const int64_t w = std::min_element(load.begin(), load.end()) - load.begin();
    plan[w].push_back(item);
    load[w] += std::max<int32_t>(seq_lens[item / splits], 0) + block_size;  // + a block: per-item overhead
  }
  return plan;
}

template <typename T>
inline void decode(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                   const int32_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between tokens of one block
  const int64_t block_stride = block_size * token_stride;
#ifdef TM_ATTN_AVX2
  const bool vectorized = head_dim % 8 == 0;
#endif
  const auto scores_of = [&](const float* qg, const float* k, int64_t stride, int64_t n, float* s) {
#ifdef TM_ATTN_AVX2
    if (vectorized) return block_scores_avx2(qg, k, stride, n, head_dim, s);
#endif
    block_scores(qg, k, stride, n, head_dim, s);
  };
  const auto accumulate = [&](float* acc, const float* p, const float* v, int64_t stride, int64_t n) {
#ifdef TM_ATTN_AVX2
    if (vectorized) return block_accumulate_avx2(acc, p, v, stride, n, head_dim);
#endif
    block_accumulate(acc, p, v, stride, n, head_dim);
  };
  // Work items are sequences; with few sequences, (sequence, kv head) pairs, so every thread has work.
  const int64_t splits = num_seqs >= 4 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_item = num_kv_heads / splits;
  const std::vector<std::vector<int64_t>> plan = balance(seq_lens, num_seqs, splits, block_size);
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 1, [&](int64_t begin, int64_t end) {
    const int64_t item_heads = heads_per_item * group;  // query heads of one item
    std::vector<float> qf(item_heads * head_dim), acc(item_heads * head_dim), buffer(block_size * head_dim),
        inv_sum(item_heads), scores;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (const int64_t item : plan[worker]) {
        const int64_t seq = item / splits, kv_head0 = (item % splits) * heads_per_item;
        const int64_t seq_len = seq_lens[seq];
        float* out_item = out + (seq * num_heads + kv_head0 * group) * head_dim;
        if (seq_len <= 0) {  // nothing to attend to (never scheduled): zeros, not NaN
          std::fill(out_item, out_item + item_heads * head_dim, 0.0f);
          continue;
        }
        const float* q_item = q + (seq * num_heads + kv_head0 * group) * head_dim;
        for (int64_t i = 0; i < item_heads * head_dim; ++i) qf[i] = q_item[i] * scale;
        const int32_t* table = block_tables + seq * max_blocks;
        const int64_t num_blocks = (seq_len + block_size - 1) / block_size, padded = num_blocks * block_size;
        const int64_t row_bytes = heads_per_item * head_dim * sizeof(T);  // one token's rows for the item
        const int64_t head_offset = kv_head0 * head_dim;
        scores.resize(item_heads * padded);  // [item_heads, padded]
        // One half of the cache (K or V), block by block: each kv head's rows as float32, handed with the
        // block's index to `use(g, rows, stride, n, j)` for every query head g of its group.
        const auto walk = [&](const T* half, auto&& use) {
          for (int64_t j = 0; j < num_blocks; ++j) {
            const int64_t n = std::min(block_size, seq_len - j * block_size);
            if (j + 1 < num_blocks)
              prefetch_rows(half + table[j + 1] * block_stride + head_offset, block_size, token_stride, row_bytes);
            for (int64_t h = 0; h < heads_per_item; ++h) {
              int64_t stride;
              const float* rows = block_rows(half + table[j] * block_stride + head_offset + h * head_dim, n,
                                             head_dim, token_stride, buffer.data(), stride);
              for (int64_t g = h * group; g < (h + 1) * group; ++g) use(g, rows, stride, n, j);
            }
          }
        };
        // Pass 1: every key's score.
        walk(k_cache, [&](int64_t g, const float* k, int64_t stride, int64_t n, int64_t j) {
          scores_of(qf.data() + g * head_dim, k, stride, n, scores.data() + g * padded + j * block_size);
        });
        for (int64_t g = 0; g < item_heads; ++g) inv_sum[g] = softmax_row(scores.data() + g * padded, seq_len);
        // Pass 2: the probability-weighted values.
        std::fill(acc.begin(), acc.end(), 0.0f);
        walk(v_cache, [&](int64_t g, const float* v, int64_t stride, int64_t n, int64_t j) {
          accumulate(acc.data() + g * head_dim, scores.data() + g * padded + j * block_size, v, stride, n);
        });
        for (int64_t g = 0; g < item_heads; ++g)
          for (int64_t d = 0; d < head_dim; ++d) out_item[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
      }
    }
  });
}

// q: [num_seqs, num_heads, head_dim] (computed in float32); kv_cache: [2, num_blocks, block_size, Hkv, D]
// float32 or bfloat16; block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32.
// Returns like q.
inline torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.is_contiguous(),
              "q: [num_seqs, num_heads, head_dim]; kv_cache: contiguous [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0 && q.size(2) == kv_cache.size(4),
              "query heads must be a multiple of KV heads, of the same head_dim");
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto qf = q.to(at::kFloat).contiguous();
  auto out = torch::empty_like(qf);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t cache_half = kv_cache.size(1) * block_size * num_kv_heads * head_dim;
  const auto run = [&](const auto* cache) {
    decode(qf.data_ptr<float>(), cache, cache + cache_half, tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
           out.data_ptr<float>(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.size(1),
           static_cast<float>(scale));
  };
  if (kv_cache.scalar_type() == at::kFloat) run(kv_cache.data_ptr<float>());
  else if (kv_cache.scalar_type() == at::kBFloat16) run(kv_cache.data_ptr<at::BFloat16>());
  else TORCH_CHECK(false, "kv_cache must be float32 or bfloat16, got ", kv_cache.scalar_type());
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

}  // namespace tokenmill::attn
