// Paged decode attention for CPUs: each (sequence, kv head) pair reads its KV blocks in place, once
// per step; no gathered copy of the cache is ever made.
//
// Two passes per sequence: the scores of every cached key (reading the K blocks), one softmax over
// them, then the weighted sum of the values (reading the V blocks). Each pass streams one half of the
// cache block after block, and the softmax runs once over whole rows instead of once per block. The
// cache holds float32 or bf16 (half the bytes: decode attention is bound by reading the cache). Each
// cache row is loaded (and bf16 widened) in registers once for up to three query heads of its GQA
// group, with no copy through a buffer.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"  // tile::switch_to
#include "avx2_math.h"

namespace tokenmill::attn {

#if defined(__AVX2__) && defined(__FMA__)
#define TM_ATTN_AVX2 1
#endif

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// Up to this many query heads of a GQA group are served by one read of a block's rows: with four
// keys (or 32 value columns) at a time their accumulators fill 12 of AVX2's 16 registers.
constexpr int64_t kHeadsPerPass = 3;
// Blocks requested ahead of the one being read: blocks may lie anywhere in the pool, where the
// hardware prefetcher cannot follow, and one block's work is shorter than a trip to memory.
constexpr int64_t kPrefetchBlocks = 2;
// With many sequences (the cache is read from memory), the key pass reads a block four tokens (all
// kv heads) at a time, in address order, which lets the hardware prefetcher run ahead where blocks
// lie side by side (head by head it cannot); it costs more instructions, so with few
// sequences (a working set that stays in cache) and in the value pass, whose accumulators stay in
// registers over a block, each head takes a whole block at a time.
constexpr int64_t kKeyRows = 4;

// ---------------------------------------------------------------- the inner loops, portable
// scores[g][t] = q[g] . k[t] for n keys of one block and the `heads` query heads of q.
template <typename T>
inline void block_scores(const float* q, int64_t heads, const T* k, int64_t k_stride, int64_t n, int64_t head_dim,
                         float* scores, int64_t scores_stride) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < heads; ++g) {
      float s = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) s += q[g * head_dim + d] * to_float(k[t * k_stride + d]);
      scores[g * scores_stride + t] = s;
    }
}

// acc[g] += sum_t p[g][t] * v[t].
template <typename T>
inline void block_accumulate(float* acc, int64_t heads, const float* p, int64_t p_stride, const T* v, int64_t v_stride,
                             int64_t n, int64_t head_dim) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < heads; ++g)
      for (int64_t d = 0; d < head_dim; ++d)
        acc[g * head_dim + d] += p[g * p_stride + t] * to_float(v[t * v_stride + d]);
}

// p[t] <- exp(p[t] - max(p)) over a whole row; returns 1 / sum.
inline float softmax_row(float* p, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#ifdef TM_ATTN_AVX2
  // Eight running maxima: a scalar max is a chain of dependent instructions, slower than the exps.
  __m256 lane_max = _mm256_set1_ps(max);
  for (; t + 8 <= n; t += 8) lane_max = _mm256_max_ps(lane_max, _mm256_loadu_ps(p + t));
  alignas(32) float maxima[8];
  _mm256_store_ps(maxima, lane_max);
  for (const float m : maxima) max = std::max(max, m);
#endif
  for (; t < n; ++t) max = std::max(max, p[t]);
  float sum = 0.0f;
  t = 0;
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
// Eight cache values as float32; a bf16 is the top half of a float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Four vectors in, one out: lane j holds the sum of the lanes of v[j].
inline __m128 sum_lanes4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

inline float sum_lanes(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// The scores of H query heads against n keys of one block, four keys at a time: each key row is
// loaded (and widened) once for all H heads, straight from the cache.
template <int H, typename T>
inline void block_scores_avx2(const float* q, const T* k, int64_t k_stride, int64_t n, int64_t head_dim, float* scores,
                              int64_t scores_stride) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m256 acc[H][4];
    for (int g = 0; g < H; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8)
      for (int j = 0; j < 4; ++j) {
        const __m256 kj = load8(k + (t + j) * k_stride + d);
        for (int g = 0; g < H; ++g) acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + d), kj, acc[g][j]);
      }
    for (int g = 0; g < H; ++g)
      _mm_storeu_ps(scores + g * scores_stride + t, sum_lanes4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  for (; t < n; ++t) {
    __m256 acc[H];
    for (int g = 0; g < H; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 kt = load8(k + t * k_stride + d);
      for (int g = 0; g < H; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + d), kt, acc[g]);
    }
    for (int g = 0; g < H; ++g) scores[g * scores_stride + t] = sum_lanes(acc[g]);
  }
}

