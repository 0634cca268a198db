// Paged attention over a bf16 cache with AVX-512 BF16 dot products (vdpbf16ps), or an int8 cache with
// AVX-512 VNNI int16 ones (vpdpwssd): decode rows and prompt chunks (a cached prefix included) in one
// kernel. The fast path of paged_decode.h on CPUs that have the instructions; block size 16, head_dim
// 32, 64 or 128.
//
// The cache blocks hold keys and values in the order the dot products want them (the pair layout,
// see write_rows), written so once per token, so the kernel reads its operands straight from the
// blocks: no per-step copy or transpose of the context.
//
// A work item is a tile of one sequence's query tokens and its kv heads (see attend); per kv head,
// its rows are the (token, query head) pairs of the tile's tokens and the head's GQA group: the scores
// of all rows (query times scale rounded to bf16, float32 sums), one exact softmax per row over its
// causal context (softmax_to_bf16, the portable kernel's exp), probabilities rounded to bf16, and the
// weighted values (float32 sums). The rounding is the only difference from the portable kernel:
// scores and outputs agree to bf16 precision (the tests emulate the rounding).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention_amx.h"

namespace tokenmill::attn::avx512 {

constexpr int64_t kBlock = 16;          // tokens per cache block (one vector of scores)
constexpr int64_t kTileRows = 48;       // query rows per work item of a prompt chunk
constexpr int kScoreRows = 12;          // rows whose scores are summed together, in registers
constexpr int kValueAccumulators = 24;  // value pass: rows x (head_dim / 16) vectors in registers
// Blocks prefetched ahead (blocks may lie anywhere in the pool): enough bytes in flight to cover a
// block's trip from memory, 4 KB of a head's bf16 chunks and 8.5 KB of its int8 ones (an int8 chunk
// is ~1 KB, so 2 blocks of them are too few).
template <typename Cache>
constexpr int64_t ahead_blocks() {
  return std::is_same_v<Cache, int8_t> ? 8 : 2;
}
// A head's context up to this size (keys and values) is requested whole as the head starts (see
// attend_head): the values must arrive during the scores. Well inside L2.
constexpr int64_t kFetchAllBytes = 256 * 1024;

// Requests `bytes` from p on into L2, not L1: L1 tracks few misses at a time, too few to cover the
// latency of blocks that lie anywhere in the pool (hence prefetcht2, not prefetcht0).
inline void fetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T2);
}

