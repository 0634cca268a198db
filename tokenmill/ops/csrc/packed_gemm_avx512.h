// The packed GEMM (packed_gemm.h) on CPUs with AVX-512 BF16 and VNNI: dot-product instructions that
// multiply pairs (bf16) or quads (int8) of values and add all products into a 32-bit lane.
// - bf16 weights: activation rows are rounded to bf16 (to nearest even) once per call, and
//   vdpbf16ps multiplies each channel's (w[k], w[k+1]) by the row's (x[k], x[k+1]) into float32
//   sums: 32 multiply-adds per instruction, twice an fp32 FMA's, with no widening of the weights.
//   The weights are packed in k pairs ([P, K2/2, 16, 2], K2 = K rounded up to even): one 64-byte
//   load is the operand.
// - int8 weights: activation rows are quantized to int8 in groups of kGroup = 32 values, one float
//   scale per group (llama.cpp's q8_0: one scale per row costs SmolLM2 ~8% perplexity through its
//   outlier channels, one per 32 values keeps it), and vpdpbusd multiplies each channel's
//   (w[k], ..., w[k+3]) by the row's four values: 64 multiply-adds per instruction, twice bf16's.
//   vpdpbusd takes one operand unsigned, so the weights are stored offset by 128 (u8 = w + 128) in
//   k quads ([P, K4/4, 16, 4], K4 = K rounded up to kGroup) and each group's sum starts at
//   -128 * (the group's sum of quantized activations), which cancels the offset exactly. After each
//   group the int32 sum is scaled by the group's activation scale into float32.
// - grouped weights (packed_int4.h's layout): the int8 path's activation groups; 4-bit levels take
//   per line of 64 bytes two vpdpbusd, one on the low nibbles, one on the high, 8-bit levels one
//   (tile_grouped).
// Every row count runs these tiles (prefill too): they beat widening the weights for a BLAS sgemm.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "avx2_math.h"  // exp512
#include "packed_int4.h"

namespace tokenmill::gemm::avx512 {

constexpr int64_t kPanel = 16;      // output channels per panel (as packed_gemm.h)
constexpr int kRows = 8;            // bf16: activation rows per register tile (x 2 panels: 16 accumulators)
constexpr int kQuantRows = 4;       // int8: 8 int32 group sums + 8 float32 totals (past 6 rows they spill)
constexpr int64_t kGroup = 32;      // int8: activation values per scale (8 quads)
constexpr int64_t kRowBlock = 128;  // activation rows kept hot (L2) while a thread's panels stream past
constexpr int kStreams = 2;         // weight streams per thread with one activation row

// ------------------------------------------------------------------------------- activations
// A buffer the conversion overwrites: no zeroing pass (a prefill's activations are megabytes).
template <typename T>
using Buffer = std::unique_ptr<T[]>;

template <typename T>
Buffer<T> buffer(int64_t n) {
  return Buffer<T>(new T[n]);
}

// Rows rounded to bf16 and interleaved by tiles of kRows rows: [ceil(M / kRows)][K2 / 2][kRows]
// (x[k], x[k+1]) pairs, K2 = K rounded up to even (a zero pads odd K). A tile's kRows broadcasts of
// one k pair then read 32 consecutive bytes through one pointer. Per 8 pairs of a tile, the 8 rows'
// converted pairs are transposed in registers (8 x 8 32-bit values); rows past M are zeros.
static_assert(kRows == 8, "bf16_tile transposes 8 x 8 blocks");
// One tile: rows [0, rows) of x ([rows, K] float32, rows <= kRows) into dst ([K2 / 2][kRows] pairs).
inline void bf16_tile(const float* x, int64_t rows, int64_t K, int64_t K2, uint32_t* dst) {
  for (int64_t k = 0; k < K2; k += 16) {  // 8 pairs; masked loads read zeros past K
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : K <= k ? 0 : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m256i v[kRows];  // v[i]: row i's 8 pairs
    for (int i = 0; i < kRows; ++i) {
      const __m512 f = i < rows ? _mm512_maskz_loadu_ps(mask, x + i * K + k) : _mm512_setzero_ps();
      v[i] = (__m256i)_mm512_cvtneps_pbh(f);
    }
    __m256i t[kRows], u[kRows];
    for (int i = 0; i < kRows; i += 2) {  // t[i]: rows i, i+1 interleaved (pairs 0 1 4 5), t[i+1]: (2 3 6 7)
      t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
      t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int h = 0; h < kRows; h += 4) {  // u[h + j]: 4 rows of pair j | pair j + 4
      u[h + 0] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
      u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
      u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
      u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    const int64_t count = std::min<int64_t>(8, (K2 - k) / 2);  // pairs of this block
    for (int j = 0; j < 4; ++j) {
      if (j < count)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (k / 2 + j) * kRows),
                            _mm256_permute2x128_si256(u[j], u[4 + j], 0x20));
      if (j + 4 < count)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (k / 2 + j + 4) * kRows),
                            _mm256_permute2x128_si256(u[j], u[4 + j], 0x31));
    }
  }
}

