// The 4-bit weight GEMM: y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] with group-wise weights
// w[n, k] = d[n, g] * q[n, k] + mn[n, g] (with minimums) or d[n, g] * (q[n, k] - 8) (without),
// g = k / group, q in 0..15 two a byte (quant/int4.py quantizes, quant/panels.py pack_int4 packs).
//
// Layout: panels of 16 output channels, [P, KP, 8] bytes. Per panel and 32 k, four 64-byte lines:
// line j holds channel c's levels for k 4j..4j+3 in bytes 4c..4c+3, low nibbles, and for k
// 16+4j..16+4j+3 in the high nibbles: the int8 GEMM's k quads, two quads a byte. params: float16
// [P, G, 16] scales, or [P, G, 2, 16] scales then minimums, G = KP / group (group a multiple of 32;
// K padded to whole groups with zero weights).
//
// Activation rows are quantized to int8 in groups of 32 (scale max|x| / 127), as the int8 AVX-512
// kernel does (quantize_q8_row), on every instruction set: then each (32-group, channel) dot
// product of levels and activations is an exact int32, dot, and a group adds
//   s_x * d * (dot - 8 * sum(x_q))          (no minimums: the -8 starts the integer sum)
//   s_x * (d * dot + mn * sum(x_q))          (minimums)
// to the channel's float32 total. AVX-512 VNNI: tile_q4 in packed_gemm_avx512.h (vpdpbusd on the
// unpacked nibbles). AVX2 (here): vpmaddubsw multiplies the unsigned levels by the signed int8
// activations into int16 pair sums (at most 2 * 15 * 127 = 3810), eight of which (a group) add up
// in int16 without overflow (30480 < 32767); vpmaddwd by ones then widens each channel's quad to
// int32. The integer sums are the VNNI kernel's exactly.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tokenmill::gemm::int4 {

constexpr int64_t kPanel = 16;        // output channels per panel
constexpr int64_t kGroup = 32;        // activation values per int8 scale, and k per run of four lines
constexpr int64_t kGroupBytes = 256;  // one panel's levels for 32 k
constexpr int64_t kLines = 4;         // 64-byte lines per panel per 32 k
constexpr int64_t kRowBlock = 96;     // activation rows kept hot (L2) while all panels stream past

// How a layer's params tensor groups its weights.
struct Geometry {
  int64_t group;          // k per weight group (a multiple of kGroup)
  int64_t per;            // activation groups per weight group: group / kGroup
  int64_t params_stride;  // float16 params per panel
  int64_t group_params;   // float16 params per panel and weight group: 16 scales (and 16 minimums)
  bool minimums;
};

inline Geometry geometry(const at::Tensor& params, int64_t KP) {
  const int64_t group = KP / params.size(1);
  const bool minimums = params.dim() == 4;
  return {group, group / kGroup, params.numel() / params.size(0), (minimums ? 2 : 1) * kPanel, minimums};
}

// Throws unless packed ([P, KP, 8] uint8), params and bias ([P * 16] float32) make a 4-bit GEMM of
// K in-features (padded to KP, whole groups) and N out-features.
inline void check(const at::Tensor& packed, const at::Tensor& params, const at::Tensor& bias, int64_t K, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel / 2 && packed.is_contiguous(),
              "int4 packed weights: contiguous [P, K, 8] uint8");
  const int64_t P = packed.size(0), KP = packed.size(1);
  TORCH_CHECK(params.scalar_type() == at::kHalf && params.is_contiguous() && params.size(0) == P &&
                  ((params.dim() == 3 && params.size(2) == kPanel) ||
                   (params.dim() == 4 && params.size(2) == 2 && params.size(3) == kPanel)),
              "int4 params: contiguous [P, G, 16] or [P, G, 2, 16] float16");
  const int64_t G = params.size(1);
  TORCH_CHECK(G > 0 && KP % G == 0 && (KP / G) % kGroup == 0 && KP >= K && KP - K < KP / G, "x has ", K,
              " features, the int4 weight ", KP, " in ", G,
              " groups (expected K padded to whole groups of a "
              "multiple of 32)");
  TORCH_CHECK(P * kPanel >= N && bias.numel() == P * kPanel && bias.scalar_type() == at::kFloat && bias.is_contiguous(),
              "bias: contiguous [P * 16] float32");
}

// Level (k, channel c) of a panel.
inline int level(const uint8_t* panel, int64_t k, int64_t c) {
  const int64_t r = k % kGroup;
  const uint8_t b = panel[k / kGroup * kGroupBytes + (r % 16) / 4 * 64 + c * 4 + r % 4];
  return r < 16 ? b & 0x0F : b >> 4;
}

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// ------------------------------------------------------------------------------- activations
// Rows as int8 groups: values [M, KP] (zero padded), per group a scale and the sum of its values.
struct Q8Rows {
  std::vector<int8_t> values;
  std::vector<float> scales;
  std::vector<int32_t> sums;
};

