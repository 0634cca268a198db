// The grouped-weight GEMM: y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] with group-wise integer weights
//   w[n, k] = d[n, g] * q[n, k] + mn[n, g]            (with minimums)
//   w[n, k] = d[n, g] * (q[n, k] - 2 ** (bits - 1))   (without)
// g = k / group, q 4-bit (two a byte) or 8-bit levels, d and mn float16 or float32, groups of 16, 32
// or a multiple of 32 (quant/grouped.py; quant/panels.py pack_grouped packs).
//
// Layout: panels of 16 output channels. 4 bits: [P, KP, 8] bytes; per panel and 32 k, four 64-byte
// lines: line j holds channel c's levels for k 4j..4j+3 in bytes 4c..4c+3, low nibbles, and for k
// 16+4j..16+4j+3 in the high nibbles: the int8 GEMM's k quads, two quads a byte. 8 bits: [P, KP, 16]
// bytes, the int8 k quads (eight lines per 32 k, line j holding k 4j..4j+3) with the levels as they
// are. params: [P, G, 16] scales, or [P, G, 2, 16] scales then minimums, G = KP / group (K padded to
// whole groups with zero weights, and to a multiple of 32).
//
// Activation rows are quantized to int8 in groups of 32 (scale max|x| / 127), as the int8 AVX-512
// kernel does (quantize_q8_row), on every instruction set: then each (weight group, channel) dot
// product of levels and activations within a 32-group is an exact int32, dot, and adds
//   s_x * d * (dot - 2 ** (bits - 1) * sum(x_q))   (no minimums: the offset starts the integer sum)
//   s_x * (d * dot + mn * sum(x_q))               (minimums)
// to the channel's float32 total; a group of 16 is half an activation group (its own dot and sum).
// AVX-512 VNNI: tile_grouped in packed_gemm_avx512.h (vpdpbusd on the levels or the unpacked
// nibbles). AVX2 (here): vpmaddubsw multiplies 4-bit levels (8-bit levels: their two nibbles, apart)
// by the signed int8 activations into int16 pair sums (at most 2 * 15 * 127 = 3810), sixteen products
// of which (a 32-group) add up in int16 without overflow (30480 < 32767); vpmaddwd by ones (16 for
// the high nibbles) then widens each channel's quad to int32. The integer sums are the VNNI kernel's.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tokenmill::gemm::grouped {

constexpr int64_t kPanel = 16;     // output channels per panel
constexpr int64_t kGroup = 32;     // activation values per int8 scale
constexpr int64_t kHalf = 16;      // k of the smallest weight group: half an activation group
constexpr int64_t kRowBlock = 96;  // activation rows kept hot (L2) while all panels stream past

// 64-byte lines per panel per 32 k, and a panel's bytes per 32 k.
constexpr int lines_per_group(int bits) { return bits == 4 ? 4 : 8; }
constexpr int64_t group_bytes(int bits) { return lines_per_group(bits) * 64; }

// How a layer's packed weight and params group its weights.
struct Geometry {
  int bits;               // 4 or 8
  int64_t group;          // k per weight group: 16 or a multiple of kGroup
  int64_t per;            // activation groups per weight group (groups of 16: 1, two weight groups each)
  int64_t param_bytes;    // 2 (float16) or 4 (float32)
  int64_t group_params;   // params per panel and weight group: 16 scales (and 16 minimums)
  int64_t params_stride;  // params per panel
  bool minimums;
  bool halves;  // groups of 16
  int64_t panel_bytes(int64_t KP) const { return KP * bits * 2; }
};

// params of a packed weight of KP k and `width` bytes per k (8: 4 bits, 16: 8 bits).
inline Geometry geometry(const at::Tensor& params, int64_t KP, int64_t width) {
  const int64_t group = KP / params.size(1);
  const bool minimums = params.dim() == 4;
  return {width == kPanel / 2 ? 4 : 8,
          group,
          std::max<int64_t>(1, group / kGroup),
          static_cast<int64_t>(params.element_size()),
          (minimums ? 2 : 1) * kPanel,
          params.numel() / params.size(0),
          minimums,
          group == kHalf};
}

