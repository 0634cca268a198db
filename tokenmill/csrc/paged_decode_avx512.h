// Paged decode attention over a bf16 cache with AVX-512 (head_dim a multiple of 16): the fast path of
// paged_decode.h on CPUs that have it. The arithmetic is float32, as in the portable kernel.
//
// A work item is one (sequence, kv head): its query heads (the GQA group) read that head's rows of
// every block once per pass. (Items of whole sequences, reading each block as one run of all kv
// heads, measured slower.) Included by paged_decode.h, whose portable helpers it uses. Keys: a block's 16 rows are widened to float32 once into an L1 buffer,
// then each query head takes 16 dot products, one 16-lane vector of partial sums per key, folded into
// one vector of 16 scores by a transposing sum (no per-score horizontal reduction). Values: each row
// is widened in registers once for up to kMaxHeads query heads, whose accumulators stay in registers
// over the whole context. One softmax over each whole row sits between the two passes.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace tokenmill::attn::avx512 {

constexpr int64_t kBlock = 16;         // tokens per key batch (one vector of scores)
constexpr int kMaxAccumulators = 16;   // value pass: query heads x (head_dim / 16) vectors in registers
constexpr int64_t kAheadBlocks = 2;    // blocks prefetched ahead (blocks may lie anywhere in the pool)

inline __m512 widen(const at::BFloat16* p) {  // 16 bf16 -> float32 (a bf16 is a float32's top half)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v[0..15] -> one vector whose lane i is the sum of v[i]'s lanes: pairs folded within 128-bit lanes,
// then across them (45 shuffles and adds instead of 16 horizontal sums).
inline __m512 transpose_sum(__m512 (&v)[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // lane quad q: (v[2i] elems 0+2, v[2i+1] 0+2, v[2i] 1+3, v[2i+1] 1+3)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // lane quad q: the quad's sums of v[4i], v[4i+1], v[4i+2], v[4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // across quads: c0 = (b0 q0+q1, b0 q2+q3, b1 q0+q1, b1 q2+q3), c1 likewise from b2, b3
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// scores[t] = q . k[t] for n <= 16 keys whose float32 rows are in kw ([16, head_dim]).
template <int C>  // C = head_dim / 16
inline void scores16(const float* q, const float* kw, int64_t n, float* scores) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 partial[16];
  #pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kw + t * 16 * C));
    #pragma GCC unroll 8
    for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kw + t * 16 * C + 16 * c), acc);
    partial[t] = acc;
  }
  const __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  _mm512_mask_storeu_ps(scores, mask, transpose_sum(partial));
}

// acc[g] += sum_t p[g][t] * v[t] for H query heads over n value rows; acc stays in registers.
template <int H, int C>
inline void values(float* acc, int64_t head_dim, const float* p, int64_t p_stride, const at::BFloat16* v,
                   int64_t v_stride, int64_t n) {
  __m512 a[H][C];
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * head_dim + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    __m512 vc[C];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) vc[c] = widen(v + t * v_stride + 16 * c);
    #pragma GCC unroll 4
    for (int g = 0; g < H; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * p_stride + t]);
      #pragma GCC unroll 8
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pg, vc[c], a[g][c]);
    }
  }
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * head_dim + 16 * c, a[g][c]);
}

