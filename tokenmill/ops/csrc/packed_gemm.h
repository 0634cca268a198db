// Weight-only GEMM over narrow packed weights for CPUs: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n].
//
// The weights are bf16 (scale 1) or int8 (per-channel scale), packed once into panels of 16 output
// channels, k-major, so decode, which is bound by reading the weights, moves 1/2 (bf16) or 1/4 (int8)
// of the bytes of fp32 weights, in long sequential streams. AVX2 builds also take float32 panels
// ([P, K, 16], channels in order): the bf16 kernels without the widening, for dtype float32, where
// the BLAS sgemm runs a decode batch's few rows well below the FMA peak.
// - bf16 panels: [P, K, 16] with the channels of each k interleaved [0, 8, 1, 9, ..., 7, 15]: one
//   32-byte load splits into channels 0-7 and 8-15 (float32) with one shift and one mask, feeding
//   FMAs against float32 activations.
// - int8 panels: [P, K/2, 16, 2], k pairs side by side per channel (K padded to even): one 32-byte
//   load sign-extends into two vectors of (k, k+1) int16 pairs, and vpmaddwd multiplies each pair by
//   the row's (x[k], x[k+1]) and adds them, 16 multiply-adds per instruction with no conversion of
//   the weights to float. For that, activation rows are quantized to int16 per row (scale
//   max|x| / 32767: an error of at most 1.5e-5 of the row's largest value, far below the int8
//   weights' own). From kDequantizeRows rows on (prefill) int8 weights are dequantized for a dense
//   float32 GEMM.
// - bf16 panels are widened in registers at one row (a shift and a mask per 16 weights, hidden behind
//   the memory stream), and for more rows once per chunk of k into an L1 buffer that every row tile
//   reads (panel_rows): at the FMA peak from ~32 rows up, the BLAS sgemm's rate, without a
//   widened float32 copy of the whole weight, so at every row count.
// These are the AVX2 layouts and kernels; CPUs with AVX-512 BF16 and VNNI take packed_gemm_avx512.h
// (bf16 in k pairs, int8 in k quads against int8 activation groups) at every row count.
// Grouped weights (uint8 panels of 4- or 8-bit levels, float16 or float32 group scales): packed_int4.h.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define TM_AVX512 1  // bf16 and int8 dot products: packed_gemm_avx512.h
#endif
#endif
#include "amx_tiles.h"  // TM_AMX: bf16 layers on AMX tiles (packed_gemm_amx.h)

