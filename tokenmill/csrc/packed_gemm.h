// Weight-only GEMM over narrow packed weights for CPUs: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n].
//
// The weights are int8 (per-channel scale) or bf16 (scale 1): activations stay float32, and the
// weights are widened to float32 in registers as they stream in, so decode, which is bound by
// reading the weights, moves 1/4 (int8) or 1/2 (bf16) of the bytes of fp32 weights.
// Weights are packed once into panels of 16 output channels, k-major: [num_panels, K, 16], so one
// k step reads 16 contiguous elements and feeds two 8-wide FMA vectors per activation row.
// bf16 panels interleave their channels [0, 8, 1, 9, ..., 7, 15] (quant/panels.py): one 32-byte
// load then splits into channels 0-7 and 8-15 with a shift and a mask.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/addmm.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_AVX2 1
#endif

namespace tokenmill::gemm {

constexpr int64_t kPanel = 16;  // output channels per panel
constexpr int64_t kRows = 6;    // activation rows per register tile (12 accumulators)
constexpr int64_t kRowBlock = 96;  // activation rows kept hot (L2) while all panels stream past
constexpr int64_t kPrewidenRows = 16;  // from this many rows on, widen each panel once per row block
constexpr int64_t kDequantizeRows = 128;  // from this many rows on, a dense float32 GEMM (see dense_linear)

// bf16 is the top half of a float32: widening is a 16-bit shift.
inline float to_float(int8_t w) { return static_cast<float>(w); }
inline float to_float(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The channel that packed position j (0..15) of a panel holds.
inline int64_t channel_of(int64_t j, const int8_t*) { return j; }
inline int64_t channel_of(int64_t j, const float*) { return j; }
inline int64_t channel_of(int64_t j, const uint16_t*) { return (j % 2) * (kPanel / 2) + j / 2; }

#ifdef TM_AVX2
inline __m256 widen8(const int8_t* w) {  // 8 int8 -> 8 float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// One k step of a panel -> channels 0-7 and 8-15 as float32.
inline void widen16(const int8_t* w, __m256& lo, __m256& hi) {
  lo = widen8(w);
  hi = widen8(w + 8);
}
inline void widen16(const uint16_t* w, __m256& lo, __m256& hi) {  // interleaved: even positions are 0-7
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void widen16(const float* w, __m256& lo, __m256& hi) {  // a panel widened beforehand
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}

// One register tile: MR activation rows x 16 output channels, over all of K. With few rows the
// K loop is split into U interleaved partial sums so enough FMAs are in flight.
template <int MR, int U, typename W>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t K, __m256 (&out)[MR][2]) {
  __m256 acc[U][MR][2];
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < MR; ++i) acc[u][i][0] = acc[u][i][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      __m256 w0, w1;
      widen16(panel + (k + u) * kPanel, w0, w1);
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k + u);
        acc[u][i][0] = _mm256_fmadd_ps(xv, w0, acc[u][i][0]);
        acc[u][i][1] = _mm256_fmadd_ps(xv, w1, acc[u][i][1]);
      }
    }
  }
  for (; k < K; ++k) {
    __m256 w0, w1;
    widen16(panel + k * kPanel, w0, w1);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
      acc[0][i][0] = _mm256_fmadd_ps(xv, w0, acc[0][i][0]);
      acc[0][i][1] = _mm256_fmadd_ps(xv, w1, acc[0][i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    out[i][0] = acc[0][i][0];
    out[i][1] = acc[0][i][1];
    for (int u = 1; u < U; ++u) {
      out[i][0] = _mm256_add_ps(out[i][0], acc[u][i][0]);
      out[i][1] = _mm256_add_ps(out[i][1], acc[u][i][1]);
    }
  }
}

// y[0:num_cols] = acc * scale + bias for one activation row of a panel.
inline void store_row(const __m256 (&acc)[2], const float* scale, const float* bias, float* y, int64_t num_cols) {
  const __m256 r0 = _mm256_fmadd_ps(acc[0], _mm256_loadu_ps(scale), _mm256_loadu_ps(bias));
  const __m256 r1 = _mm256_fmadd_ps(acc[1], _mm256_loadu_ps(scale + 8), _mm256_loadu_ps(bias + 8));
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

template <int MR, int U, typename W>
void rows(const float* x, int64_t ldx, const W* panel, int64_t K, const float* scale, const float* bias,
          float* y, int64_t ldy, int64_t num_cols) {
  __m256 out[MR][2];
  tile<MR, U, W>(x, ldx, panel, K, out);
  for (int i = 0; i < MR; ++i) store_row(out[i], scale, bias, y + i * ldy, num_cols);
}

// One activation row against two panels at once (each broadcast of x feeds both).
template <typename W>
inline void tile_pair(const float* x, const W* a, const W* b, int64_t K, __m256 (&out)[2][2]) {
  __m256 acc[2][2][2];  // [panel][partial sum][channels 0-7 | 8-15]
  for (auto& panel : acc)
    for (auto& sum : panel) sum[0] = sum[1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    for (int u = 0; u < 2; ++u) {
      const __m256 xv = _mm256_broadcast_ss(x + k + u);
      __m256 w0, w1;
      widen16(a + (k + u) * kPanel, w0, w1);
      acc[0][u][0] = _mm256_fmadd_ps(xv, w0, acc[0][u][0]);
      acc[0][u][1] = _mm256_fmadd_ps(xv, w1, acc[0][u][1]);
      widen16(b + (k + u) * kPanel, w0, w1);
      acc[1][u][0] = _mm256_fmadd_ps(xv, w0, acc[1][u][0]);
      acc[1][u][1] = _mm256_fmadd_ps(xv, w1, acc[1][u][1]);
    }
  }
  for (; k < K; ++k) {
    const __m256 xv = _mm256_broadcast_ss(x + k);
    __m256 w0, w1;
    widen16(a + k * kPanel, w0, w1);
    acc[0][0][0] = _mm256_fmadd_ps(xv, w0, acc[0][0][0]);
    acc[0][0][1] = _mm256_fmadd_ps(xv, w1, acc[0][0][1]);
    widen16(b + k * kPanel, w0, w1);
    acc[1][0][0] = _mm256_fmadd_ps(xv, w0, acc[1][0][0]);
    acc[1][0][1] = _mm256_fmadd_ps(xv, w1, acc[1][0][1]);
  }
  for (int p = 0; p < 2; ++p)
    for (int h = 0; h < 2; ++h) out[p][h] = _mm256_add_ps(acc[p][0][h], acc[p][1][h]);
}

// One activation row (decode at batch 1), panels [begin, end): bound by reading the weights. The
// range is read as two sequential streams, its first and second half side by side: one stream's
// prefetcher keeps too few cache-line fetches in flight to reach a core's memory bandwidth.
template <typename W>
void gemv_two_streams(const float* x, const W* wp, int64_t K, int64_t N, int64_t begin, int64_t end,
                      const float* scale, const float* bias, float* y) {
  const int64_t half = (end - begin + 1) / 2;
  for (int64_t j = 0; j < half; ++j) {
    const int64_t pa = begin + j, pb = begin + half + j;
    if (pb < end) {
      __m256 out[2][2];
      tile_pair(x, wp + pa * K * kPanel, wp + pb * K * kPanel, K, out);
      store_row(out[0], scale + pa * kPanel, bias + pa * kPanel, y + pa * kPanel, std::min(kPanel, N - pa * kPanel));
      store_row(out[1], scale + pb * kPanel, bias + pb * kPanel, y + pb * kPanel, std::min(kPanel, N - pb * kPanel));
    } else {
      rows<1, 4, W>(x, K, wp + pa * K * kPanel, K, scale + pa * kPanel, bias + pa * kPanel, y + pa * kPanel, 0,
                    std::min(kPanel, N - pa * kPanel));
    }
  }
}
#endif

// Scalar fallback (no AVX2/FMA at build time): same packed layout, same results up to rounding.
template <typename W>
void rows_scalar(const float* x, int64_t ldx, int64_t mr, const W* panel, int64_t K, const float* scale,
                 const float* bias, float* y, int64_t ldy, int64_t num_cols) {
  for (int64_t i = 0; i < mr; ++i) {
    float acc[kPanel] = {0};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kPanel; ++j)
        acc[channel_of(j, panel)] += x[i * ldx + k] * to_float(panel[k * kPanel + j]);
    for (int64_t j = 0; j < num_cols; ++j) y[i * ldy + j] = acc[j] * scale[j] + bias[j];
  }
}

template <typename W>
void panel_rows(const float* x, int64_t ldx, int64_t mr, const W* panel, int64_t K, const float* scale,
                const float* bias, float* y, int64_t ldy, int64_t num_cols) {
#ifdef TM_AVX2
  switch (mr) {
    case 6: return rows<6, 1, W>(x, ldx, panel, K, scale, bias, y, ldy, num_cols);
    case 5: return rows<5, 1, W>(x, ldx, panel, K, scale, bias, y, ldy, num_cols);
    case 4: return rows<4, 1, W>(x, ldx, panel, K, scale, bias, y, ldy, num_cols);
    case 3: return rows<3, 2, W>(x, ldx, panel, K, scale, bias, y, ldy, num_cols);
    case 2: return rows<2, 2, W>(x, ldx, panel, K, scale, bias, y, ldy, num_cols);
    default: return rows<1, 8, W>(x, ldx, panel, K, scale, bias, y, ldy, num_cols);
  }
#else
  rows_scalar(x, ldx, mr, panel, K, scale, bias, y, ldy, num_cols);
#endif
}

// Prefill-sized batches: the GEMM is compute bound, and the BLAS sgemm beats our register tiles, so
// widen the weight once to float32 (cheap next to 2*M*N*K flops) and let at::linear run it.
template <typename W>
at::Tensor dense_linear(const at::Tensor& x, const W* wp, int64_t P, int64_t K, const at::Tensor& scale,
                        const at::Tensor& bias, int64_t N) {
  const int64_t NP = P * kPanel;
  at::Tensor wt = at::empty({K, NP}, x.options());  // the weight transposed, [K, N padded]: panels stay contiguous
  const float* sp = scale.data_ptr<float>();
  float* dp = wt.data_ptr<float>();
  at::parallel_for(0, K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t j = 0; j < kPanel; ++j)
          dp[k * NP + p * kPanel + channel_of(j, wp)] =
              to_float(wp[(p * K + k) * kPanel + j]) * sp[p * kPanel + channel_of(j, wp)];
  });
  return at::addmm(bias.narrow(0, 0, N), x, wt.narrow(1, 0, N));
}