inline Buffer<uint32_t> bf16_tiles(const float* x, int64_t M, int64_t K, int64_t K2) {
  const int64_t pairs = K2 / 2, tiles = (M + kRows - 1) / kRows;
  Buffer<uint32_t> out = buffer<uint32_t>(tiles * pairs * kRows);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      bf16_tile(x + tile * kRows * K, std::min<int64_t>(kRows, M - tile * kRows), K, K2,
                out.get() + tile * pairs * kRows);
  });
  return out;
}

inline __m512i broadcast_pair(const void* p) {  // one 32-bit (x[k], x[k+1]) pair (or int8 quad) to all 16 lanes
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return _mm512_set1_epi32(pair);
}

// ------------------------------------------------------------------------------- weight requests
// The weights a tile requests ahead, into L2, while it computes: lines of the panels `ahead` elements
// on (the thread's next panel pair; 0: none). The row tiles of a pair share the work: tile `slice`
// of `slices` requests every slices-th line from line `slice` on, so the requests spread evenly
// over the whole pair's compute (in bursts they overflow the misses a core can track).
struct Fetch {
  int64_t ahead = 0, slice = 0, slices = 1;
};

// One row (memory bound) runs its panels in order, so the line kNearBytes past each line it reads is
// the one it reads next in that stream (past a panel's end: the next panel of the stream): requested
// that far ahead, every line: far enough to run ahead of the hardware prefetcher, near enough (not 4 KB
// or more) that the requests do not crowd out the lines the core is reading now.
constexpr int64_t kNearBytes = 1024;
template <typename W>
constexpr Fetch near_fetch() {
  return Fetch{kNearBytes / static_cast<int64_t>(sizeof(W)), 0, 1};
}

// ------------------------------------------------------------------------------- bf16 weights
// NP panels x MR rows over all K2 / 2 pairs: out[p][i] holds row i's 16 channels of panel p.
// x: the rows' tile of bf16_tiles.
// One partial sum per output, in k order, for every tile shape. A row's result is then the same bits
// whether it runs alone (decode), in a tile of 8 (prefill, a batch) or as one of a request's verified
// positions (speculative decoding), so greedy output never depends on the batch: rows split into 4
// sums to hide the dot products' latency rounded differently from 8-row tiles, and the next layer's
// bf16 rounding of the activations grew that into different tokens. Measured: no slower at batch 1
// (memory bound), where the split sums were meant to help.
template <int NP, int MR>
inline void tile_bf16(const uint32_t* x, const uint16_t* const (&panels)[NP], int64_t K2, Fetch fetch,
                      __m512 (&out)[NP][MR]) {
  __m512 acc[NP][MR];
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[p][i] = _mm512_setzero_ps();
  const int64_t pairs = K2 / 2;                      // one 64-byte weight line per panel each
  int64_t next = fetch.ahead ? fetch.slice : pairs;  // the next line to request
  for (int64_t t = 0; t < pairs; ++t) {
    if (t == next) {
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(panels[p] + fetch.ahead + 2 * t * kPanel), _MM_HINT_T1);
      next += fetch.slices;
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(panels[p] + 2 * t * kPanel);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[t * kRows + i]));
        acc[p][i] = _mm512_dpbf16_ps(acc[p][i], xv, wv);
      }
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) out[p][i] = acc[p][i];
}