namespace tokenmill::gemm {

constexpr int64_t kPanel = 16;            // output channels per panel
constexpr int64_t kRows = 6;              // activation rows per register tile (12 accumulators)
constexpr int64_t kRowBlock = 96;         // activation rows kept hot (L2) while all panels stream past
constexpr int64_t kDequantizeRows = 512;  // from this many rows on, a dense float32 GEMM (see dense_linear)

constexpr int64_t kFlushPairs = 128;  // int32 sums gain <= 2 * 127 * 32767 per k pair: flush well before 2^31

// Element (k, channel c) of a panel, as float32.
inline float weight_at(const uint16_t* panel, int64_t k, int64_t c) {  // bf16 is a float32's top half
  const uint32_t bits = static_cast<uint32_t>(panel[k * kPanel + (c < 8 ? 2 * c : 2 * (c - 8) + 1)]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float weight_at(const float* panel, int64_t k, int64_t c) { return panel[k * kPanel + c]; }
inline float weight_at(const int8_t* panel, int64_t k, int64_t c) {
  return static_cast<float>(panel[(k / 2) * 2 * kPanel + 2 * c + (k % 2)]);
}

#ifdef TM_AVX2
// One k step of a panel -> channels 0-7 and 8-15 as float32.
inline void widen16(const uint16_t* w, __m256& lo, __m256& hi) {  // interleaved: even positions are 0-7
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void widen16(const float* w, __m256& lo, __m256& hi) {  // float32 panels: in order, nothing to widen
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}

// y[0:num_cols] = acc * row_scale * scale + bias for one activation row of a panel.
inline void store_row(const __m256 (&acc)[2], float row_scale, const float* scale, const float* bias, float* y,
                      int64_t num_cols) {
  const __m256 rs = _mm256_set1_ps(row_scale);
  const __m256 r0 = _mm256_fmadd_ps(_mm256_mul_ps(acc[0], rs), _mm256_loadu_ps(scale), _mm256_loadu_ps(bias));
  const __m256 r1 = _mm256_fmadd_ps(_mm256_mul_ps(acc[1], rs), _mm256_loadu_ps(scale + 8), _mm256_loadu_ps(bias + 8));
  if (num_cols == kPanel) {
    _mm256_storeu_ps(y, r0);
    _mm256_storeu_ps(y + 8, r1);
  } else {  // the last, partial panel
    alignas(32) float buf[kPanel];
    _mm256_store_ps(buf, r0);
    _mm256_store_ps(buf + 8, r1);
    std::memcpy(y, buf, num_cols * sizeof(float));
  }
}

// One activation row against one bf16 (or float32) panel, 16 output channels, over all of K: one sum per output in k
// order, as tile_widened's for several rows (interleaved partial sums would keep more FMAs in flight,
// but round differently), so a row's result is the same bits alone (decode) or among others (prefill, a
// batch, a speculative verification step), as on AVX-512 (see tile_bf16 in packed_gemm_avx512.h).
template <typename W>
inline void row_panel(const float* x, const W* panel, int64_t K, const float* scale, const float* bias, float* y,
                      int64_t num_cols) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    widen16(panel + k * kPanel, w0, w1);
    const __m256 xv = _mm256_broadcast_ss(x + k);
    acc[0] = _mm256_fmadd_ps(xv, w0, acc[0]);
    acc[1] = _mm256_fmadd_ps(xv, w1, acc[1]);
  }
  store_row(acc, 1.0f, scale, bias, y, num_cols);
}

// One activation row against two panels at once (each broadcast of x feeds both); one sum per output
// in k order, as row_panel's.
template <typename W>
inline void tile_pair(const float* x, const W* a, const W* b, int64_t K, __m256 (&out)[2][2]) {
  for (auto& panel : out) panel[0] = panel[1] = _mm256_setzero_ps();  // [panel][channels 0-7 | 8-15]
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const __m256 xv = _mm256_broadcast_ss(x + k);
    __m256 w0, w1;
    widen16(a + k * kPanel, w0, w1);
    out[0][0] = _mm256_fmadd_ps(xv, w0, out[0][0]);
    out[0][1] = _mm256_fmadd_ps(xv, w1, out[0][1]);
    widen16(b + k * kPanel, w0, w1);
    out[1][0] = _mm256_fmadd_ps(xv, w0, out[1][0]);
    out[1][1] = _mm256_fmadd_ps(xv, w1, out[1][1]);
  }
}

// One activation row (decode at batch 1) is bound by reading the weights. A thread's panels
// [begin, end) are read as two sequential streams, its first and second half side by side: one
// stream's prefetcher keeps too few cache-line fetches in flight to reach a core's memory bandwidth.
// Calls pair(pa, pb) for panels read together and single(p) for an odd one left over.
template <typename Pair, typename Single>
void two_streams(int64_t begin, int64_t end, Pair pair, Single single) {
  const int64_t half = (end - begin + 1) / 2;
  for (int64_t j = 0; j < half; ++j) {
    const int64_t pa = begin + j, pb = begin + half + j;
    if (pb < end)
      pair(pa, pb);
    else
      single(pa);
  }
}

template <typename W>
inline void gemv_two_streams(const float* x, const W* wp, int64_t K, int64_t N, int64_t begin, int64_t end,
                             const float* scale, const float* bias, float* y) {
  const auto cols = [&](int64_t p) { return std::min(kPanel, N - p * kPanel); };
  two_streams(
      begin, end,
      [&](int64_t pa, int64_t pb) {
        __m256 out[2][2];
        tile_pair(x, wp + pa * K * kPanel, wp + pb * K * kPanel, K, out);
        store_row(out[0], 1.0f, scale + pa * kPanel, bias + pa * kPanel, y + pa * kPanel, cols(pa));
        store_row(out[1], 1.0f, scale + pb * kPanel, bias + pb * kPanel, y + pb * kPanel, cols(pb));
      },
      [&](int64_t p) {
        row_panel(x, wp + p * K * kPanel, K, scale + p * kPanel, bias + p * kPanel, y + p * kPanel, cols(p));
      });
}

// ---------------------------------------------------------------- bf16 weights, several rows
// Widening in every tile costs two vector ALU instructions per k on the ports the FMAs need (a third of
// the 6-row tile's 12 FMAs' issue slots on Intel): it held the tiles to ~70% of the FMA peak. So a
// panel is widened once per chunk of k into an L1-resident float32 buffer that every row tile of the
// row block then reads, two aligned loads per k. Each output is still one sum in k order (a tile's
// partial sums wait in `partial` between chunks, stored and reloaded exactly): row_panel's bits.
constexpr int64_t kChunk = 256;  // k steps widened at once: 256 x 16 float32 = 16 KiB

// With `ahead`, the tile also prefetches into L2 the weights read after this chunk, k step by k step.
template <int MR, typename W = float>
inline void tile_widened(const float* x, int64_t ldx, const float* w, int64_t n, __m256 (&out)[MR][2],
                         const W* ahead = nullptr) {
  for (int64_t k = 0; k < n; ++k) {
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T1);
    const __m256 w0 = _mm256_load_ps(w + k * kPanel), w1 = _mm256_load_ps(w + k * kPanel + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
      out[i][0] = _mm256_fmadd_ps(xv, w0, out[i][0]);
      out[i][1] = _mm256_fmadd_ps(xv, w1, out[i][1]);
    }
  }
}