inline __mmask16 first_lanes(int64_t n) {  // lanes [0, n) of 16
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// ------------------------------------------------------------------------------- the cache layout
// Each block holds, per half (K, V) and kv head, 16 tokens x D values (bf16) arranged for the dot
// products, so the kernel reads its operands straight from the blocks:
//   keys   [D/2][16] pairs: (k[t][2i], k[t][2i+1]) at [i][t]; one vector holds pair i of all 16 keys,
//          so 16 scores of a row come out of D/2 dot products with no horizontal sums;
//   values [8][D] pairs: (v[2s][d], v[2s+1][d]) at [s][d]; a row's probability pair (p[2s], p[2s+1])
//          weights two value rows in one instruction.
// A block half is [Hkv][16 * D], the size of the plain [16][Hkv][D]: the cache tensor keeps its shape
// [2, num_blocks, 16, Hkv, D] and only the order within a block differs (attention/pair_layout.py
// converts, in PyTorch). In bf16 units within a head's chunk: k[t][d] at (d / 2) * 32 + 2 * t + d % 2,
// v[t][d] at (t / 2) * 2 * D + 2 * d + t % 2.
//
// An int8 cache (kv_cache_dtype "int8") holds the same order in bytes, each head's chunk followed by
// its 16 tokens' float32 scales (max |x| / 127 of the token's row of that head): 16 * (D + 4) bytes,
// the [16][D + 4] of a cache tensor [2, num_blocks, 16, Hkv, D + 4]. Half the bytes of bf16 for the
// decode rows to stream. The kernel widens each 32-byte pair row to int16 pairs (one instruction,
// exact) and takes int32 dot products with queries and probabilities rounded to int16 (one scale per
// row: finer than bf16's 8 bits), then applies the scales once per score and per output.

template <typename Cache, int C>  // elements of one kv head's share of a block half
constexpr int64_t chunk_elems() {
  return kBlock * 16 * C + (std::is_same_v<Cache, int8_t> ? kBlock * 4 : 0);
}

template <typename Cache, int C>
constexpr int64_t chunk_bytes() {
  return chunk_elems<Cache, C>() * static_cast<int64_t>(sizeof(Cache));
}

// A chunk's 16 float32 scales, after its 16 * D values (int8 caches only).
template <int C>
inline const float* scales_of(const int8_t* chunk) {
  return reinterpret_cast<const float*>(chunk + kBlock * 16 * C);
}

// The 32 int8 at p (16 pairs: a pair row of keys or 16 columns of a value pair row) as 16 int16 pairs.
inline __m512i widen_pairs(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {  // bf16 -> float32: the bits in the high half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
}

// One row's kv head h into its cache slot, rounded to bf16 (to nearest even, as torch converts):
// k, v: the head's [D] values. A key's 16 pairs of 32 columns go 16 dwords apart (one per vector of
// the block's pair); a value's 32 columns go to every other bf16 of its pair row (the first or
// second of each pair), so rows sharing a block never write the same bytes.
template <typename T>
inline void write_head(const T* k, const T* v, int64_t slot, at::BFloat16* k_cache, at::BFloat16* v_cache, int64_t h,
                       int64_t num_kv_heads, int64_t head_dim) {
  const int64_t head_chunk = kBlock * head_dim;  // one kv head's share of a block half
  const __m512i pair_rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(kBlock));
  alignas(64) static constexpr uint16_t spread_lo[32] = {0, 0, 1, 1, 2,  2,  3,  3,  4,  4,  5,  5,  6,  6,  7,  7,
                                                         8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
  const __m512i lo = _mm512_load_si512(spread_lo), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t block = slot / kBlock, t = slot % kBlock;
  const __m512i key_slots = _mm512_add_epi32(pair_rows, _mm512_set1_epi32(static_cast<int>(t)));
  const __mmask32 half = t % 2 ? 0xAAAAAAAA : 0x55555555;
  auto* kc = reinterpret_cast<int32_t*>(k_cache + (block * num_kv_heads + h) * head_chunk);
  at::BFloat16* vc = v_cache + (block * num_kv_heads + h) * head_chunk + (t / 2) * 2 * head_dim;
  for (int64_t d = 0; d < head_dim; d += 32) {
    const __m512i kb = (__m512i)_mm512_cvtne2ps_pbh(load16(k + d + 16), load16(k + d));
    _mm512_i32scatter_epi32(kc + d / 2 * kBlock, key_slots, kb, 4);
    const __m512i vb = (__m512i)_mm512_cvtne2ps_pbh(load16(v + d + 16), load16(v + d));
    _mm512_mask_storeu_epi16(vc + 2 * d, half, _mm512_permutexvar_epi16(lo, vb));
    _mm512_mask_storeu_epi16(vc + 2 * d + 32, half, _mm512_permutexvar_epi16(hi, vb));
  }
}

// q[0, D) <- x rounded to multiples of max |x| / 127 (to nearest even); returns that scale (0 for a zero row).
template <typename T>
inline float quantize_row(const T* x, int64_t head_dim, int8_t* q) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x + d)));
  const float absmax = _mm512_reduce_max_ps(top);
  const __m512 inv = _mm512_set1_ps(absmax > 0.0f ? 127.0f / absmax : 0.0f);
  for (int64_t d = 0; d < head_dim; d += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + d),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(load16(x + d), inv))));
  return absmax / 127.0f;
}