// acc[g][d0, d0 + 8C) += sum_t p[g][t] * v[t][d0, d0 + 8C) for H heads: the accumulators stay in
// registers across the block and each value row is loaded (and widened) once for all H heads.
template <int H, int C, typename T>
inline void accumulate_columns(float* acc, const float* p, int64_t p_stride, const T* v, int64_t v_stride, int64_t n,
                               int64_t head_dim, int64_t d0) {
  __m256 a[H][C];
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm256_loadu_ps(acc + g * head_dim + d0 + 8 * c);
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = v + t * v_stride + d0;
    for (int c = 0; c < C; ++c) {
      const __m256 vc = load8(vt + 8 * c);
      for (int g = 0; g < H; ++g) a[g][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * p_stride + t), vc, a[g][c]);
    }
  }
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * head_dim + d0 + 8 * c, a[g][c]);
}

template <int H, typename T>
inline void block_accumulate_avx2(float* acc, const float* p, int64_t p_stride, const T* v, int64_t v_stride, int64_t n,
                                  int64_t head_dim) {
  int64_t d0 = 0;
  for (; d0 + 32 <= head_dim; d0 += 32) accumulate_columns<H, 4>(acc, p, p_stride, v, v_stride, n, head_dim, d0);
  for (; d0 < head_dim; d0 += 8) accumulate_columns<H, 1>(acc, p, p_stride, v, v_stride, n, head_dim, d0);
}

// Calls f(std::integral_constant<int, heads>) for heads in [1, kHeadsPerPass]: the AVX2 loops keep
// one register set per head, so the head count is a template argument.
template <typename F>
inline void with_heads(int64_t heads, F&& f) {
  static_assert(kHeadsPerPass == 3);
  if (heads == 3) return f(std::integral_constant<int, 3>{});
  if (heads == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}
#endif

// An item's rows of n tokens of one block, requested ahead of their use (see walk in decode): into L1
// (locality 3) or L2 (locality 1).
template <int Locality = 3, typename T>
inline void prefetch_rows(const T* first, int64_t n, int64_t token_stride, int64_t row_bytes) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(first + t * token_stride) + b, 0, Locality);
}