// Calls f(std::integral_constant<int, rows>) for rows in [1, kRows].
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  static_assert(kRows == 6);
  switch (rows) {
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    default:
      return f(std::integral_constant<int, 1>{});
  }
}

// k steps [k0, k0 + n) of a panel as float32, [n, 16], 32-byte aligned: bf16 widened into wbuf (kChunk * 16
// floats, aligned); a float32 panel (32-byte aligned, as check_packed requires) is read in place.
inline const float* chunk_of(const uint16_t* panel, int64_t k0, int64_t n, float* wbuf) {
  for (int64_t k = 0; k < n; ++k) {
    __m256 lo, hi;
    widen16(panel + (k0 + k) * kPanel, lo, hi);
    _mm256_store_ps(wbuf + k * kPanel, lo);
    _mm256_store_ps(wbuf + k * kPanel + 8, hi);
  }
  return wbuf;
}
inline const float* chunk_of(const float* panel, int64_t k0, int64_t, float*) { return panel + k0 * kPanel; }

// Rows [m0, m1) (at most kRowBlock) of x [M, K] against one bf16 or float32 panel -> y's 16 (num_cols)
// columns of those rows. wbuf: kChunk * 16 floats, 32-byte aligned; partial: kRowBlock * 16 floats.
// The first row tile of each chunk prefetches the next chunk (of this panel or, panels being
// contiguous, the next one's first): a decode step reads every weight from memory once, and without
// this its GEMMs waited on those reads in chunk_of for ~30% of their time.
template <typename W>
inline void panel_rows(const float* x, int64_t K, int64_t m0, int64_t m1, const W* panel, const float* scale,
                       const float* bias, float* y, int64_t ldy, int64_t num_cols, float* wbuf, float* partial) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t n = std::min(kChunk, K - k0);
    const float* w = chunk_of(panel, k0, n, wbuf);
    const bool first = k0 == 0, last = k0 + n == K;
    // The rows split evenly over the fewest tiles (7 rows: 4 + 3, not 6 + 1): a tile of r rows keeps 2r
    // FMA chains, so one of fewer than 4 rows waits on the FMA latency.
    const int64_t tiles = (m1 - m0 + kRows - 1) / kRows, base = (m1 - m0) / tiles, extra = (m1 - m0) % tiles;
    for (int64_t tile = 0, m = m0; tile < tiles; m += base + (tile < extra), ++tile) {
      with_rows(base + (tile < extra), [&](auto rows) {
        constexpr int MR = decltype(rows)::value;
        float* part = partial + (m - m0) * kPanel;
        __m256 out[MR][2];
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          out[i][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + i * kPanel);
          out[i][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + i * kPanel + 8);
        }
        if (m == m0)
          tile_widened<MR>(x + m * K + k0, K, w, n, out, panel + (k0 + n) * kPanel);
        else
          tile_widened<MR>(x + m * K + k0, K, w, n, out);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          if (last) {
            store_row(out[i], 1.0f, scale, bias, y + (m + i) * ldy, num_cols);
          } else {
            _mm256_storeu_ps(part + i * kPanel, out[i][0]);
            _mm256_storeu_ps(part + i * kPanel + 8, out[i][1]);
          }
        }
      });
    }
  }
}