// The rounding of quantize_q8_row (packed_gemm_avx512.h): x * (127 / amax) to nearest even.
inline void quantize_row(const float* x, int64_t K, int64_t KP, int8_t* values, float* scales, int32_t* sums) {
  for (int64_t g = 0; g < KP / kGroup; ++g) {
    const int64_t k0 = g * kGroup, k1 = std::min(K, k0 + kGroup);
    float amax = 0.0f;
    for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(x[k]));
    int32_t sum = 0;
    if (!(amax > 0.0f)) {
      std::memset(values + k0, 0, kGroup);
      scales[g] = 0.0f;
    } else {
      const float inv = 127.0f / amax;
      for (int64_t k = k0; k < k0 + kGroup; ++k) {
        const int32_t v = k < k1 ? static_cast<int32_t>(std::nearbyint(x[k] * inv)) : 0;
        values[k] = static_cast<int8_t>(v);
        sum += v;
      }
      scales[g] = amax / 127.0f;
    }
    sums[g] = sum;
  }
}

inline Q8Rows quantize_rows(const float* x, int64_t M, int64_t K, int64_t KP) {
  const int64_t G = KP / kGroup;
  Q8Rows q{std::vector<int8_t>(M * KP), std::vector<float>(M * G), std::vector<int32_t>(M * G)};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(x + m * K, K, KP, q.values.data() + m * KP, q.scales.data() + m * G, q.sums.data() + m * G);
  });
  return q;
}

// One row of one panel, scalar: y[0:num_cols] (the reference of the vector tiles, and the path of
// builds without AVX2).
inline void row_scalar(const Q8Rows& q, int64_t m, int64_t KP, const uint8_t* panel, const uint16_t* params,
                       const Geometry& geo, const float* bias, float* y, int64_t num_cols) {
  const int64_t G = KP / kGroup;
  const int8_t* xv = q.values.data() + m * KP;
  for (int64_t c = 0; c < num_cols; ++c) {
    float total = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* p = params + g / geo.per * geo.group_params;
      int32_t dot = 0;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) dot += level(panel, k, c) * xv[k];
      const float s = q.scales[m * G + g], d = half_to_float(p[c]);
      const int32_t sum = q.sums[m * G + g];
      total += geo.minimums ? s * (d * dot + half_to_float(p[kPanel + c]) * sum) : s * d * (dot - 8 * sum);
    }
    y[c] = total + bias[c];
  }
}

#ifdef TM_AVX2
inline __m256i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof quad);
  return _mm256_set1_epi32(quad);
}

// NP panels x MR rows over all activation groups: out[p][i][h] holds row i's channels 8h..8h+7 of
// panel p. x: row 0's int8 values (rows ldx apart), its group scales and sums (rows ldg apart).
template <int NP, int MR, bool kMinimums>
inline void tile(const int8_t* x, const float* scales, const int32_t* sums, int64_t ldx, int64_t ldg,
                 const uint8_t* const (&panels)[NP], const uint16_t* const (&params)[NP], const Geometry& geo,
                 __m256 (&out)[NP][MR][2]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) out[p][i][0] = out[p][i][1] = _mm256_setzero_ps();
  __m256 d[NP][2], mn[NP][2];
  const uint16_t* pp[NP];  // the next weight group's scales (and minimums)
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p) pp[p] = params[p];
  int64_t left = 0;  // activation groups left in the current weight group (a counter: no division)
  for (int64_t g = 0; g < ldg; ++g) {
    if (left-- == 0) {  // the next weight group's scales (and minimums), channels 0-7 and 8-15
      left = geo.per - 1;
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        for (int h = 0; h < 2; ++h) {
          d[p][h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pp[p] + 8 * h)));
          if constexpr (kMinimums)
            mn[p][h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pp[p] + kPanel + 8 * h)));
        }
        pp[p] += geo.group_params;
      }
    }
    __m256i acc[NP][MR][2];  // int16 pair sums
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[p][i][0] = acc[p][i][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < kLines; ++j) {
      __m256i xlo[MR], xhi[MR];  // row i's quads for k 4j.. (low nibbles) and 16 + 4j.. (high)
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        xlo[i] = broadcast_quad(x + i * ldx + g * kGroup + 4 * j);
        xhi[i] = broadcast_quad(x + i * ldx + g * kGroup + 16 + 4 * j);
      }
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panels[p] + g * kGroupBytes + j * 64 + h * 32));
          const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i) {
            acc[p][i][h] = _mm256_add_epi16(acc[p][i][h], _mm256_maddubs_epi16(lo, xlo[i]));
            acc[p][i][h] = _mm256_add_epi16(acc[p][i][h], _mm256_maddubs_epi16(hi, xhi[i]));
          }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256 s = _mm256_set1_ps(scales[i * ldg + g]);
      const int32_t sum = sums[i * ldg + g];
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i dot = _mm256_madd_epi16(acc[p][i][h], ones);  // [8] int32, one per channel
          if constexpr (kMinimums) {
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d[p][h],
                                             _mm256_mul_ps(mn[p][h], _mm256_set1_ps(static_cast<float>(sum))));
            out[p][i][h] = _mm256_fmadd_ps(t, s, out[p][i][h]);
          } else {
            const __m256i centred = _mm256_add_epi32(dot, _mm256_set1_epi32(-8 * sum));
            out[p][i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(d[p][h], s), out[p][i][h]);
          }
        }
    }
  }
}