// ------------------------------------------------------------------------------- int8 weights
// Activation rows as int8 groups: values [M, K4] (zero padded), per group a scale [M, G] and the
// offset correction -128 * sum(values) [M, G], G = K4 / kGroup.
struct Q8Rows {
  Buffer<int8_t> values;
  Buffer<float> scales;
  Buffer<int32_t> offsets;
};

// Row x[0, K) as int8 groups: values[0, K4) (zero padded), per group a scale and the offset
// correction, scales[0, G) and offsets[0, G).
inline void quantize_q8_row(const float* x, int64_t K, int64_t K4, int8_t* values, float* scales, int32_t* offsets) {
  const auto mask = [&](int64_t k0) -> __mmask16 {
    return K - k0 >= 16 ? 0xFFFF : K <= k0 ? 0 : static_cast<__mmask16>((1u << (K - k0)) - 1);
  };
  for (int64_t g = 0; g < K4 / kGroup; ++g) {
    const int64_t k = g * kGroup;
    const __m512 a = _mm512_maskz_loadu_ps(mask(k), x + k);
    const __m512 b = _mm512_maskz_loadu_ps(mask(k + 16), x + k + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    if (!(amax > 0.0f)) {  // an all-zero group
      std::memset(values + k, 0, kGroup);
      scales[g] = 0.0f;
      offsets[g] = 0;
      continue;
    }
    const __m512 inv = _mm512_set1_ps(127.0f / amax);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // to nearest even
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(values + k), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(values + k + 16), _mm512_cvtsepi32_epi8(qb));
    scales[g] = amax / 127.0f;
    offsets[g] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  }
}

inline Q8Rows quantize_q8(const float* x, int64_t M, int64_t K, int64_t K4) {
  const int64_t G = K4 / kGroup;
  Q8Rows q{buffer<int8_t>(M * K4), buffer<float>(M * G), buffer<int32_t>(M * G)};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_q8_row(x + m * K, K, K4, q.values.get() + m * K4, q.scales.get() + m * G, q.offsets.get() + m * G);
  });
  return q;
}

// NP panels x MR rows over all groups. Per group: int32 sums start at the rows' offset corrections,
// take the group's 8 quads of dot products (unrolled: the sums stay in registers), and are scaled into
// the float32 totals by the rows' group scales. The weight requests follow the lines (k quads) across
// groups: a group's line j is requested when it is this tile's turn (`fetch`).
template <int NP, int MR>
inline void tile_q8(const int8_t* x, int64_t ldx, const float* scales, const int32_t* offsets, int64_t ldg,
                    const int8_t* const (&panels)[NP], int64_t groups, Fetch fetch, __m512 (&out)[NP][MR]) {
  constexpr int kQuads = kGroup / 4;  // lines per panel per group
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) out[p][i] = _mm512_setzero_ps();
  int64_t next = fetch.ahead ? fetch.slice : groups * kQuads;  // the next line to request
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) w[p] = panels[p] + g * kGroup * kPanel;
    const int8_t* xg = x + g * kGroup;
    // This group's lines to request, as bits j of a mask (the lines are numbered across groups).
    unsigned requests = 0;
    for (; next < (g + 1) * kQuads; next += fetch.slices) requests |= 1u << (next - g * kQuads);
    __m512i acc[NP][MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i start = _mm512_set1_epi32(offsets[i * ldg + g]);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[p][i] = start;
    }
#pragma GCC unroll 8
    for (int j = 0; j < kQuads; ++j) {
      if (requests & (1u << j)) {
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p)
          _mm_prefetch(reinterpret_cast<const char*>(w[p] + fetch.ahead + j * 4 * kPanel), _MM_HINT_T1);
      }
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        const __m512i wv = _mm512_loadu_si512(w[p] + j * 4 * kPanel);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i)
          acc[p][i] = _mm512_dpbusd_epi32(acc[p][i], wv, broadcast_pair(xg + i * ldx + 4 * j));
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 s = _mm512_set1_ps(scales[i * ldg + g]);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) out[p][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[p][i]), s, out[p][i]);
    }
  }
}