// write_head for an int8 cache: the row's head quantized with its own scale, the bytes in the pair
// order. As there, rows sharing a block never write the same bytes.
template <typename T>
inline void write_head(const T* k, const T* v, int64_t slot, int8_t* k_cache, int8_t* v_cache, int64_t h,
                       int64_t num_kv_heads, int64_t head_dim) {
  const int64_t head_chunk = kBlock * (head_dim + 4);
  alignas(64) int8_t kq[128], vq[128];
  const int64_t block = slot / kBlock, t = slot % kBlock;
  const __mmask64 half = t % 2 ? 0xAAAAAAAAAAAAAAAAull : 0x5555555555555555ull;
  int8_t* kc = k_cache + (block * num_kv_heads + h) * head_chunk;
  int8_t* vc = v_cache + (block * num_kv_heads + h) * head_chunk;
  const float k_scale = quantize_row(k, head_dim, kq);
  const float v_scale = quantize_row(v, head_dim, vq);
  for (int64_t j = 0; j < head_dim / 2; ++j) std::memcpy(kc + j * 32 + 2 * t, kq + 2 * j, 2);  // pair j, token t
  int8_t* value_pairs = vc + (t / 2) * 2 * head_dim;  // v[d] to byte 2 d + t % 2
  for (int64_t d = 0; d < head_dim; d += 32) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vq + d)));
    if (t % 2) w = _mm512_slli_epi16(w, 8);
    _mm512_mask_storeu_epi8(value_pairs + 2 * d, half, w);
  }
  reinterpret_cast<float*>(kc + kBlock * head_dim)[t] = k_scale;
  reinterpret_cast<float*>(vc + kBlock * head_dim)[t] = v_scale;
}

// Rows' kv heads into their cache slots (write_head). Row i: k at k + i * row_stride, v at
// v + i * row_stride, each [Hkv][D]; 0 <= slots[i] < num_slots. A prompt's rows split across the threads.
template <typename T, typename Cache>
inline void write_rows(const T* k, const T* v, int64_t row_stride, int64_t rows, const int64_t* slots, Cache* k_cache,
                       Cache* v_cache, int64_t num_kv_heads, int64_t head_dim) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        write_head(k + i * row_stride + h * head_dim, v + i * row_stride + h * head_dim, slots[i], k_cache, v_cache, h,
                   num_kv_heads, head_dim);
  });
}

// ------------------------------------------------------------------------------- the softmax
// p[0, pairs) <- exp(s[t] - max(s)) for t < n as bf16 pairs, zeros past n; returns 1 / their
// float32 sum (of the values before rounding, as softmax_row).
inline float softmax_to_bf16(const float* s, int64_t n, uint32_t* p, int64_t pairs) {
  __m512 lane_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n; t += 16)
    lane_max = _mm512_max_ps(lane_max, _mm512_mask_loadu_ps(lane_max, first_lanes(n - t), s + t));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(lane_max));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < 2 * pairs; t += 32) {
    const __mmask16 m_lo = first_lanes(n - t), m_hi = first_lanes(n - t - 16);
    const __m512 lo = _mm512_maskz_mov_ps(m_lo, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m_lo, s + t), max)));
    const __m512 hi = _mm512_maskz_mov_ps(m_hi, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m_hi, s + t + 16), max)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(lo, hi));
    _mm512_storeu_si512(p + t / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// An int8 cache's softmax: s[t] <- exp(s[t] - max(s)) * weight[t] for t < n (weight: the value
// scales), then p[0, pairs) <- those as int16 pairs in steps of their max / kProbMax, zeros past n.
// Returns the step over the float32 sum of exp(s[t] - max(s)) (taken before the weights).
constexpr float kProbMax = 16383.0f;  // 2^14 - 1: see kFlushPairs
constexpr int64_t kFlushPairs = 256;  // int32 sums over 512 keys at most: 512 * 16383 * 127 < 2^31
inline float softmax_to_int16(float* s, int64_t n, const float* weight, uint32_t* p, int64_t pairs) {
  __m512 lane_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n; t += 16)
    lane_max = _mm512_max_ps(lane_max, _mm512_mask_loadu_ps(lane_max, first_lanes(n - t), s + t));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(lane_max));
  __m512 sum = _mm512_setzero_ps(), top = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = first_lanes(n - t);
    const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), max)));
    sum = _mm512_add_ps(sum, e);
    const __m512 weighted = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(m, weight + t));
    top = _mm512_max_ps(top, weighted);
    _mm512_mask_storeu_ps(s + t, m, weighted);
  }
  const float largest = _mm512_reduce_max_ps(top);
  const __m512 inv_step = _mm512_set1_ps(largest > 0.0f ? kProbMax / largest : 0.0f);
  for (int64_t t = 0; t < 2 * pairs; t += 32) {
    const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(n - t), s + t), inv_step));
    const __m512i hi =
        _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(n - t - 16), s + t + 16), inv_step));
    _mm512_storeu_si512(
        p + t / 2, _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)), _mm512_cvtepi32_epi16(hi), 1));
  }
  return largest / kProbMax / _mm512_reduce_add_ps(sum);
}