// Work items dealt to the threads costliest first, each to the least loaded: sequences differ in
// length, and a static split of the item range would leave one thread waiting on another. Each item
// is computed the same way wherever it runs.
inline std::vector<std::vector<int64_t>> balance(const std::vector<int64_t>& costs) {
  const int64_t num_items = static_cast<int64_t>(costs.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::vector<int64_t> order(num_items);
  for (int64_t i = 0; i < num_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::vector<std::vector<int64_t>> plan(workers);
  std::vector<int64_t> load(workers, 0);
  for (const int64_t item : order) {
    const int64_t w = std::min_element(load.begin(), load.end()) - load.begin();
    plan[w].push_back(item);
    load[w] += costs[item];
  }
  return plan;
}

// Items of whole sequences (or (sequence, kv-head group) with `splits` > 1), costing their length.
inline std::vector<std::vector<int64_t>> balance(const int32_t* seq_lens, int64_t num_seqs, int64_t splits,
                                                 int64_t block_size) {
  std::vector<int64_t> costs(num_seqs * splits);
  for (int64_t i = 0; i < num_seqs * splits; ++i)
    costs[i] = std::max<int32_t>(seq_lens[i / splits], 0) + block_size;  // + a block: per-item overhead
  return balance(costs);
}

// Starts an item of `num_heads` query heads: their queries times `scale` into qs. A sequence with no
// context (never scheduled) gets zeros, not NaN, and false.
inline bool start_item(const float* q_item, float scale, int64_t num_heads, int64_t head_dim, int64_t seq_len,
                       float* out_item, float* qs) {
  if (seq_len <= 0) {
    std::fill(out_item, out_item + num_heads * head_dim, 0.0f);
    return false;
  }
  for (int64_t i = 0; i < num_heads * head_dim; ++i) qs[i] = q_item[i] * scale;
  return true;
}

}  // namespace tokenmill::attn

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include "paged_attention_avx512.h"  // uses balance above
#define TM_ATTN_AVX512 1
#endif

namespace tokenmill::attn {

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
  // The scores of query heads q[0, heads) against one block's keys; heads <= kHeadsPerPass.
  const auto scores_of = [&](const float* qg, int64_t heads, const T* k, int64_t n, float* s, int64_t s_stride) {
#ifdef TM_ATTN_AVX2
    if (vectorized)
      return with_heads(heads, [&](auto h) { block_scores_avx2<h()>(qg, k, token_stride, n, head_dim, s, s_stride); });
#endif
    block_scores(qg, heads, k, token_stride, n, head_dim, s, s_stride);
  };
  const auto accumulate = [&](float* acc, int64_t heads, const float* p, int64_t p_stride, const T* v, int64_t n) {
#ifdef TM_ATTN_AVX2
    if (vectorized)
      return with_heads(heads,
                        [&](auto h) { block_accumulate_avx2<h()>(acc, p, p_stride, v, token_stride, n, head_dim); });
#endif
    block_accumulate(acc, heads, p, p_stride, v, token_stride, n, head_dim);
  };
  // Work items are sequences; with few sequences, (sequence, kv head) pairs, so every thread has work.
  const int64_t splits = num_seqs >= 4 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_item = num_kv_heads / splits;
  const int64_t key_step = splits == 1 ? kKeyRows : block_size;  // tokens per read of the key pass
  const std::vector<std::vector<int64_t>> plan = balance(seq_lens, num_seqs, splits, block_size);
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 1, [&](int64_t begin, int64_t end) {
    const int64_t item_heads = heads_per_item * group;  // query heads of one item
    std::vector<float> qf(item_heads * head_dim), acc(item_heads * head_dim), inv_sum(item_heads), scores;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (const int64_t item : plan[worker]) {
        const int64_t seq = item / splits, kv_head0 = (item % splits) * heads_per_item;
        const int64_t seq_len = seq_lens[seq], first = (seq * num_heads + kv_head0 * group) * head_dim;
        float* out_item = out + first;
        if (!start_item(q + first, scale, item_heads, head_dim, seq_len, out_item, qf.data())) continue;
        const int32_t* table = block_tables + seq * max_blocks;
        const int64_t num_blocks = (seq_len + block_size - 1) / block_size, padded = num_blocks * block_size;
        const int64_t row_bytes = heads_per_item * head_dim * sizeof(T);  // one token's rows for the item
        const int64_t head_offset = kv_head0 * head_dim;
        scores.resize(item_heads * padded);  // [item_heads, padded]
        // One half of the cache (K or V), block by block, `step` tokens at a time: each kv head's rows of
        // tokens [t, t + n) are handed to `use(g0, heads, rows, n, t)` once per pass over query heads
        // [g0, g0 + heads) of its group. Each step first requests the same rows kPrefetchBlocks blocks
        // ahead and, with `also` (the V half, during the K pass), the other half's rows of this step into
        // L2, so the value pass finds the context there. Requests go out a step's rows at a time, spread
        // over the compute: whole blocks at once stall the core on the few misses L1 tracks, and then
        // memory and compute take turns instead of overlapping (measured: half the bandwidth).
        const auto walk = [&](const T* half, int64_t step, const T* also, auto&& use) {
          const auto at = [&](const T* base, int64_t j, int64_t t0) {
            return base + table[j] * block_stride + t0 * token_stride + head_offset;
          };
          for (int64_t j = 0; j < std::min(kPrefetchBlocks, num_blocks); ++j)
            prefetch_rows(at(half, j, 0), block_size, token_stride, row_bytes);
          for (int64_t j = 0; j < num_blocks; ++j) {
            const int64_t n = std::min(block_size, seq_len - j * block_size);
            for (int64_t t0 = 0; t0 < n; t0 += step) {
              const int64_t rows_n = std::min(step, n - t0);
              if (j + kPrefetchBlocks < num_blocks)
                prefetch_rows(at(half, j + kPrefetchBlocks, t0), rows_n, token_stride, row_bytes);
              if (also != nullptr) prefetch_rows<1>(at(also, j, t0), rows_n, token_stride, row_bytes);
              for (int64_t h = 0; h < heads_per_item; ++h) {
                const T* rows = at(half, j, t0) + h * head_dim;
                for (int64_t g0 = h * group; g0 < (h + 1) * group; g0 += kHeadsPerPass)
                  use(g0, std::min(kHeadsPerPass, (h + 1) * group - g0), rows, rows_n, j * block_size + t0);
              }
            }
          }
        };
        // Pass 1: every key's score.
        walk(k_cache, key_step, v_cache, [&](int64_t g0, int64_t heads, const T* k, int64_t n, int64_t t) {
          scores_of(qf.data() + g0 * head_dim, heads, k, n, scores.data() + g0 * padded + t, padded);
        });
        for (int64_t g = 0; g < item_heads; ++g) inv_sum[g] = softmax_row(scores.data() + g * padded, seq_len);
        // Pass 2: the probability-weighted values.
        std::fill(acc.begin(), acc.end(), 0.0f);
        walk(v_cache, block_size, nullptr, [&](int64_t g0, int64_t heads, const T* v, int64_t n, int64_t t) {
          accumulate(acc.data() + g0 * head_dim, heads, scores.data() + g0 * padded + t, padded, v, n);
        });
        for (int64_t g = 0; g < item_heads; ++g)
          for (int64_t d = 0; d < head_dim; ++d) out_item[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
      }
    }
  });
}