// Calls f(bits, minimums, halves) with the geometry's properties as compile-time constants
// (std::integral_constant), the tiles' template parameters.
template <typename F>
inline void with_kind(const Geometry& geo, F&& f) {
  using std::bool_constant;
  using std::integral_constant;
  const auto by_halves = [&](auto bits, auto minimums) {
    if (geo.halves)
      f(bits, minimums, bool_constant<true>{});
    else
      f(bits, minimums, bool_constant<false>{});
  };
  const auto by_minimums = [&](auto bits) {
    if (geo.minimums)
      by_halves(bits, bool_constant<true>{});
    else
      by_halves(bits, bool_constant<false>{});
  };
  if (geo.bits == 4)
    by_minimums(integral_constant<int, 4>{});
  else
    by_minimums(integral_constant<int, 8>{});
}

// Throws unless packed ([P, KP, 8] or [P, KP, 16] uint8), params and bias ([P * 16] float32) make a
// grouped GEMM of K in-features (padded to KP, whole groups and a multiple of 32) and N out-features.
inline void check(const at::Tensor& packed, const at::Tensor& params, const at::Tensor& bias, int64_t K, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == kPanel / 2 || packed.size(2) == kPanel) && packed.is_contiguous(),
              "grouped packed weights: contiguous [P, K, 8] (4 bits) or [P, K, 16] (8 bits) uint8");
  const int64_t P = packed.size(0), KP = packed.size(1);
  TORCH_CHECK((params.scalar_type() == at::kHalf || params.scalar_type() == at::kFloat) && params.is_contiguous() &&
                  params.size(0) == P &&
                  ((params.dim() == 3 && params.size(2) == kPanel) ||
                   (params.dim() == 4 && params.size(2) == 2 && params.size(3) == kPanel)),
              "grouped params: contiguous [P, G, 16] or [P, G, 2, 16] float16 or float32");
  const int64_t G = params.size(1);
  const int64_t group = G > 0 && KP % G == 0 ? KP / G : 0;
  TORCH_CHECK((group == kHalf || (group > 0 && group % kGroup == 0)) && KP % kGroup == 0 && KP >= K &&
                  KP - K < std::max(group, kGroup),
              "x has ", K, " features, the int", packed.size(2) == kPanel ? 8 : 4, " weight ", KP, " in ", G,
              " groups (expected K padded to whole groups of 16 or a multiple of 32, and to a multiple of 32)");
  TORCH_CHECK(P * kPanel >= N && bias.numel() == P * kPanel && bias.scalar_type() == at::kFloat && bias.is_contiguous(),
              "bias: contiguous [P * 16] float32");
}

// Level (k, channel c) of a panel.
inline int level(const uint8_t* panel, int bits, int64_t k, int64_t c) {
  const int64_t r = k % kGroup;
  if (bits == 8) return panel[k / 4 * 64 + c * 4 + k % 4];
  const uint8_t b = panel[k / kGroup * group_bytes(4) + (r % 16) / 4 * 64 + c * 4 + r % 4];
  return r < 16 ? b & 0x0F : b >> 4;
}

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// Param c of a run of 16 (float16 or float32).
inline float param(const uint8_t* p, int64_t param_bytes, int64_t c) {
  if (param_bytes == 4) {
    float v;
    std::memcpy(&v, p + 4 * c, sizeof v);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * c, sizeof h);
  return half_to_float(h);
}