// ------------------------------------------------------------------------------- the dot products
// s[r][0, 16) = q[r] . k[t] for the 16 keys of one block (kt: the head's chunk); q: [R][D/2] bf16 pairs.
// (The last parameter, the int8 overload's query steps, is unused here.) One sum per score, in head_dim
// order, for every tile's row count, so a query's scores are the same bits alone (decode) or in a tile
// of a prompt chunk or a speculative verification (see tile_bf16 in packed_gemm_avx512.h: a batch must
// never change a greedy token).
template <int R, int C>
inline void block_scores(const uint32_t* q, const at::BFloat16* kt, float* s, int64_t s_stride, const float*) {
  constexpr int kPairs = 8 * C;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int i = 0; i < kPairs; ++i) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + i * 32);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * kPairs + i])), k);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * s_stride, acc[r]);
}

// The same over an int8 chunk: q: [R][D/2] int16 pairs, row r in steps of q_step[r]; the int32 sums
// scaled by q_step[r] times each key's scale.
template <int R, int C>
inline void block_scores(const uint32_t* q, const int8_t* kt, float* s, int64_t s_stride, const float* q_step) {
  constexpr int kPairs = 8 * C;
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int i = 0; i < kPairs; ++i) {
    const __m512i k = widen_pairs(kt + i * 32);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpwssd_epi32(acc[r], k, _mm512_set1_epi32(static_cast<int>(q[r * kPairs + i])));
  }
  const __m512 k_scale = _mm512_loadu_ps(scales_of<C>(kt));
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_mul_ps(k_scale, _mm512_set1_ps(q_step[r]));
    _mm512_storeu_ps(s + r * s_stride, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), scale));
  }
}

// out[r] = scale[r] * sum_s (p[r][2s] v[2s] + p[r][2s+1] v[2s+1]) over the first `keys` values, read
// from the blocks (8 pairs each). With `keys` odd, the last pair's second value lies past every row's
// context, in a slot that may never have been written: it is zeroed, as its probability is.
template <int R, int C>
inline void weighted_values(const uint32_t* p, int64_t p_stride, const at::BFloat16* const* v_blocks, int64_t keys,
                            const float* scale, float* out, int64_t out_stride) {
  constexpr int64_t kPairsPerBlock = kBlock / 2;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const auto pair = [&](int64_t s, __m512i keep) {
    const int64_t j = s / kPairsPerBlock;
    constexpr int64_t kAhead = ahead_blocks<at::BFloat16>();
    if (s % kPairsPerBlock == 0 && j + kAhead < (keys + kBlock - 1) / kBlock)
      fetch(v_blocks[j + kAhead], chunk_bytes<at::BFloat16, C>());
    const at::BFloat16* vp = v_blocks[j] + (s % kPairsPerBlock) * C * 32;
    __m512bh v[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_and_si512(_mm512_loadu_si512(vp + c * 32), keep);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * p_stride + s]));
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, v[c]);
    }
  };
  const int64_t whole = keys / 2;  // pairs of two context values
  for (int64_t s = 0; s < whole; ++s) pair(s, _mm512_set1_epi32(-1));
  if (keys % 2) pair(whole, _mm512_set1_epi32(0xFFFF));  // the low bf16 of each dword: v[2s]
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + r * out_stride + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(scale[r])));
}