// ---------------------------------------------------------------- int8 weights x int16 activations
// Activation rows quantized to int16 (see the top of this file): values [M, KP] zero padded, a scale per row.
struct Int16Rows {
  std::vector<int16_t> values;
  std::vector<float> scales;
};

inline Int16Rows quantize_rows(const float* x, int64_t M, int64_t K, int64_t KP) {
  Int16Rows q{std::vector<int16_t>(M * KP, 0), std::vector<float>(M, 1.0f)};
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    if (!(amax > 0.0f)) continue;  // an all-zero row stays zero
    q.scales[m] = amax / 32767.0f;
    const float inv = 32767.0f / amax;
    for (int64_t k = 0; k < K; ++k) q.values[m * KP + k] = static_cast<int16_t>(std::nearbyint(row[k] * inv));
  }
  return q;
}

// NP panels (two: two sequential streams at batch 1) x MR rows over all k pairs. The int32 sums are
// moved to float32 every kFlushPairs pairs, before they could overflow.
template <int NP, int MR>
inline void tile_i16(const int16_t* x, int64_t ldx, const int8_t* const (&panels)[NP], int64_t pairs,
                     __m256 (&out)[NP][MR][2]) {
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) out[p][i][0] = out[p][i][1] = _mm256_setzero_ps();
  for (int64_t t0 = 0; t0 < pairs; t0 += kFlushPairs) {
    const int64_t t1 = std::min(pairs, t0 + kFlushPairs);
    __m256i acc[NP][MR][2];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[p][i][0] = acc[p][i][1] = _mm256_setzero_si256();
    for (int64_t t = t0; t < t1; ++t) {
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const int8_t* w = panels[p] + t * 2 * kPanel;
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));  // 0-7
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kPanel)));
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          int32_t pair;  // (x[2t], x[2t + 1]) as one 32-bit lane
          std::memcpy(&pair, x + i * ldx + 2 * t, sizeof pair);
          const __m256i xv = _mm256_set1_epi32(pair);
          acc[p][i][0] = _mm256_add_epi32(acc[p][i][0], _mm256_madd_epi16(w0, xv));
          acc[p][i][1] = _mm256_add_epi32(acc[p][i][1], _mm256_madd_epi16(w1, xv));
        }
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int h = 0; h < 2; ++h) out[p][i][h] = _mm256_add_ps(out[p][i][h], _mm256_cvtepi32_ps(acc[p][i][h]));
  }
}