// ------------------------------------------------------------------------------- grouped weights
// 16 float16 or float32 params.
inline __m512 load_params16(const uint8_t* p, int64_t param_bytes) {
  if (param_bytes == 4) return _mm512_loadu_ps(p);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// NP panels x MR rows over all activation groups, as tile_q8 (the same rows: offsets are -128 *
// the group's sum of values). params[p]: panel p's scales (and minimums) of each weight group (`per`
// activation groups). kHalves (groups of 16): each activation group is two runs of 16 k with their
// own weight group, dot products and activation sums; else one run of 32 k.
template <int NP, int MR, int kBits, bool kMinimums, bool kHalves>
inline void tile_grouped(const int8_t* x, int64_t ldx, const float* scales, const int32_t* offsets, int64_t ldg,
                         const uint8_t* const (&panels)[NP], const uint8_t* const (&params)[NP],
                         const grouped::Geometry& geo, int64_t groups, Fetch fetch, __m512 (&out)[NP][MR]) {
  constexpr int kLines = grouped::lines_per_group(kBits), kRuns = kHalves ? 2 : 1;
  // 4 bits: line j holds k 4j.. (low nibbles, run 0) and 16 + 4j.. (high nibbles, run 1); 8 bits: k 4j..
  constexpr int kRunLines = kBits == 8 ? kLines / kRuns : kLines;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) out[p][i] = _mm512_setzero_ps();
  __m512 d[kRuns][NP], mn[kRuns][NP];
  int64_t next = fetch.ahead ? fetch.slice : groups * kLines;  // the next line to request
  const uint8_t* pp[NP];                                       // the next weight group's scales (and minimums)
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p) pp[p] = params[p];
  const int64_t step = geo.group_params * geo.param_bytes;
  int64_t left = 0;  // activation groups left in the current weight group (a counter: no division)
  for (int64_t g = 0; g < groups; ++g) {
    if (left-- == 0) {
      left = geo.per - 1;
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
#pragma GCC unroll 2
        for (int r = 0; r < kRuns; ++r) {
          d[r][p] = load_params16(pp[p], geo.param_bytes);
          if constexpr (kMinimums) mn[r][p] = load_params16(pp[p] + kPanel * geo.param_bytes, geo.param_bytes);
          pp[p] += step;
        }
      }
    }
    const uint8_t* w[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) w[p] = panels[p] + g * grouped::group_bytes(kBits);
    const int8_t* xg = x + g * kGroup;
    unsigned requests = 0;  // this group's lines to request (tile_q8)
    for (; next < (g + 1) * kLines; next += fetch.slices) requests |= 1u << (next - g * kLines);
#pragma GCC unroll 2
    for (int r = 0; r < kRuns; ++r) {
      int32_t sums[MR];  // this run's activation sums
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        sums[i] = offsets[i * ldg + g] / -128;
        if constexpr (kHalves) {
          const int32_t first = grouped::sum16(xg + i * ldx);
          sums[i] = r == 0 ? first : sums[i] - first;
        }
      }
      __m512i acc[NP][MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR;
           ++i) {  // without minimums the sum starts at -2 ** (bits - 1) * sum(x): the levels' offset
        const __m512i start = kMinimums ? _mm512_setzero_si512() : _mm512_set1_epi32(-(1 << (kBits - 1)) * sums[i]);
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) acc[p][i] = start;
      }