// The same over int8 chunks: p: int16 pairs, the pairs past every row's context zero (an unwritten
// int8 value is finite, so needs no mask); out[r] = scale[r] * the int32 sums, which move to float32
// every kFlushPairs pairs, before they could overflow.
template <int R, int C>
inline void weighted_values(const uint32_t* p, int64_t p_stride, const int8_t* const* v_blocks, int64_t keys,
                            const float* scale, float* out, int64_t out_stride) {
  constexpr int64_t kPairsPerBlock = kBlock / 2;
  __m512i acc[R][C];
  __m512 total[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512(), total[r][c] = _mm512_setzero_ps();
  const auto flush = [&] {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        total[r][c] = _mm512_add_ps(total[r][c], _mm512_cvtepi32_ps(acc[r][c])), acc[r][c] = _mm512_setzero_si512();
  };
  const int64_t pairs = (keys + 1) / 2, blocks = (keys + kBlock - 1) / kBlock;
  for (int64_t s = 0; s < pairs; ++s) {
    const int64_t j = s / kPairsPerBlock;
    constexpr int64_t kAhead = ahead_blocks<int8_t>();
    if (s % kPairsPerBlock == 0 && j + kAhead < blocks) fetch(v_blocks[j + kAhead], chunk_bytes<int8_t, C>());
    if (s % kFlushPairs == 0 && s > 0) flush();
    const int8_t* vp = v_blocks[j] + (s % kPairsPerBlock) * C * 32;
    __m512i v[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) v[c] = widen_pairs(vp + c * 32);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i pr = _mm512_set1_epi32(static_cast<int>(p[r * p_stride + s]));
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpwssd_epi32(acc[r][c], pr, v[c]);
    }
  }
  flush();
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + r * out_stride + 16 * c, _mm512_mul_ps(total[r][c], _mm512_set1_ps(scale[r])));
}

// Calls f(integral_constant<int, n>) for n in [1, kMax]: the row count sizes the register arrays.
template <int kMax, typename F>
inline void with_rows(int n, F&& f) {
  if constexpr (kMax > 1)
    if (n < kMax) return with_rows<kMax - 1>(n, f);
  f(std::integral_constant<int, kMax>{});
}

// Calls f(integral_constant<int, C>) for head_dim / 16 in {2, 4, 8}; false for other head dims.
template <typename F>
inline bool with_chunks(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 32:
      f(std::integral_constant<int, 2>{});
      return true;
    case 64:
      f(std::integral_constant<int, 4>{});
      return true;
    case 128:
      f(std::integral_constant<int, 8>{});
      return true;
    default:
      return false;
  }
}

// ------------------------------------------------------------------------------- the kernel
// Per-thread buffers of attend_head, reused from item to item.
struct Scratch {
  std::vector<uint32_t> qb, p;                     // rounded queries, probabilities: bf16 pairs
  std::vector<float> s, inv_sum, q_step, v_scale;  // q_step, v_scale: an int8 cache's query steps, value scales
  std::vector<float> o;                            // AMX: the weighted values before scaling
};

// AMX tiles read whole 16-row tiles: a bf16 head's row buffers are sized in those (attend_head).
inline int64_t tile_rows(int64_t rows, bool amx) { return amx ? (rows + 15) / 16 * 16 : rows; }