// Rows [m, m + MR) of one panel.
template <int MR>
void int8_rows(const Int16Rows& q, int64_t KP, int64_t m, const int8_t* panel, const float* scale, const float* bias,
               float* y, int64_t ldy, int64_t num_cols) {
  __m256 out[1][MR][2];
  const int8_t* const panels[1] = {panel};
  tile_i16<1, MR>(q.values.data() + m * KP, KP, panels, KP / 2, out);
  for (int i = 0; i < MR; ++i) store_row(out[0][i], q.scales[m + i], scale, bias, y + i * ldy, num_cols);
}

// Fewer than kDequantizeRows rows of int8 weights, panels [begin, end).
inline void int8_small(const Int16Rows& q, int64_t M, const int8_t* wp, int64_t KP, int64_t N, int64_t begin,
                       int64_t end, const float* scale, const float* bias, float* y) {
  const auto cols = [&](int64_t p) { return std::min(kPanel, N - p * kPanel); };
  if (M == 1) {  // two panels side by side: two sequential streams (see two_streams)
    two_streams(
        begin, end,
        [&](int64_t pa, int64_t pb) {
          __m256 out[2][1][2];
          const int8_t* const panels[2] = {wp + pa * KP * kPanel, wp + pb * KP * kPanel};
          tile_i16<2, 1>(q.values.data(), KP, panels, KP / 2, out);
          store_row(out[0][0], q.scales[0], scale + pa * kPanel, bias + pa * kPanel, y + pa * kPanel, cols(pa));
          store_row(out[1][0], q.scales[0], scale + pb * kPanel, bias + pb * kPanel, y + pb * kPanel, cols(pb));
        },
        [&](int64_t p) {
          int8_rows<1>(q, KP, 0, wp + p * KP * kPanel, scale + p * kPanel, bias + p * kPanel, y + p * kPanel, N,
                       cols(p));
        });
    return;
  }
  for (int64_t p = begin; p < end; ++p) {
    const int8_t* panel = wp + p * KP * kPanel;
    const float* sp = scale + p * kPanel;
    const float* bp = bias + p * kPanel;
    for (int64_t m = 0; m < M; m += kRows) {
      float* yp = y + m * N + p * kPanel;
      with_rows(std::min(kRows, M - m),
                [&](auto rows) { int8_rows<decltype(rows)::value>(q, KP, m, panel, sp, bp, yp, N, cols(p)); });
    }
  }
}
#endif

}  // namespace tokenmill::gemm

#include "packed_int4.h"

#ifdef TM_AVX512
#include "packed_gemm_avx512.h"
#endif
#ifdef TM_AMX
#include "packed_gemm_amx.h"
#include "packed_gemm_amx_int8.h"
#endif