// Calls f(integral_constant<int, C>) for head_dim / 16 in {2, 4, 8}; false for other head dims.
template <typename F>
inline bool with_chunks(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 32: f(std::integral_constant<int, 2>{}); return true;
    case 64: f(std::integral_constant<int, 4>{}); return true;
    case 128: f(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}

template <int C, typename F>
inline void with_heads(int64_t heads, F&& f) {  // heads in [1, kMaxAccumulators / C]
  constexpr int kMax = std::max(1, std::min(4, kMaxAccumulators / C));
  if (kMax >= 4 && heads >= 4) return f(std::integral_constant<int, std::min(4, kMax)>{});
  if (kMax >= 3 && heads == 3) return f(std::integral_constant<int, std::min(3, kMax)>{});
  if (kMax >= 2 && heads == 2) return f(std::integral_constant<int, std::min(2, kMax)>{});
  f(std::integral_constant<int, 1>{});
}

// Same contract as attn::decode (paged_decode.h) for a bf16 cache whose block size is 16.
template <int C>
void decode(const float* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache, const int32_t* block_tables,
            const int32_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t max_blocks, float scale) {
  constexpr int64_t head_dim = 16 * C;
  constexpr int kHeads = std::max(1, std::min(4, kMaxAccumulators / C));  // query heads per value pass
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = kBlock * token_stride;
  const std::vector<std::vector<int64_t>> plan = balance(seq_lens, num_seqs, num_kv_heads, kBlock);
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 1, [&](int64_t begin, int64_t end) {
    alignas(64) float kw[kBlock * head_dim];  // one block's keys, widened
    std::vector<float> qs(group * head_dim), acc(group * head_dim), inv_sum(group), scores;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (const int64_t item : plan[worker]) {
        const int64_t seq = item / num_kv_heads, kvh = item % num_kv_heads;
        const int64_t seq_len = seq_lens[seq], first = (seq * num_heads + kvh * group) * head_dim;
        float* out_item = out + first;
        if (!start_item(q + first, scale, group, head_dim, seq_len, out_item, qs.data())) continue;
        const int32_t* table = block_tables + seq * max_blocks;
        const int64_t num_blocks = (seq_len + kBlock - 1) / kBlock, padded = num_blocks * kBlock;
        scores.resize(group * padded);  // [group, padded]
        const auto rows_of = [&](const at::BFloat16* half, int64_t j) {
          return half + table[j] * block_stride + kvh * head_dim;
        };
        const auto prefetch = [&](const at::BFloat16* half, int64_t j) {
          if (j < num_blocks) prefetch_rows(rows_of(half, j), kBlock, token_stride, head_dim * 2);
        };
        // Pass 1: the scores of every key.
        for (int64_t j = 0; j < kAheadBlocks; ++j) prefetch(k_cache, j);
        for (int64_t j = 0; j < num_blocks; ++j) {
          prefetch(k_cache, j + kAheadBlocks);
          const int64_t n = std::min(kBlock, seq_len - j * kBlock);
          const at::BFloat16* k = rows_of(k_cache, j);
          for (int64_t t = 0; t < kBlock; ++t)
            for (int c = 0; c < C; ++c)  // rows past n: zeros (their scores are never read)
              _mm512_store_ps(kw + t * head_dim + 16 * c,
                              t < n ? widen(k + t * token_stride + 16 * c) : _mm512_setzero_ps());
          for (int64_t g = 0; g < group; ++g)
            scores16<C>(qs.data() + g * head_dim, kw, n, scores.data() + g * padded + j * kBlock);
        }
        for (int64_t g = 0; g < group; ++g) inv_sum[g] = softmax_row(scores.data() + g * padded, seq_len);
        // Pass 2: the probability-weighted values, up to kHeads query heads per read of a row.
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < kAheadBlocks; ++j) prefetch(v_cache, j);
        for (int64_t j = 0; j < num_blocks; ++j) {
          prefetch(v_cache, j + kAheadBlocks);
          const int64_t n = std::min(kBlock, seq_len - j * kBlock);
          for (int64_t g0 = 0; g0 < group; g0 += kHeads)
            with_heads<C>(std::min<int64_t>(kHeads, group - g0), [&](auto h) {
              values<h(), C>(acc.data() + g0 * head_dim, head_dim, scores.data() + g0 * padded + j * kBlock, padded,
                             rows_of(v_cache, j), token_stride, n);
            });
        }
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < head_dim; ++d) out_item[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
      }
    }
  });
}

}  // namespace tokenmill::attn::avx512