// The head_dim of a [2, num_blocks, block_size, Hkv, W] cache: W, less an int8 cache's 4 scale bytes per row.
inline int64_t cache_head_dim(const torch::Tensor& kv_cache) {
  return kv_cache.size(4) - (kv_cache.scalar_type() == at::kChar ? 4 : 0);
}

// Whether paged_attention's bf16 dot-product kernel serves this cache: a bf16 or int8 cache of
// 16-token blocks and head_dim 32, 64 or 128, on a build for AVX-512 BF16. Such a cache holds its
// blocks in the kernel's pair layout (avx512::write_rows): write it with write_kv, read it with
// paged_attention. Only this kernel reads an int8 cache.
inline bool avx512_supports(const torch::Tensor& kv_cache) {
#ifdef TM_ATTN_AVX512
  if (kv_cache.dim() != 5) return false;
  const int64_t head_dim = cache_head_dim(kv_cache);
  return (kv_cache.scalar_type() == at::kBFloat16 || kv_cache.scalar_type() == at::kChar) &&
         kv_cache.size(2) == avx512::kBlock && (head_dim == 32 || head_dim == 64 || head_dim == 128);
#else
  return false;
#endif
}

#ifdef TM_ATTN_AVX512
// Rows' k and v ([Hkv][D] each, row_stride apart) into their slots of a cache that avx512_supports.
template <typename T>
inline void write_pair_rows(const T* k, const T* v, int64_t row_stride, int64_t rows, const int64_t* slots,
                            const torch::Tensor& kv_cache) {
  const int64_t num_kv_heads = kv_cache.size(3), head_dim = cache_head_dim(kv_cache), half = kv_cache.numel() / 2;
  if (kv_cache.scalar_type() == at::kChar) {
    int8_t* cache = kv_cache.data_ptr<int8_t>();
    avx512::write_rows(k, v, row_stride, rows, slots, cache, cache + half, num_kv_heads, head_dim);
  } else {
    at::BFloat16* cache = kv_cache.data_ptr<at::BFloat16>();
    avx512::write_rows(k, v, row_stride, rows, slots, cache, cache + half, num_kv_heads, head_dim);
  }
}
#endif

// Refuses a slot outside the cache's num_slots before anything is written.
inline void check_slots(const int64_t* slots, int64_t n, int64_t num_slots) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "cache slot ", slots[i], " out of range");
}

// This step's k, v ([tokens, Hkv, D], float32 or bf16) into their slots of a cache that
// avx512_supports, in its pair layout, rounded to bf16 or quantized to int8. slot_mapping: [tokens] int64.
inline void write_kv(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& kv_cache,
                     const torch::Tensor& slot_mapping) {
  TORCH_CHECK(avx512_supports(kv_cache) && kv_cache.is_contiguous(),
              "write_kv writes the pair layout of a contiguous bf16 or int8 cache that paged_attention serves");
  const int64_t tokens = k.size(0), num_kv_heads = kv_cache.size(3), head_dim = cache_head_dim(kv_cache);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == num_kv_heads && k.size(2) == head_dim &&
                  k.scalar_type() == v.scalar_type(),
              "k, v: [tokens, Hkv, D] of the cache's Hkv and D, one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.numel() == tokens,
              "slot_mapping: [tokens] int64");
  const auto slots = slot_mapping.contiguous();
  check_slots(slots.data_ptr<int64_t>(), tokens, kv_cache.size(1) * kv_cache.size(2));