namespace tokenmill::gemm {

// Whether bf16 layers run on AMX tiles (packed_gemm_amx.h), and int8 ones from amx::q8::kRows: built
// with AMX, granted the tile state by the kernel and not switched off (tile::switch_to). Otherwise
// the AVX-512 dot products run the same packed weights, so the switch can flip between calls.
inline bool amx_on() { return tile::on(); }

// Which kernels this build runs: "avx512" (bf16 activations rounded to bf16, dot products at every
// row count; bf16 layers on AMX tiles where amx_on()), "avx2" (float32 arithmetic) or "scalar".
inline std::string isa() {
#if defined(TM_AVX512)
  return "avx512";
#elif defined(TM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// Scalar fallback (no AVX2/FMA at build time): same packed layout, same results up to rounding.
template <typename W>
void rows_scalar(const float* x, int64_t ldx, int64_t mr, const W* panel, int64_t K, const float* scale,
                 const float* bias, float* y, int64_t ldy, int64_t num_cols) {
  for (int64_t i = 0; i < mr; ++i) {
    float acc[kPanel] = {0};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kPanel; ++c) acc[c] += x[i * ldx + k] * weight_at(panel, k, c);
    for (int64_t j = 0; j < num_cols; ++j) y[i * ldy + j] = acc[j] * scale[j] + bias[j];
  }
}

// Prefill-sized batches of int8 weights (and of every kind in builds without AVX2): the GEMM is compute
// bound, and the BLAS sgemm beats those tiles, so widen the weight once to float32 (cheap next to
// 2*M*N*K flops) and let at::linear run it.
template <typename W>
at::Tensor dense_linear(const at::Tensor& x, const W* wp, int64_t P, int64_t KP, const at::Tensor& scale,
                        const at::Tensor& bias, int64_t N) {
  const int64_t K = x.size(1);
  const int64_t NP = P * kPanel;
  at::Tensor wt = at::empty({K, NP}, x.options());  // the weight transposed, [K, N padded]: panels stay contiguous
  const float* sp = scale.data_ptr<float>();
  float* dp = wt.data_ptr<float>();
  at::parallel_for(0, K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t c = 0; c < kPanel; ++c)
          dp[k * NP + p * kPanel + c] = weight_at(wp + p * KP * kPanel, k, c) * sp[p * kPanel + c];
  });
  return at::addmm(bias.narrow(0, 0, N), x, wt.narrow(1, 0, N));
}

template <typename W>
at::Tensor linear(const at::Tensor& x, const W* wp, int64_t P, int64_t KP, const at::Tensor& scale,
                  const at::Tensor& bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
#ifdef TM_AVX512
  return avx512::linear(x, wp, P, KP, scale, bias, N);
#endif
#ifdef TM_AVX2
  constexpr bool tiled_at_every_row_count = !std::is_same_v<W, int8_t>;  // panel_rows
#else
  constexpr bool tiled_at_every_row_count = false;
#endif
  if (M >= kDequantizeRows && !tiled_at_every_row_count) return dense_linear(x, wp, P, KP, scale, bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef TM_AVX2
  if constexpr (std::is_same_v<W, int8_t>) {  // integer multiply-adds never widen the weights
    const Int16Rows q = quantize_rows(xp, M, K, KP);
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) { int8_small(q, M, wp, KP, N, begin, end, sp, bp, yp); });
    return y;
  } else if (M == 1) {
    at::parallel_for(0, P, 1,
                     [&](int64_t begin, int64_t end) { gemv_two_streams(xp, wp, K, N, begin, end, sp, bp, yp); });
    return y;
  } else {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
        alignas(32) float wbuf[kChunk * kPanel];
        float partial[kRowBlock * kPanel];
        for (int64_t p = begin; p < end; ++p) {
          const int64_t n0 = p * kPanel;
          panel_rows(xp, K, m0, m1, wp + p * KP * kPanel, sp + n0, bp + n0, yp + n0, N, std::min(kPanel, N - n0), wbuf,
                     partial);
        }
      });
    }
    return y;
  }
#endif
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {  // builds without AVX2
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, num_cols = std::min(kPanel, N - n0);
        const W* panel = wp + p * KP * kPanel;
        for (int64_t m = m0; m < m1; m += kRows)
          rows_scalar(xp + m * K, K, std::min(kRows, m1 - m), panel, K, sp + n0, bp + n0, yp + m * N + n0, N, num_cols);
      }
    });
  }
  return y;
}

// Whether N outputs in P panels are [gate | up] halves of whole panels, as silu_mul pairs them.
inline bool halves_of_whole_panels(int64_t P, int64_t N) { return N == P * kPanel && P % 2 == 0; }