inline void store(const __m256 (&acc)[2], const float* bias, float* y, int64_t num_cols) {
  alignas(32) float buf[kPanel];
  _mm256_store_ps(buf, _mm256_add_ps(acc[0], _mm256_loadu_ps(bias)));
  _mm256_store_ps(buf + 8, _mm256_add_ps(acc[1], _mm256_loadu_ps(bias + 8)));
  std::memcpy(y, buf, num_cols * sizeof(float));
}

// Rows [m, m + MR) x NP panels of the problem, stored into y ([M, N]).
template <int NP, int MR>
inline void run(const Q8Rows& q, int64_t m, int64_t KP, const uint8_t* wp, const uint16_t* pp, const Geometry& geo,
                const int64_t (&panel)[NP], const float* bias, float* y, int64_t N) {
  const int64_t G = KP / kGroup;
  const uint8_t* panels[NP];
  const uint16_t* params[NP];
  for (int p = 0; p < NP; ++p) {
    panels[p] = wp + panel[p] * KP * (kPanel / 2);
    params[p] = pp + panel[p] * geo.params_stride;
  }
  __m256 out[NP][MR][2];
  const int8_t* x = q.values.data() + m * KP;
  if (geo.minimums)
    tile<NP, MR, true>(x, q.scales.data() + m * G, q.sums.data() + m * G, KP, G, panels, params, geo, out);
  else
    tile<NP, MR, false>(x, q.scales.data() + m * G, q.sums.data() + m * G, KP, G, panels, params, geo, out);
  for (int p = 0; p < NP; ++p) {
    const int64_t n0 = panel[p] * kPanel;
    for (int i = 0; i < MR; ++i) store(out[p][i], bias + n0, y + (m + i) * N + n0, std::min(kPanel, N - n0));
  }
}
#endif

// x: [M, K] float32 -> [M, N] float32 (builds without AVX-512 VNNI; those take avx512::linear).
inline at::Tensor linear(const at::Tensor& x, const uint8_t* wp, int64_t P, int64_t KP, const at::Tensor& params,
                         const at::Tensor& bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const Geometry geo = geometry(params, KP);
  const Q8Rows q = quantize_rows(x.data_ptr<float>(), M, K, KP);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(params.data_ptr<at::Half>());
  const float* bp = bias.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef TM_AVX2
  if (M == 1) {  // two panels side by side: two sequential streams (see two_streams)
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      two_streams(
          begin, end,
          [&](int64_t pa, int64_t pb) {
            const int64_t panel[2] = {pa, pb};
            run<2, 1>(q, 0, KP, wp, pp, geo, panel, bp, yp, N);
          },
          [&](int64_t p) {
            const int64_t panel[1] = {p};
            run<1, 1>(q, 0, KP, wp, pp, geo, panel, bp, yp, N);
          });
    });
    return y;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t panel[1] = {p};
        for (int64_t m = m0; m < m1; m += 3) {
          switch (std::min<int64_t>(3, m1 - m)) {
            case 3:
              run<1, 3>(q, m, KP, wp, pp, geo, panel, bp, yp, N);
              break;
            case 2:
              run<1, 2>(q, m, KP, wp, pp, geo, panel, bp, yp, N);
              break;
            default:
              run<1, 1>(q, m, KP, wp, pp, geo, panel, bp, yp, N);
          }
        }
      }
    });
  }
#else
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t m = 0; m < M; ++m)
        row_scalar(q, m, KP, wp + p * KP * (kPanel / 2), pp + p * geo.params_stride, geo, bp + p * kPanel,
                   yp + m * N + p * kPanel, std::min(kPanel, N - p * kPanel));
  });
#endif
  return y;
}

}  // namespace tokenmill::gemm::int4