#pragma GCC unroll 8
      for (int l = 0; l < kRunLines; ++l) {
        const int j = kBits == 8 ? r * kRunLines + l : l;
        if ((kBits == 8 || r == 0) && (requests & (1u << j))) {  // a 4-bit line's first read requests it
#pragma GCC unroll 4
          for (int p = 0; p < NP; ++p)
            _mm_prefetch(reinterpret_cast<const char*>(w[p] + fetch.ahead + j * 64), _MM_HINT_T1);
        }
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) {
          const __m512i v = _mm512_loadu_si512(w[p] + j * 64);
          if constexpr (kBits == 8) {
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i)
              acc[p][i] = _mm512_dpbusd_epi32(acc[p][i], v, broadcast_pair(xg + i * ldx + 4 * j));
          } else {
            const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
              if (!kHalves || r == 0)
                acc[p][i] = _mm512_dpbusd_epi32(acc[p][i], lo, broadcast_pair(xg + i * ldx + 4 * j));
              if (!kHalves || r == 1)
                acc[p][i] = _mm512_dpbusd_epi32(acc[p][i], hi, broadcast_pair(xg + i * ldx + 16 + 4 * j));
            }
          }
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 s = _mm512_set1_ps(scales[i * ldg + g]);
        if constexpr (kMinimums) {
          const __m512 sum = _mm512_set1_ps(static_cast<float>(sums[i]));
#pragma GCC unroll 4
          for (int p = 0; p < NP; ++p)
            out[p][i] = _mm512_fmadd_ps(
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[p][i]), d[r][p], _mm512_mul_ps(mn[r][p], sum)), s, out[p][i]);
        } else {
#pragma GCC unroll 4
          for (int p = 0; p < NP; ++p)
            out[p][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[p][i]), _mm512_mul_ps(d[r][p], s), out[p][i]);
        }
      }
    }
  }
}

// acc * scale + bias, or acc + bias where the weights carry no per-channel scale (grouped: null).
inline __m512 scaled(__m512 acc, const float* scale, const float* bias) {
  return scale ? _mm512_fmadd_ps(acc, _mm512_loadu_ps(scale), _mm512_loadu_ps(bias))
               : _mm512_add_ps(acc, _mm512_loadu_ps(bias));
}

// y[0:num_cols] = acc * scale + bias (scale and bias are padded to whole panels).
inline void store_row(__m512 acc, const float* scale, const float* bias, float* y, int64_t num_cols) {
  const __m512 r = scaled(acc, scale, bias);
  const __mmask16 mask = num_cols >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << num_cols) - 1);
  _mm512_mask_storeu_ps(y, mask, r);
}

// y[0:16] = silu(gate) * up = gate / (1 + exp(-gate)) * up, as ops::silu_and_mul computes it.
inline void store_silu_mul(__m512 gate, __m512 up, float* y) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
  _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_mul_ps(gate, sig), up));
}

// ------------------------------------------------------------------------------- the GEMM
// What a call needs besides the tiles: the prepared activation rows and the output.
// W: uint16_t (bf16), int8_t (int8) or uint8_t (grouped: 4-bit levels two a byte, or 8-bit).
template <typename W>
struct Problem {
  const W* weights;              // packed panels
  int64_t panel_stride;          // elements per panel (KP times 16; 4-bit grouped: KP times 8 bytes)
  int64_t KP;                    // x's features padded as the panels' k (bf16: even; int8, grouped: whole groups)
  const void* x;                 // bf16 row tiles (uint32_t pairs, see bf16_tiles) or int8 rows, [M, KP]
  const float* group_scales;     // int8, grouped: [M, KP / kGroup]
  const int32_t* group_offsets;  // int8, grouped: [M, KP / kGroup]
  const float* scale;            // per channel; null for grouped weights (their scales are per group: params)
  const float* bias;
  float* y;  // [M, ldy]
  int64_t N;
  int64_t ldy;  // N, or N / 2 with silu_mul
  // silu_mul: the weights are [gate | up] halves of P / 2 panels each; panel q pairs with panel
  // q + P / 2 and y[:, 16 q : 16 q + 16] = silu(gate) * up, the MLP's activation in the GEMM's
  // epilogue (no [M, N] intermediate written and read back). 0: a plain GEMM.
  int64_t up_panels;
  // grouped: scales (and minimums) per panel and weight group (packed_int4.h), their layout.
  const uint8_t* params = nullptr;
  grouped::Geometry geometry{};
};

// The Problem of a packed layer: wp ([P, KP, 16] bf16 or int8, [P, KP, width] grouped levels), its
// scale (grouped: its params) and bias; the caller fills in the rows (x, group_scales, group_offsets).
template <typename W>
inline Problem<W> layer_problem(const W* wp, int64_t P, int64_t KP, const at::Tensor& scale, const at::Tensor& bias,
                                float* y, int64_t N, bool silu_mul, int64_t width = kPanel) {
  constexpr bool kGrouped = std::is_same_v<W, uint8_t>;
  Problem<W> pr{wp,
                KP * (kGrouped ? width : kPanel),
                KP,
                nullptr,
                nullptr,
                nullptr,
                kGrouped ? nullptr : scale.data_ptr<float>(),
                bias.data_ptr<float>(),
                y,
                N,
                silu_mul ? N / 2 : N,
                silu_mul ? P / 2 : 0};
  if constexpr (kGrouped) {
    pr.params = static_cast<const uint8_t*>(scale.data_ptr());
    pr.geometry = grouped::geometry(scale, KP, width);
  }
  return pr;
}