// x: [M, K] float32 contiguous; packed: [P, KP, 16] bf16 or int8 (layouts above and in packed_gemm_avx512.h);
// scale, bias: [P * 16] float32
// (scale all ones for bf16) -> [M, N] float32. With silu_mul (the outputs are [gate | up] halves of
// whole panels: N == 16 P, P even) -> [M, N / 2], silu(gate) * up.
// Throws unless packed ([P, KP, 16] int8 or bf16), scale and bias ([P * 16] float32) make a GEMM of
// K in-features and N out-features (with silu_mul: [gate | up] halves of whole panels).
// Grouped weights (uint8 packed) take their group scales (and minimums) as `scale`: grouped::check.
inline void check_packed(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& bias, int64_t K,
                         int64_t N, bool silu_mul) {
  if (packed.scalar_type() == at::kByte) {
    grouped::check(packed, scale, bias, K, N);
    TORCH_CHECK(!silu_mul || halves_of_whole_panels(packed.size(0), N),
                "silu_mul needs [gate | up] halves of whole panels");
    return;
  }
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "packed: contiguous [P, K, 16]");
  const int64_t P = packed.size(0), KP = packed.size(1);
  const bool int8 = packed.scalar_type() == at::kChar, f32 = packed.scalar_type() == at::kFloat;
  TORCH_CHECK(int8 || f32 || packed.scalar_type() == at::kBFloat16, "packed weights must be int8, bfloat16 or float32");
#ifdef TM_AVX512  // bf16 panels in k pairs, int8 in k quads, both of whole groups of 32 k (quant/panels.py)
  TORCH_CHECK(!f32, "float32 panels are for AVX2 builds; this build's float32 layers run at::linear");
  const int64_t expected = (K + avx512::kGroup - 1) / avx512::kGroup * avx512::kGroup;
#else
  const int64_t expected = int8 ? K + K % 2 : K;
  // panel_rows reads float32 panels in place with aligned loads
  TORCH_CHECK(!f32 || reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0, "float32 panels: 32-byte aligned");
#endif
  TORCH_CHECK(KP == expected, "x has ", K, " features, the weight ", KP, " (expected ", expected, ")");
  TORCH_CHECK(P * kPanel >= N && scale.numel() == P * kPanel && bias.numel() == P * kPanel &&
                  scale.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  bias.is_contiguous(),
              "scale, bias: contiguous [P * 16] float32");
  TORCH_CHECK(!silu_mul || halves_of_whole_panels(P, N), "silu_mul needs [gate | up] halves of whole panels");
}

inline at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                const at::Tensor& bias, int64_t N, bool silu_mul) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [M, K] float32");
  check_packed(packed, scale, bias, x.size(1), N, silu_mul);
  const int64_t P = packed.size(0), KP = packed.size(1);
  const bool int8 = packed.scalar_type() == at::kChar, grouped_levels = packed.scalar_type() == at::kByte;
#ifdef TM_AVX512  // the activation in the GEMM's epilogue
  if (grouped_levels)
    return avx512::linear(x, packed.data_ptr<uint8_t>(), P, KP, scale, bias, N, silu_mul, packed.size(2));
  if (int8) {
#ifdef TM_AMX
    if (amx_on() && x.size(0) >= amx::q8::kRows)  // the same bits as the VNNI tiles (packed_gemm_amx_int8.h)
      return amx::q8::linear(x, packed.data_ptr<int8_t>(), P, KP, scale, bias, N, silu_mul);
#endif
    return avx512::linear(x, packed.data_ptr<int8_t>(), P, KP, scale, bias, N, silu_mul);
  }
#ifdef TM_AMX
  if (amx_on())
    return amx::linear(x, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), P, KP, bias, N, silu_mul);
#endif
  return avx512::linear(x, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), P, KP, scale, bias, N,
                        silu_mul);
#else
  const at::Tensor y =
      grouped_levels ? grouped::linear(x, packed, scale, bias, N)
      : int8         ? linear(x, packed.data_ptr<int8_t>(), P, KP, scale, bias, N)
      : packed.scalar_type() == at::kFloat
          ? linear(x, packed.data_ptr<float>(), P, KP, scale, bias, N)
          : linear(x, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), P, KP, scale, bias, N);
  if (!silu_mul) return y;
  return at::silu(y.narrow(1, 0, N / 2)).mul_(y.narrow(1, N / 2, N / 2));