#ifdef TM_ATTN_AVX512
  // k and v are usually views of a fused QKV output: rows of [Hkv][D] a row stride apart, read in place.
  const bool rows_in_place = k.stride(2) == 1 && k.stride(1) == head_dim && v.stride(2) == 1 &&
                             v.stride(1) == head_dim && k.stride(0) == v.stride(0);
  const auto kc = rows_in_place ? k : k.contiguous(), vc = rows_in_place ? v : v.contiguous();
  const int64_t row_stride = rows_in_place ? k.stride(0) : num_kv_heads * head_dim;
  const auto run = [&](const auto* kp, const auto* vp) {
    write_pair_rows(kp, vp, row_stride, tokens, slots.data_ptr<int64_t>(), kv_cache);
  };
  if (k.scalar_type() == at::kFloat)
    run(kc.data_ptr<float>(), vc.data_ptr<float>());
  else if (k.scalar_type() == at::kBFloat16)
    run(kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "k, v must be float32 or bfloat16, got ", k.scalar_type());
#endif
}

// Attention for any mix of decode rows and prompt chunks, read from the cache (the step's new KV
// already written). q: [tokens, num_heads, head_dim]; query_start: [num_seqs + 1] int32, sequence i's
// rows [query_start[i], query_start[i + 1]) are the last of its seq_lens[i] positions (none: one row
// per sequence). Returns like q. Only where avx512_supports(kv_cache): the cache in the pair layout.
// prepare(seq, kvh0, heads): run by each work item before it reads (see decode_attention).
template <typename Prepare>
torch::Tensor paged_attention_with(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                   const std::optional<torch::Tensor>& query_start, double scale,
                                   const Prepare& prepare) {
  TORCH_CHECK(avx512_supports(kv_cache), "paged_attention needs an AVX-512 BF16 build and a bf16 or int8 cache ",
              "of 16-token blocks with head_dim 32, 64 or 128");
  TORCH_CHECK(q.dim() == 3 && kv_cache.is_contiguous() && q.size(2) == cache_head_dim(kv_cache) &&
                  q.size(1) % kv_cache.size(3) == 0,
              "q: [tokens, num_heads, head_dim]; kv_cache: contiguous [2, num_blocks, 16, Hkv, head_dim] ",
              "(head_dim + 4 int8 columns for an int8 cache)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  const auto tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  torch::Tensor starts;
  if (query_start) {
    starts = query_start->contiguous();
    TORCH_CHECK(starts.scalar_type() == torch::kInt32 && starts.numel() == lens.numel() + 1 &&
                    starts.data_ptr<int32_t>()[lens.numel()] == q.size(0),
                "query_start must be int32 [num_seqs + 1], ending at q's row count");
  } else {
    TORCH_CHECK(q.size(0) == lens.numel(), "without query_start, q has one row per sequence");
  }
  // The kernel trusts these to address the cache: every context within its block table, every
  // sequence's rows the last of its context (a sequence with no context, a padding row, gets zeros).
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == lens.numel(), "block_tables: [num_seqs, max_blocks]");
  for (int64_t i = 0; i < lens.numel(); ++i) {
    const int64_t len = lens.data_ptr<int32_t>()[i];
    const int64_t rows = query_start ? starts.data_ptr<int32_t>()[i + 1] - starts.data_ptr<int32_t>()[i] : 1;
    TORCH_CHECK(rows >= 0 && len <= tables.size(1) * kv_cache.size(2) && (len <= 0 || rows <= len), "sequence ", i,
                ": ", rows, " query rows, context ", len, " (block table of ", tables.size(1),
                " blocks): query_start must be nondecreasing, each sequence's rows at most its context");
  }
  // float32 rows whose heads lie side by side (a view of a fused QKV output) are read in place
  const bool rows_in_place = q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2);
  const auto qf = rows_in_place ? q : q.to(at::kFloat).contiguous();
  auto out = torch::empty(q.sizes(), q.options().dtype(at::kFloat));
#ifdef TM_ATTN_AVX512
  const int64_t cache_half = kv_cache.numel() / 2;
  const auto run = [&](const auto* cache) {
    avx512::with_chunks(q.size(2), [&](auto c) {
      avx512::attend<c()>(qf.data_ptr<float>(), qf.stride(0), query_start ? starts.data_ptr<int32_t>() : nullptr, cache,
                          cache + cache_half, tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                          out.data_ptr<float>(), lens.numel(), q.size(1), kv_cache.size(3), tables.size(1),
                          static_cast<float>(scale), prepare);
    });
  };
  if (kv_cache.scalar_type() == at::kChar)
    run(kv_cache.data_ptr<int8_t>());
  else
    run(kv_cache.data_ptr<at::BFloat16>());