template <typename W>
constexpr int tile_rows() {
  return std::is_same_v<W, uint16_t> ? kRows : kQuantRows;
}

// The row tiles of a panel pair also pull the thread's next pair toward the cache (`fetch`), so its
// weights arrive from memory while this pair computes.
template <int NP, int MR, typename W>
inline void run_tile(const Problem<W>& pr, int64_t m, const int64_t (&panel)[NP], Fetch fetch = {}) {
  __m512 out[NP][MR];
  const W* panels[NP];
  for (int p = 0; p < NP; ++p) panels[p] = pr.weights + panel[p] * pr.panel_stride;
  if constexpr (std::is_same_v<W, uint16_t>) {
    tile_bf16<NP, MR>(static_cast<const uint32_t*>(pr.x) + m * pr.KP / 2, panels, pr.KP, fetch, out);
  } else if constexpr (std::is_same_v<W, uint8_t>) {
    const int64_t G = pr.KP / kGroup;
    const grouped::Geometry& geo = pr.geometry;
    const uint8_t* params[NP];
    for (int p = 0; p < NP; ++p) params[p] = pr.params + panel[p] * geo.params_stride * geo.param_bytes;
    const int8_t* x = static_cast<const int8_t*>(pr.x) + m * pr.KP;
    grouped::with_kind(geo, [&](auto bits, auto minimums, auto halves) {
      tile_grouped<NP, MR, decltype(bits)::value, decltype(minimums)::value, decltype(halves)::value>(
          x, pr.KP, pr.group_scales + m * G, pr.group_offsets + m * G, G, panels, params, geo, G, fetch, out);
    });
  } else {
    const int64_t G = pr.KP / kGroup;
    tile_q8<NP, MR>(static_cast<const int8_t*>(pr.x) + m * pr.KP, pr.KP, pr.group_scales + m * G,
                    pr.group_offsets + m * G, G, panels, G, fetch, out);
  }
  if constexpr (NP == 2) {
    if (pr.up_panels) {  // panel[1] == panel[0] + up_panels: the same channels' gate and up
      const int64_t g0 = panel[0] * kPanel, u0 = panel[1] * kPanel;
      for (int i = 0; i < MR; ++i)
        store_silu_mul(scaled(out[0][i], pr.scale ? pr.scale + g0 : nullptr, pr.bias + g0),
                       scaled(out[1][i], pr.scale ? pr.scale + u0 : nullptr, pr.bias + u0),
                       pr.y + (m + i) * pr.ldy + g0);
      return;
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t n0 = panel[p] * kPanel, cols = std::min(kPanel, pr.N - n0);
    for (int i = 0; i < MR; ++i)
      store_row(out[p][i], pr.scale ? pr.scale + n0 : nullptr, pr.bias + n0, pr.y + (m + i) * pr.ldy + n0, cols);
  }
}

// run_tile for mr <= MR rows (the row count sizes the register arrays).
template <int NP, int MR = 0, typename W>
inline void run_rows(const Problem<W>& pr, int64_t m, int64_t mr, const int64_t (&panel)[NP], Fetch fetch) {
  constexpr int kMax = MR ? MR : tile_rows<W>();
  if constexpr (kMax > 1)
    if (mr < kMax) return run_rows<NP, kMax - 1>(pr, m, mr, panel, fetch);
  run_tile<NP, kMax>(pr, m, panel, fetch);
}

// One row against panels [begin, end). A tile takes one panel from each of kStreams equal parts of
// the range: that many sequential streams keep more cache-line fetches in flight than one (see
// two_streams in packed_gemm.h).
template <typename W>
inline void run_streams(const Problem<W>& pr, int64_t begin, int64_t end) {
  const int64_t part = (end - begin + kStreams - 1) / kStreams;
  for (int64_t j = 0; j < part; ++j) {
    int64_t panel[kStreams];
    int count = 0;
    for (int s = 0; s < kStreams; ++s)
      if (begin + s * part + j < end) panel[count++] = begin + s * part + j;
    if (count == kStreams) {
      run_tile<kStreams, 1>(pr, 0, panel, near_fetch<W>());
    } else {
      for (int s = 0; s < count; ++s) {
        const int64_t one[1] = {panel[s]};
        run_tile<1, 1>(pr, 0, one, near_fetch<W>());
      }
    }
  }
}

// The panels of pair q: 2q and 2q + 1, or with silu_mul q and q + P / 2 (gate and up of the same
// channels). The second is past P for a lone panel at the very end.
template <typename W>
inline std::pair<int64_t, int64_t> pair_panels(const Problem<W>& pr, int64_t q) {
  return pr.up_panels ? std::pair{q, q + pr.up_panels} : std::pair{2 * q, 2 * q + 1};
}

// Rows [0, M) of panel pair q (pair_panels). Its row tiles request pair `next` ahead (-1: none).
template <typename W>
inline void run_pair(const Problem<W>& pr, int64_t M, int64_t P, int64_t q, int64_t next) {
  const auto [p, p2] = pair_panels(pr, q);
  const int64_t tiles = (M + tile_rows<W>() - 1) / tile_rows<W>();
  int64_t ahead = 0;  // the next pair's weights, as an offset from this pair's
  if (next >= 0 && pair_panels(pr, next).second < P) ahead = (pair_panels(pr, next).first - p) * pr.panel_stride;
  for (int64_t m = 0; m < M; m += tile_rows<W>()) {
    const int64_t mr = std::min<int64_t>(tile_rows<W>(), M - m);
    if (p2 < P) {
      const int64_t panel[2] = {p, p2};
      run_rows<2>(pr, m, mr, panel, Fetch{ahead, m / tile_rows<W>(), tiles});
    } else {
      const int64_t panel[1] = {p};
      run_rows<1>(pr, m, mr, panel, Fetch{});
    }
  }
}

// The problem restricted to rows [m0, m0 + kRowBlock), m0 a multiple of kRowBlock (whole tiles).
template <typename W>
inline Problem<W> rows_from(const Problem<W>& pr, int64_t m0) {
  Problem<W> block = pr;
  if constexpr (std::is_same_v<W, uint16_t>) {
    block.x = static_cast<const uint32_t*>(pr.x) + m0 * pr.KP / 2;
  } else {
    const int64_t G = pr.KP / kGroup;
    block.x = static_cast<const int8_t*>(pr.x) + m0 * pr.KP;
    block.group_scales = pr.group_scales + m0 * G;
    block.group_offsets = pr.group_offsets + m0 * G;
  }
  block.y = pr.y + m0 * pr.ldy;
  return block;
}

// Thread t of `threads`: its equal static share of the panel pairs over all M rows, each pair's tiles
// requesting the next pair (run_pair). One row: tiles of one row in kStreams streams (run_streams),
// or with silu_mul the gate and up panels as the two. For the M == 1 GEMM and for threads of one
// region that run the ops of a step in turn (decode_stack.cpp), where no thread falls behind by more
// than a barrier's wait.
template <typename W>
inline void run_share(const Problem<W>& pr, int64_t M, int64_t P, int64_t t, int64_t threads) {
  const int64_t pairs = (P + 1) / 2, first = t * pairs / threads, last = (t + 1) * pairs / threads;
  if (M == 1 && pr.up_panels) {
    for (int64_t q = first; q < last; ++q) {
      const int64_t panel[2] = {q, q + pr.up_panels};
      run_tile<2, 1>(pr, 0, panel, near_fetch<W>());
    }
  } else if (M == 1) {
    run_streams(pr, 2 * first, std::min(P, 2 * last));
  } else {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock)
      for (int64_t q = first; q < last; ++q)
        run_pair(rows_from(pr, m0), std::min(kRowBlock, M - m0), P, q, q + 1 < last ? q + 1 : -1);
  }
}