template <typename W>
at::Tensor linear(const at::Tensor& x, const W* wp, int64_t P, const at::Tensor& scale, const at::Tensor& bias,
                  int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M >= kDequantizeRows) return dense_linear(x, wp, P, K, scale, bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // With many rows, widening the weights inside every tile costs more than the FMAs it feeds: each
  // panel is widened once per row block into a float buffer (L2-resident) that the tiles read.
  const bool prewiden = M >= kPrewidenRows;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
#ifdef TM_AVX2
      if (M == 1) return gemv_two_streams(xp, wp, K, N, begin, end, sp, bp, yp);
#endif
      std::vector<float> widened(prewiden ? K * kPanel : 0);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, num_cols = std::min(kPanel, N - n0);
        const W* panel = wp + p * K * kPanel;
        if (prewiden)
          for (int64_t i = 0; i < K * kPanel; i += kPanel)  // in channel order
            for (int64_t j = 0; j < kPanel; ++j) widened[i + channel_of(j, panel)] = to_float(panel[i + j]);
        for (int64_t m = m0; m < m1; m += kRows) {
          const int64_t mr = std::min(kRows, m1 - m);
          if (prewiden)
            panel_rows(xp + m * K, K, mr, widened.data(), K, sp + n0, bp + n0, yp + m * N + n0, N, num_cols);
          else
            panel_rows(xp + m * K, K, mr, panel, K, sp + n0, bp + n0, yp + m * N + n0, N, num_cols);
        }
      }
    });
  }
  return y;
}

// x: [M, K] float32 contiguous; packed: [P, K, 16] int8 or bf16; scale, bias: [P * 16] float32
// (scale all ones for bf16) -> [M, N] float32
inline at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                const at::Tensor& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed: contiguous [P, K, 16]");
  const int64_t K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features, the weight ", packed.size(1));
  TORCH_CHECK(P * kPanel >= N && scale.numel() == P * kPanel && bias.numel() == P * kPanel, "bad scale/bias");
  if (packed.scalar_type() == at::kChar) return linear(x, packed.data_ptr<int8_t>(), P, scale, bias, N);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "packed weights must be int8 or bfloat16");
  return linear(x, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), P, scale, bias, N);
}

}  // namespace tokenmill::gemm