// One kv head's share of an item, read from its context's blocks (k_blocks, v_blocks: the head's
// chunk of each block half, `padded` keys in all): `rows` query rows (q_rows, written to out_rows),
// row r seeing the first row_len[r] keys, nondecreasing in r.
template <int C, typename Cache>
inline void attend_head(const float* const* q_rows, float* const* out_rows, const int64_t* row_len, int64_t rows,
                        const Cache* const* k_blocks, const Cache* const* v_blocks, int64_t padded, float scale,
                        Scratch& w) {
  constexpr bool kInt8 = std::is_same_v<Cache, int8_t>;
  constexpr int64_t D = 16 * C, kPairs = D / 2, kChunkBytes = chunk_bytes<Cache, C>(), kAhead = ahead_blocks<Cache>();
  // int8: int32 sums and their float32 totals both in registers
  constexpr int kValueRows = kValueAccumulators / C / (kInt8 ? 2 : 1);
  const int64_t num_blocks = padded / kBlock;
  const int64_t p_stride = (padded + 31) / 32 * 16;  // pairs per probability row, whole vectors
#ifdef TM_AMX
  const bool on_tiles = !kInt8 && tile::enabled();  // both products on AMX tiles (paged_attention_amx.h)
#else
  constexpr bool on_tiles = false;
#endif
  const int64_t buffer_rows = tile_rows(rows, on_tiles);
  w.qb.resize(buffer_rows * kPairs);
  w.q_step.resize(rows);
  w.s.resize(buffer_rows * padded);
  w.p.resize(buffer_rows * p_stride);
  w.inv_sum.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {  // queries times scale, rounded to bf16 pairs (int16 pairs, one step per row)
    const __m512 mult = _mm512_set1_ps(scale);
    if constexpr (kInt8) {
      __m512 top = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(q_rows[r] + d)));
      const float largest = _mm512_reduce_max_ps(top) * scale;
      w.q_step[r] = largest / 32767.0f;
      const __m512 inv_step = _mm512_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i lo =
            _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(q_rows[r] + d), mult), inv_step));
        const __m512i hi =
            _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(q_rows[r] + d + 16), mult), inv_step));
        _mm512_storeu_si512(
            w.qb.data() + r * kPairs + d / 2,
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi32_epi16(lo)), _mm512_cvtsepi32_epi16(hi), 1));
      }
    } else {
      for (int64_t d = 0; d < D; d += 32) {
        const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(q_rows[r] + d), mult);
        const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(q_rows[r] + d + 16), mult);
        _mm512_storeu_si512(w.qb.data() + r * kPairs + d / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  }
  // Where the head's whole context fits kFetchAllBytes, all of its chunks are requested now: the
  // values then arrive during the scores, not after them. The requests kAhead blocks ahead below
  // stay: a burst this long overflows the misses a core tracks and some of it is dropped.
  if (num_blocks * 2 * kChunkBytes <= kFetchAllBytes)
    for (int64_t j = 0; j < num_blocks; ++j) fetch(k_blocks[j], kChunkBytes), fetch(v_blocks[j], kChunkBytes);
#ifdef TM_AMX
  // The keys a tile of 16 rows from r0 reads: those its last row sees.
  const auto tile_keys = [&](int64_t r0) { return row_len[std::min(rows, r0 + amx::kRows) - 1]; };
  if (on_tiles) {
    amx::configure(std::min(rows, amx::kRows));
    amx::scores<C>(w.qb.data(), rows, reinterpret_cast<const at::BFloat16* const*>(k_blocks), w.s.data(), padded,
                   tile_keys);
  }
#endif
  // Scores, kScoreRows rows at a time over the blocks the last of them sees (rows see more keys in
  // order); blocks lie anywhere in the pool, so each is requested a few blocks ahead.
  for (int64_t r0 = 0; r0 < rows && !on_tiles; r0 += kScoreRows) {
    const int n_rows = static_cast<int>(std::min<int64_t>(kScoreRows, rows - r0));
    const int64_t blocks = (row_len[r0 + n_rows - 1] + kBlock - 1) / kBlock;
    with_rows<kScoreRows>(n_rows, [&](auto nr) {
      for (int64_t j = 0; j < std::min(kAhead, blocks); ++j) fetch(k_blocks[j], kChunkBytes);
      for (int64_t j = 0; j < blocks; ++j) {
        if (j + kAhead < blocks) fetch(k_blocks[j + kAhead], kChunkBytes);
        block_scores<nr(), C>(w.qb.data() + r0 * kPairs, k_blocks[j], w.s.data() + r0 * padded + j * kBlock, padded,
                              w.q_step.data() + r0);
      }
    });
  }
  for (int64_t j = 0; j < std::min(kAhead, num_blocks); ++j) fetch(v_blocks[j], kChunkBytes);
  // Softmax over each row's context; probabilities rounded to bf16 (int8: weighted by the value
  // scales, rounded to int16 steps), zeros past the context.
  if constexpr (kInt8) {
    w.v_scale.resize(padded);
    for (int64_t j = 0; j < num_blocks; ++j) std::memcpy(&w.v_scale[j * kBlock], scales_of<C>(v_blocks[j]), 64);
    for (int64_t r = 0; r < rows; ++r)
      w.inv_sum[r] =
          softmax_to_int16(w.s.data() + r * padded, row_len[r], w.v_scale.data(), w.p.data() + r * p_stride, p_stride);
  } else {
    for (int64_t r = 0; r < rows; ++r)
      w.inv_sum[r] = softmax_to_bf16(w.s.data() + r * padded, row_len[r], w.p.data() + r * p_stride, p_stride);
  }