#endif
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

inline torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                     const std::optional<torch::Tensor>& query_start, double scale) {
  return paged_attention_with(q, kv_cache, block_tables, seq_lens, query_start, scale,
                              [](int64_t, int64_t, int64_t) {});
}

#ifdef TM_ATTN_AVX512
// A decode row's work before it attends, for kv heads [kvh0, kvh0 + heads): rotate (rotate(head): one
// [head_dim] float32 head, in place) their query heads and keys, and write the keys and values into
// the row's cache slot (cache: the pair layout, V at cache + half). row: [(num_heads + 2 Hkv) * head_dim].
template <typename Cache, typename Rotate>
inline void rotate_and_write(float* row, int64_t kvh0, int64_t heads, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t slot, Cache* cache, int64_t half, const Rotate& rotate) {
  const int64_t group = num_heads / num_kv_heads;
  for (int64_t h = kvh0; h < kvh0 + heads; ++h) {
    for (int64_t g = h * group; g < (h + 1) * group; ++g) rotate(row + g * head_dim);
    float* k = row + (num_heads + h) * head_dim;
    rotate(k);
    avx512::write_head(k, k + num_kv_heads * head_dim, slot, cache, cache + half, h, num_kv_heads, head_dim);
  }
}

// Decode attention (one new token per sequence) straight from the QKV projection's rows, in one
// pass over the threads: each work item first rotates its own sequence's query and key heads in
// place (rotate(head, seq): one [head_dim] float32 head of sequence seq's row) and writes that key
// and value into the sequence's cache slot, then attends. No serial rotary or cache-write pass
// before the attention, and each thread reads back the rows it wrote.
// qkv: [num_seqs, (num_heads + 2 Hkv) * head_dim] float32; slots: [num_seqs] (checked here).
template <typename Rotate>
torch::Tensor decode_attention(const torch::Tensor& qkv, int64_t num_heads, const torch::Tensor& kv_cache,
                               const int64_t* slots, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                               double scale, const Rotate& rotate) {
  TORCH_CHECK(avx512_supports(kv_cache) && kv_cache.is_contiguous(),
              "decode_attention: a cache paged_attention serves");
  const int64_t num_kv_heads = kv_cache.size(3), head_dim = cache_head_dim(kv_cache), rows = qkv.size(0);
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  num_heads % num_kv_heads == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv: [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim] float32");
  check_slots(slots, rows, kv_cache.size(1) * kv_cache.size(2));
  float* base = qkv.data_ptr<float>();
  const auto prepare = [&](int64_t seq, int64_t kvh0, int64_t heads) {
    float* row = base + seq * qkv.stride(0);
    if (kv_cache.scalar_type() == at::kChar)
      rotate_and_write(row, kvh0, heads, num_heads, num_kv_heads, head_dim, slots[seq], kv_cache.data_ptr<int8_t>(),
                       kv_cache.numel() / 2, [&](float* head) { rotate(head, seq); });
    else
      rotate_and_write(row, kvh0, heads, num_heads, num_kv_heads, head_dim, slots[seq],
                       kv_cache.data_ptr<at::BFloat16>(), kv_cache.numel() / 2,
                       [&](float* head) { rotate(head, seq); });
  };
  const int64_t q_size = num_heads * head_dim;
  const auto q = qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim});  // read in place
  return paged_attention_with(q, kv_cache, block_tables, seq_lens, std::nullopt, scale, prepare);
}
#endif

// q: [num_seqs, num_heads, head_dim] (computed in float32); kv_cache: [2, num_blocks, block_size, Hkv, D]
// float32 or bfloat16 (in the pair layout where avx512_supports); block_tables: [num_seqs, max_blocks]
// int32; seq_lens: [num_seqs] int32. Returns like q.
inline torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.is_contiguous(),
              "q: [num_seqs, num_heads, head_dim]; kv_cache: contiguous [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  if (avx512_supports(kv_cache)) return paged_attention(q, kv_cache, block_tables, seq_lens, std::nullopt, scale);
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
  if (kv_cache.scalar_type() == at::kFloat)
    run(kv_cache.data_ptr<float>());
  else if (kv_cache.scalar_type() == at::kBFloat16)
    run(kv_cache.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "kv_cache must be float32 or bfloat16, got ", kv_cache.scalar_type());
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

}  // namespace tokenmill::attn