// The sum of 16 int8 activations (the first half of a group, for weight groups of 16).
inline int32_t sum16(const int8_t* x) {
  int32_t sum = 0;
  for (int k = 0; k < kHalf; ++k) sum += x[k];
  return sum;
}

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
// builds without AVX2). Each activation group takes one dot product per weight group in it.
inline void row_scalar(const Q8Rows& q, int64_t m, int64_t KP, const uint8_t* panel, const uint8_t* params,
                       const Geometry& geo, const float* bias, float* y, int64_t num_cols) {
  const int64_t G = KP / kGroup, span = std::min(geo.group, kGroup);
  const int32_t offset = 1 << (geo.bits - 1);
  const int8_t* xv = q.values.data() + m * KP;
  for (int64_t c = 0; c < num_cols; ++c) {
    float total = 0.0f;
    for (int64_t k0 = 0; k0 < KP; k0 += span) {
      const uint8_t* p = params + k0 / geo.group * geo.group_params * geo.param_bytes;
      int32_t dot = 0, sum = 0;
      for (int64_t k = k0; k < k0 + span; ++k) {
        dot += level(panel, geo.bits, k, c) * xv[k];
        sum += xv[k];
      }
      const float s = q.scales[m * G + k0 / kGroup], d = param(p, geo.param_bytes, c);
      total +=
          geo.minimums ? s * (d * dot + param(p, geo.param_bytes, kPanel + c) * sum) : s * d * (dot - offset * sum);
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

// Channels 8h..8h+7 of a run of 16 float16 or float32 params.
inline __m256 load_params8(const uint8_t* p, int64_t param_bytes, int h) {
  if (param_bytes == 4) return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * h);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
}

// NP panels x MR rows over all activation groups: out[p][i][h] holds row i's channels 8h..8h+7 of
// panel p. x: row 0's int8 values (rows ldx apart), its group scales and sums (rows ldg apart).
// kHalves (groups of 16): each activation group is two runs of 16 k with their own weight group,
// dot products and activation sums; else one run of 32 k.
template <int NP, int MR, int kBits, bool kMinimums, bool kHalves>
inline void tile(const int8_t* x, const float* scales, const int32_t* sums, int64_t ldx, int64_t ldg,
                 const uint8_t* const (&panels)[NP], const uint8_t* const (&params)[NP], const Geometry& geo,
                 __m256 (&out)[NP][MR][2]) {
  constexpr int kRuns = kHalves ? 2 : 1, kPlanes = kBits == 8 ? 2 : 1;  // planes: an 8-bit level's nibbles
  // 4 bits: line j holds k 4j.. (low nibbles, run 0) and 16 + 4j.. (high, run 1); 8 bits: k 4j..
  constexpr int kRunLines = kBits == 8 ? lines_per_group(kBits) / kRuns : 4;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) out[p][i][0] = out[p][i][1] = _mm256_setzero_ps();
  __m256 d[kRuns][NP][2], mn[kRuns][NP][2];
  const uint8_t* pp[NP];  // the next weight group's scales (and minimums)
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p) pp[p] = params[p];
  const int64_t step = geo.group_params * geo.param_bytes;
  int64_t left = 0;  // activation groups left in the current weight group (a counter: no division)
  for (int64_t g = 0; g < ldg; ++g) {
    if (left-- == 0) {  // the next weight groups' scales (and minimums), channels 0-7 and 8-15
      left = geo.per - 1;
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
#pragma GCC unroll 2
        for (int r = 0; r < kRuns; ++r) {
          for (int h = 0; h < 2; ++h) {
            d[r][p][h] = load_params8(pp[p], geo.param_bytes, h);
            if constexpr (kMinimums) mn[r][p][h] = load_params8(pp[p] + kPanel * geo.param_bytes, geo.param_bytes, h);
          }
          pp[p] += step;
        }
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < kRuns; ++r) {
      __m256i acc[kPlanes][NP][MR][2];  // int16 pair sums
#pragma GCC unroll 2
      for (int n = 0; n < kPlanes; ++n)
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i) acc[n][p][i][0] = acc[n][p][i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int l = 0; l < kRunLines; ++l) {
        const int j = kBits == 8 ? r * kRunLines + l : l;
        __m256i xa[MR], xb[MR];  // 4 bits: row i's quads for the low and high nibbles; 8 bits: xa only
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          xa[i] = broadcast_quad(x + i * ldx + g * kGroup + 4 * j);
          if constexpr (kBits == 4) xb[i] = broadcast_quad(x + i * ldx + g * kGroup + 16 + 4 * j);
        }
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(panels[p] + g * group_bytes(kBits) + j * 64 + h * 32));
            const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 4
            for (int i = 0; i < MR; ++i) {
              if constexpr (kBits == 8) {
                acc[0][p][i][h] = _mm256_add_epi16(acc[0][p][i][h], _mm256_maddubs_epi16(lo, xa[i]));
                acc[1][p][i][h] = _mm256_add_epi16(acc[1][p][i][h], _mm256_maddubs_epi16(hi, xa[i]));
              } else {
                if (!kHalves || r == 0)
                  acc[0][p][i][h] = _mm256_add_epi16(acc[0][p][i][h], _mm256_maddubs_epi16(lo, xa[i]));
                if (!kHalves || r == 1)
                  acc[0][p][i][h] = _mm256_add_epi16(acc[0][p][i][h], _mm256_maddubs_epi16(hi, xb[i]));
              }
            }
          }
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const __m256 s = _mm256_set1_ps(scales[i * ldg + g]);
        int32_t sum = sums[i * ldg + g];  // this run's activation sum
        if constexpr (kHalves) {
          const int32_t first = sum16(x + i * ldx + g * kGroup);
          sum = r == 0 ? first : sum - first;
        }
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            __m256i dot = _mm256_madd_epi16(acc[0][p][i][h], ones);  // [8] int32, one per channel
            if constexpr (kBits == 8) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(acc[1][p][i][h], sixteens));
            if constexpr (kMinimums) {
              const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d[r][p][h],
                                               _mm256_mul_ps(mn[r][p][h], _mm256_set1_ps(static_cast<float>(sum))));
              out[p][i][h] = _mm256_fmadd_ps(t, s, out[p][i][h]);
            } else {
              const __m256i centred = _mm256_add_epi32(dot, _mm256_set1_epi32(-(1 << (kBits - 1)) * sum));
              out[p][i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(d[r][p][h], s), out[p][i][h]);
            }
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
inline void run(const Q8Rows& q, int64_t m, int64_t KP, const uint8_t* wp, const uint8_t* pp, const Geometry& geo,
                const int64_t (&panel)[NP], const float* bias, float* y, int64_t N) {
  const int64_t G = KP / kGroup;
  const uint8_t* panels[NP];
  const uint8_t* params[NP];
  for (int p = 0; p < NP; ++p) {
    panels[p] = wp + panel[p] * geo.panel_bytes(KP);
    params[p] = pp + panel[p] * geo.params_stride * geo.param_bytes;
  }
  __m256 out[NP][MR][2];
  const int8_t* x = q.values.data() + m * KP;
  with_kind(geo, [&](auto bits, auto minimums, auto halves) {
    tile<NP, MR, decltype(bits)::value, decltype(minimums)::value, decltype(halves)::value>(
        x, q.scales.data() + m * G, q.sums.data() + m * G, KP, G, panels, params, geo, out);
  });
  for (int p = 0; p < NP; ++p) {
    const int64_t n0 = panel[p] * kPanel;
    for (int i = 0; i < MR; ++i) store(out[p][i], bias + n0, y + (m + i) * N + n0, std::min(kPanel, N - n0));
  }
}
#endif

// x: [M, K] float32 -> [M, N] float32 (builds without AVX-512 VNNI; those take avx512::linear).
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params,
                         const at::Tensor& bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), KP = packed.size(1);
  const Geometry geo = geometry(params, KP, packed.size(2));
  const Q8Rows q = quantize_rows(x.data_ptr<float>(), M, K, KP);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint8_t* pp = static_cast<const uint8_t*>(params.data_ptr());
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
        row_scalar(q, m, KP, wp + p * geo.panel_bytes(KP), pp + p * geo.params_stride * geo.param_bytes, geo,
                   bp + p * kPanel, yp + m * N + p * kPanel, std::min(kPanel, N - p * kPanel));
  });
#endif
  return y;
}

}  // namespace tokenmill::gemm::grouped