#endif
}

// packed_linear of bf16 panels on AMX tiles, plus LoRA adapters' updates in its epilogue (amx::LoRAEpilogue):
// slot, rank [M] int32 (slot -1: none); t [M, W] float32 (x A^T); bt [slots, R, N] float32; piece_end
// [pieces] int64, multiples of 16 but the last (N). Only where amx_on(): the caller checks.
inline at::Tensor packed_linear_lora(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                     const at::Tensor& bias, int64_t N, bool silu_mul, const at::Tensor& slot,
                                     const at::Tensor& rank, const at::Tensor& t, const at::Tensor& bt,
                                     const at::Tensor& piece_end) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [M, K] float32");
  check_packed(packed, scale, bias, x.size(1), N, silu_mul);
  const int64_t M = x.size(0), pieces = piece_end.numel();
  TORCH_CHECK(slot.scalar_type() == at::kInt && rank.scalar_type() == at::kInt && slot.numel() == M &&
                  rank.numel() == M && slot.is_contiguous() && rank.is_contiguous(),
              "slot, rank: [M] int32");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == M && t.is_contiguous(),
              "t: [M, W] float32");
  TORCH_CHECK(bt.scalar_type() == at::kFloat && bt.dim() == 3 && bt.size(2) == N && bt.is_contiguous(),
              "bt: [slots, R, N] float32");
  TORCH_CHECK(piece_end.scalar_type() == at::kLong && pieces >= 1 && piece_end.is_contiguous(),
              "piece_end: [pieces] int64");
  const int64_t* ends = piece_end.data_ptr<int64_t>();
  for (int64_t p = 0; p < pieces; ++p)
    TORCH_CHECK(ends[p] > (p > 0 ? ends[p - 1] : 0) && (p + 1 < pieces ? ends[p] % kPanel == 0 : ends[p] == N),
                "piece_end: rising, whole panels, the last N");
  const int32_t* s = slot.data_ptr<int32_t>();
  const int32_t* r = rank.data_ptr<int32_t>();
  for (int64_t m = 0; m < M; ++m)  // the epilogue trusts these to address t and bt
    TORCH_CHECK(s[m] < bt.size(0) && (s[m] < 0 || (r[m] >= 1 && pieces * r[m] <= std::min(bt.size(1), t.size(1)))),
                "slot, rank: out of range at row ", m);
#ifdef TM_AMX
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && amx_on(), "packed_linear_lora: bf16 panels on AMX tiles only");
  const amx::LoRAEpilogue lora{s, r, t.data_ptr<float>(), t.size(1), bt.data_ptr<float>(), bt.size(1), ends, pieces};
  return amx::linear(x, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), packed.size(0),
                     packed.size(1), bias, N, silu_mul, &lora);
#else
  TORCH_CHECK(false, "packed_linear_lora: this build has no AMX kernels");
  return at::Tensor();
#endif
}

// The registered ops (packed_gemm.cpp).
inline at::Tensor packed_linear_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                   const at::Tensor& bias, int64_t N) {
  return packed_linear(x, packed, scale, bias, N, false);
}

inline at::Tensor packed_linear_lora_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                        const at::Tensor& bias, int64_t N, bool silu_mul, const at::Tensor& slot,
                                        const at::Tensor& rank, const at::Tensor& t, const at::Tensor& bt,
                                        const at::Tensor& piece_end) {
  return packed_linear_lora(x, packed, scale, bias, N, silu_mul, slot, rank, t, bt, piece_end);
}

inline at::Tensor packed_linear_silu_mul_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                            const at::Tensor& bias, int64_t N) {
  return packed_linear(x, packed, scale, bias, N, true);
}

}  // namespace tokenmill::gemm
