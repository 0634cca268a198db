// Paged decode attention for CPUs: each (sequence, kv head) pair reads its KV blocks in place,
// once per step, with an online softmax; no gathered copy of the cache is ever made.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <limits>
#include <vector>

#include "avx2_math.h"

namespace tokenmill::attn {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// ---------------------------------------------------------------- the three inner loops, portable
// Scores of one query head against a block's keys: scores[t] = q . k[t].
inline void block_scores(const float* q, const float* k, int64_t k_stride, int64_t n, int64_t head_dim,
                         float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    float s = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) s += q[d] * k[t * k_stride + d];
    scores[t] = s;
  }
}

// scores[t] <- exp(scores[t] - max), for values <= 0 after the shift; returns their sum.
inline float block_exp(float* scores, int64_t n, float max) {
  float sum = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max);
    sum += scores[t];
  }
  return sum;
}

// acc <- acc * correction + sum_t p[t] * v[t].
inline void block_accumulate(float* acc, float correction, const float* p, const float* v, int64_t v_stride,
                             int64_t n, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[t] * v[t * v_stride + d];
}

#if defined(__AVX2__) && defined(__FMA__)
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

inline float block_exp_avx2(float* scores, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 p = tokenmill::exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t), m));
    _mm256_storeu_ps(scores + t, p);
    sum = _mm256_add_ps(sum, p);
  }
  float total = sum_lanes(sum);
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max);
    total += scores[t];
  }
  return total;
}

inline void block_accumulate_avx2(float* acc, float correction, const float* p, const float* v, int64_t v_stride,
                                  int64_t n, int64_t head_dim) {
  const __m256 c = _mm256_set1_ps(correction);
  int64_t d0 = 0;
  // 64 columns at a time: eight independent accumulators stay in registers across the block, so the
  // FMAs of one token do not wait on each other.
  for (; d0 + 64 <= head_dim; d0 += 64) {
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * j), c);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pt = _mm256_broadcast_ss(p + t);
      const float* vt = v + t * v_stride + d0;
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * j), a[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
  }
  for (; d0 < head_dim; d0 += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d0), c);
    for (int64_t t = 0; t < n; ++t) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), _mm256_loadu_ps(v + t * v_stride + d0), a);
    _mm256_storeu_ps(acc + d0, a);
  }
}
#endif

// Keys or values of one block as float rows [num_tokens][head_dim]: for float the cache rows
// themselves (no copy), otherwise converted into `buffer`. Returns the row pointer and row stride.
template <typename T>
inline std::pair<const float*, int64_t> block_rows(const T* src, int64_t num_tokens, int64_t head_dim,
                                                   int64_t token_stride, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return {src, token_stride};
  } else {
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t d = 0; d < head_dim; ++d) buffer[t * head_dim + d] = to_float(src[t * token_stride + d]);
    return {buffer, head_dim};
  }
}

template <typename T>
inline void decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
            const int32_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between tokens of one block
  const int64_t block_stride = block_size * token_stride;
#if defined(__AVX2__) && defined(__FMA__)
  const bool vectorized = head_dim % 8 == 0;
#else
  const bool vectorized = false;
#endif
  // Work items are sequences; with few sequences, (sequence, kv head) pairs, so every thread has work.
  // A sequence's item walks its blocks in order and reads each block's rows for all its heads at once:
  // contiguous memory, with the next block prefetched (the blocks are scattered over the pool).
  const int64_t splits = num_seqs >= 4 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_item = num_kv_heads / splits;
  at::parallel_for(0, num_seqs * splits, 1, [&](int64_t begin, int64_t end) {
    const int64_t item_heads = heads_per_item * group;  // query heads of one item
    std::vector<float> qf(item_heads * head_dim), acc(item_heads * head_dim), kbuf(block_size * head_dim),
        vbuf(block_size * head_dim), scores(block_size), row_max(item_heads), row_sum(item_heads);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / splits, kv_head0 = (item % splits) * heads_per_item;
      const int64_t seq_len = seq_lens[seq];
      const T* q_item = q + (seq * num_heads + kv_head0 * group) * head_dim;
      for (int64_t i = 0; i < item_heads * head_dim; ++i) qf[i] = to_float(q_item[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), 0.0f);
      const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
      const int64_t row_bytes = heads_per_item * head_dim * sizeof(T);  // one token's rows for the item
      for (int64_t j = 0; j < num_blocks; ++j) {
        const int64_t block = block_tables[seq * max_blocks + j];
        const int64_t n = std::min(block_size, seq_len - j * block_size);
        if (j + 1 < num_blocks) {
          const int64_t next = block_tables[seq * max_blocks + j + 1] * block_stride + kv_head0 * head_dim;
          for (int64_t t = 0; t < block_size; ++t)
            for (int64_t b = 0; b < row_bytes; b += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(k_cache + next + t * token_stride) + b);
              __builtin_prefetch(reinterpret_cast<const char*>(v_cache + next + t * token_stride) + b);
            }
        }
        for (int64_t h = 0; h < heads_per_item; ++h) {
          const int64_t offset = block * block_stride + (kv_head0 + h) * head_dim;
          // The block's keys and values are read once for all query heads of the group (GQA).
          const auto [k_rows, k_stride] = block_rows(k_cache + offset, n, head_dim, token_stride, kbuf.data());
          const auto [v_rows, v_stride] = block_rows(v_cache + offset, n, head_dim, token_stride, vbuf.data());
          for (int64_t g = h * group; g < (h + 1) * group; ++g) {
            float* sg = scores.data();
            const float* qg = qf.data() + g * head_dim;
            float* ag = acc.data() + g * head_dim;
#if defined(__AVX2__) && defined(__FMA__)
            if (vectorized) block_scores_avx2(qg, k_rows, k_stride, n, head_dim, sg);
            else
#endif
              block_scores(qg, k_rows, k_stride, n, head_dim, sg);
            const float new_max = std::max(row_max[g], *std::max_element(sg, sg + n));
            const float correction = std::exp(row_max[g] - new_max);  // 0 on the first block
            float block_sum;
#if defined(__AVX2__) && defined(__FMA__)
            if (vectorized) {
              block_sum = block_exp_avx2(sg, n, new_max);
              block_accumulate_avx2(ag, correction, sg, v_rows, v_stride, n, head_dim);
            } else
#endif
            {
              block_sum = block_exp(sg, n, new_max);
              block_accumulate(ag, correction, sg, v_rows, v_stride, n, head_dim);
            }
            row_sum[g] = row_sum[g] * correction + block_sum;
            row_max[g] = new_max;
          }
        }
      }
      T* out_item = out + (seq * num_heads + kv_head0 * group) * head_dim;
      for (int64_t g = 0; g < item_heads; ++g) {
        const float inv = 1.0f / row_sum[g];
        for (int64_t d = 0; d < head_dim; ++d) out_item[g * head_dim + d] = T(acc[g * head_dim + d] * inv);
      }
    }
  });
}

// q: [num_seqs, num_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32. Returns like q.
inline torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "q and kv_cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "query heads must be a multiple of KV heads");
  auto out = torch::empty_like(q);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t cache_half = kv_cache.size(1) * block_size * num_kv_heads * head_dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
    decode<scalar_t>(q.data_ptr<scalar_t>(), cache, cache + cache_half, tables.data_ptr<int32_t>(),
                     lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads,
                     head_dim, block_size, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

}  // namespace tokenmill::attn