#ifdef TM_AMX
  if (on_tiles) {
    constexpr int64_t D16 = 16 * C;
    w.o.resize(buffer_rows * D16);
    amx::weighted_values<C>(w.p.data(), p_stride, rows, reinterpret_cast<const at::BFloat16* const*>(v_blocks),
                            w.o.data(), tile_keys);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(w.inv_sum[r]);
      for (int64_t d = 0; d < D16; d += 16)
        _mm512_storeu_ps(out_rows[r] + d, _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * D16 + d), inv));
    }
    return;
  }
#endif
  // Weighted values, kValueRows rows at a time over the keys the last of them sees.
  for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
    const int n_rows = static_cast<int>(std::min<int64_t>(kValueRows, rows - r0));
    with_rows<kValueRows>(n_rows, [&](auto nr) {
      alignas(64) float o[nr()][D];
      weighted_values<nr(), C>(w.p.data() + r0 * p_stride, p_stride, v_blocks, row_len[r0 + n_rows - 1],
                               w.inv_sum.data() + r0, &o[0][0], D);
      for (int r = 0; r < nr(); ++r) std::memcpy(out_rows[r0 + r], o[r], D * sizeof(float));
    });
  }
}

// A work item: a tile of a sequence's query tokens, [first, first + tokens), and kv heads [kvh0, kvh0 + heads).
struct Item {
  int64_t seq, first, tokens, kvh0, heads;
};

// The items of a step and which worker attends each (balance): they depend only on the sequences'
// query rows and context lengths, so the layers of a decode step share one plan.
struct Plan {
  const int32_t* query_start;  // as in attend (nullptr: one row per sequence)
  std::vector<Item> items;
  std::vector<std::vector<int64_t>> workers;  // [worker]: its items
  int64_t start(int64_t seq) const { return query_start ? query_start[seq] : seq; }
};

// A work item is a tile of a sequence's query tokens and all its kv heads (one table walk for all);
// with too few tiles to keep the threads busy, one kv head.
inline Plan plan_items(const int32_t* query_start, const int32_t* seq_lens, int64_t num_seqs, int64_t group,
                       int64_t num_kv_heads) {
  Plan plan{query_start, {}, {}};
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group);
  int64_t tiles = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    tiles += (plan.start(seq + 1) - plan.start(seq) + tile_tokens - 1) / tile_tokens;
  const int64_t heads_per_item = tiles >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  std::vector<int64_t> costs;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = plan.start(seq + 1) - plan.start(seq), seq_len = seq_lens[seq];
    for (int64_t first = 0; first < q_len; first += tile_tokens)
      for (int64_t kvh0 = 0; kvh0 < num_kv_heads; kvh0 += heads_per_item) {
        const int64_t tokens = std::min(tile_tokens, q_len - first);
        plan.items.push_back({seq, first, tokens, kvh0, heads_per_item});
        // reads the context up to the tile's last token for its query rows; + per-item overhead
        const int64_t context = std::max<int64_t>(0, seq_len - q_len + first + tokens);
        costs.push_back(heads_per_item * (context * (tokens * group + 8) + 64 * kBlock));
      }
  }
  plan.workers = balance(costs);
  return plan;
}

// One thread's buffers, reused from item to item (and layer to layer).
template <typename Cache>
struct Worker {
  std::vector<const Cache*> k_blocks, v_blocks;  // [heads][num_blocks]: each head's chunk of each block
  std::vector<int64_t> row_len;
  std::vector<const float*> q_rows;
  std::vector<float*> out_rows;
  Scratch scratch;
};