// ------------------------------------------------------------------------------- work sharing
// A thread's share of a GEMM, units [front, back) packed in one atomic word: the owner takes units
// from the front, a thread that ran out of its own work takes them from the back. Shares start
// equal, but the two cores of a busy VM do not run at equal speed; without stealing, the faster one
// waits at the end of every GEMM.
class alignas(64) Share {
 public:
  void reset(int64_t units) { bounds_.store(pack(0, units), std::memory_order_relaxed); }
  int64_t take_front() { return take(true); }
  int64_t take_back() { return take(false); }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(back) << 32 | static_cast<uint64_t>(front);
  }
  int64_t take(bool front_end) {  // the unit taken, or -1 when none is left
    uint64_t bounds = bounds_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(bounds & 0xFFFFFFFFu), back = static_cast<int64_t>(bounds >> 32);
      if (front >= back) return -1;
      const uint64_t next = front_end ? pack(front + 1, back) : pack(front, back - 1);
      if (bounds_.compare_exchange_weak(bounds, next, std::memory_order_relaxed)) return front_end ? front : back - 1;
    }
  }
  std::atomic<uint64_t> bounds_{0};
};

// x: [M, K] float32 -> [M, N] float32; wp: P panels, [P, KP, 16]: bf16 k pairs (KP = K rounded up to
// even) or int8 k quads offset by 128 (KP = K rounded up to kGroup); or [P, KP, width] grouped levels
// (packed_int4.h, `scale` its params). With silu_mul (N == 16 P, P even,
// checked by packed_linear): -> [M, N / 2], silu of the first half of the outputs times the second
// (see Problem).
template <typename W>
at::Tensor linear(const at::Tensor& x, const W* wp, int64_t P, int64_t KP, const at::Tensor& scale,
                  const at::Tensor& bias, int64_t N, bool silu_mul = false, int64_t width = kPanel) {
  const int64_t M = x.size(0), K = x.size(1), ldy = silu_mul ? N / 2 : N;
  at::Tensor y = at::empty({M, ldy}, x.options());
  Buffer<uint32_t> xb;
  Q8Rows xq;
  const float* xp = x.data_ptr<float>();
  Problem<W> pr = layer_problem(wp, P, KP, scale, bias, y.data_ptr<float>(), N, silu_mul, width);
  if constexpr (std::is_same_v<W, uint16_t>) {
    xb = bf16_tiles(xp, M, K, KP);
    pr.x = xb.get();
  } else {
    xq = quantize_q8(xp, M, K, KP);
    pr.x = xq.values.get();
    pr.group_scales = xq.scales.get();
    pr.group_offsets = xq.offsets.get();
  }
  const int64_t pairs = (P + 1) / 2;
  if (M == 1) {  // memory bound: equal static shares (run_share)
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) run_share(pr, 1, P, t, threads);
    });
    return y;
  }
  // Units are (block of kRowBlock rows, panel pair). Thread t owns the pairs [t * pairs / T, (t + 1) *
  // pairs / T) and takes them past every row block in turn (its panels stay hot across blocks); its
  // next own unit's weights are requested while one computes.
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  std::vector<Share> shares(threads);
  const auto first_pair = [&](int64_t t) { return t * pairs / threads; };
  for (int64_t t = 0; t < threads; ++t) shares[t].reset(blocks * (first_pair(t + 1) - first_pair(t)));
  const auto run_unit = [&](int64_t t, int64_t unit, bool own) {
    const int64_t first = first_pair(t), count = first_pair(t + 1) - first, m0 = unit / count * kRowBlock;
    const int64_t q = first + unit % count, next = own && unit % count + 1 < count ? q + 1 : -1;
    run_pair(rows_from(pr, m0), std::min(kRowBlock, M - m0), P, q, next);
  };
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t unit; (unit = shares[t].take_front()) >= 0;) run_unit(t, unit, true);
      for (int64_t v = 1; v < threads; ++v) {  // then help the others, from the back of their shares
        const int64_t victim = (t + v) % threads;
        for (int64_t unit; (unit = shares[victim].take_back()) >= 0;) run_unit(victim, unit, false);
      }
    }
  });
  return y;
}

}  // namespace tokenmill::gemm::avx512