// The items of plan.workers[worker]. q: [tokens, num_heads, D] float32, token rows q_stride floats
// apart (heads contiguous within a row: a view of a fused QKV output reads in place), the rows of
// sequence i at [query_start[i], query_start[i + 1]), the last ones of its context of seq_lens[i]
// tokens (each attends to its position and before). The cache halves: [num_blocks, Hkv, chunk_elems]
// bf16 or int8 in the pair layout (see write_rows). out: like q. A sequence with no context gets
// zeros. prepare(seq, kvh0, heads) runs first in each item, on the thread that attends it (see
// decode_attention in paged_decode.h).
template <int C, typename Cache, typename Prepare>
void attend_worker(const Plan& plan, int64_t worker, const float* q, int64_t q_stride, const Cache* k_cache,
                   const Cache* v_cache, const int32_t* block_tables, const int32_t* seq_lens, float* out,
                   int64_t num_heads, int64_t num_kv_heads, int64_t max_blocks, float scale, const Prepare& prepare,
                   Worker<Cache>& w) {
  constexpr int64_t D = 16 * C, kChunk = chunk_elems<Cache, C>();  // one kv head in a block half
  const int64_t group = num_heads / num_kv_heads, block_stride = num_kv_heads * kChunk;
  for (const int64_t index : plan.workers[worker]) {
    const Item& it = plan.items[index];
    prepare(it.seq, it.kvh0, it.heads);
    const int64_t q_len = plan.start(it.seq + 1) - plan.start(it.seq), seq_len = seq_lens[it.seq];
    const int64_t rows = it.tokens * group;            // per kv head: (token, query head of its group)
    const auto row_of = [&](int64_t kvh, int64_t r) {  // [tokens, num_heads] index of a head's row r
      return (plan.start(it.seq) + it.first + r / group) * num_heads + kvh * group + r % group;
    };
    if (seq_len <= 0) {
      for (int64_t h = it.kvh0; h < it.kvh0 + it.heads; ++h)
        for (int64_t r = 0; r < rows; ++r) std::fill_n(out + row_of(h, r) * D, D, 0.0f);
      continue;
    }
    const int64_t context = seq_len - q_len + it.first + it.tokens;  // keys the tile's last row sees
    const int64_t num_blocks = (context + kBlock - 1) / kBlock;
    const int32_t* table = block_tables + it.seq * max_blocks;
    w.k_blocks.resize(it.heads * num_blocks);
    w.v_blocks.resize(it.heads * num_blocks);
    for (int64_t h = 0; h < it.heads; ++h)
      for (int64_t j = 0; j < num_blocks; ++j) {
        const int64_t offset = table[j] * block_stride + (it.kvh0 + h) * kChunk;
        w.k_blocks[h * num_blocks + j] = k_cache + offset;
        w.v_blocks[h * num_blocks + j] = v_cache + offset;
      }
    w.row_len.resize(rows);
    w.q_rows.resize(rows);
    w.out_rows.resize(rows);
    for (int64_t r = 0; r < rows; ++r) w.row_len[r] = seq_len - q_len + it.first + r / group + 1;
    for (int64_t h = 0; h < it.heads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t index = row_of(it.kvh0 + h, r);
        w.q_rows[r] = q + index / num_heads * q_stride + index % num_heads * D;
        w.out_rows[r] = out + index * D;
      }
      attend_head<C, Cache>(w.q_rows.data(), w.out_rows.data(), w.row_len.data(), rows,
                            w.k_blocks.data() + h * num_blocks, w.v_blocks.data() + h * num_blocks, num_blocks * kBlock,
                            scale, w.scratch);
    }
  }
}

// Every item of a step over the threads (attend_worker's arguments, num_seqs sequences).
template <int C, typename Cache, typename Prepare>
void attend(const float* q, int64_t q_stride, const int32_t* query_start, const Cache* k_cache, const Cache* v_cache,
            const int32_t* block_tables, const int32_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t max_blocks, float scale, const Prepare& prepare) {
  const Plan plan = plan_items(query_start, seq_lens, num_seqs, num_heads / num_kv_heads, num_kv_heads);
  at::parallel_for(0, static_cast<int64_t>(plan.workers.size()), 1, [&](int64_t begin, int64_t end) {
    Worker<Cache> w;
    for (int64_t worker = begin; worker < end; ++worker)
      attend_worker<C>(plan, worker, q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, num_heads,
                       num_kv_heads, max_blocks, scale, prepare, w);
  });
}

}  // namespace tokenmill::attn::avx512
