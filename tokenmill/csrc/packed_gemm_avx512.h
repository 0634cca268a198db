// The packed GEMM (packed_gemm.h) on CPUs with AVX-512 BF16 and VNNI: dot-product instructions that
// multiply pairs of 16-bit values and add both products into a 32-bit lane.
// - bf16 weights: activation rows are rounded to bf16 (to nearest even) once per call, and
//   vdpbf16ps multiplies each channel's (w[k], w[k+1]) by the row's (x[k], x[k+1]) into float32
//   sums: 32 multiply-adds per instruction, twice an fp32 FMA's, with no widening of the weights.
//   The weights are packed in k pairs ([P, K2/2, 16, 2], K2 = K rounded up to even, as int8): one
//   64-byte load is the operand.
// - int8 weights: the activation rows' int16 values (see packed_gemm.h) times the sign-extended
//   weights with vpdpwssd, the integer form of the same pair product (k-pair panels as stored).
// Every row count runs these tiles (prefill too): they beat widening the weights for a BLAS sgemm.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tokenmill::gemm::avx512 {

constexpr int64_t kPanel = 16;     // output channels per panel (as packed_gemm.h)
constexpr int kRows = 8;           // activation rows per register tile (x 2 panels: 16 accumulators)
constexpr int64_t kRowBlock = 128;  // activation rows kept hot (L2) while a thread's panels stream past
constexpr int kStreams = 2;        // weight streams per thread with one activation row
constexpr int64_t kFlushPairs = 128;  // int32 sums gain <= 2 * 127 * 32767 per k pair: flush well before 2^31

// Independent partial sums per tile so enough dot products are in flight (latency ~6 cycles).
constexpr int unroll_for(int accumulators) { return accumulators >= 8 ? 1 : accumulators >= 4 ? 2 : 4; }

// ------------------------------------------------------------------------------- activations
// Rows rounded to bf16, [M, K2] with K2 = K rounded up to even (a zero pads odd K).
inline std::vector<uint16_t> bf16_rows(const float* x, int64_t M, int64_t K, int64_t K2) {
  std::vector<uint16_t> out(M * K2, 0);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    uint16_t* dst = out.data() + m * K2;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, row + k));
      _mm256_mask_storeu_epi16(dst + k, mask, reinterpret_cast<const __m256i&>(v));
    }
  }
  return out;
}

inline __m512i broadcast_pair(const void* p) {  // one 32-bit (x[k], x[k+1]) pair to all 16 lanes
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return _mm512_set1_epi32(pair);
}

// ------------------------------------------------------------------------------- bf16 weights
// NP panels x MR rows over all K2 / 2 pairs: out[p][i] holds row i's 16 channels of panel p.
// `ahead` (elements, 0 for none): each weight line read is also requested that far ahead, into L2.
template <int NP, int MR>
inline void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* const (&panels)[NP], int64_t K2,
                      int64_t ahead, __m512 (&out)[NP][MR]) {
  constexpr int U = unroll_for(NP * MR);
  __m512 acc[U][NP][MR];
  #pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
    #pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
      #pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[u][p][i] = _mm512_setzero_ps();
  const int64_t pairs = K2 / 2;
  const auto step = [&](int u, int64_t t) __attribute__((always_inline)) {
    #pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(panels[p] + 2 * t * kPanel + ahead), _MM_HINT_T1);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(panels[p] + 2 * t * kPanel);
      #pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512bh xv = (__m512bh)broadcast_pair(x + i * ldx + 2 * t);
        acc[u][p][i] = _mm512_dpbf16_ps(acc[u][p][i], xv, wv);
      }
    }
  };
  int64_t t = 0;
  for (; t + U <= pairs; t += U) {
    #pragma GCC unroll 4
    for (int u = 0; u < U; ++u) step(u, t + u);
  }
  for (; t < pairs; ++t) step(0, t);
  #pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
    #pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      out[p][i] = acc[0][p][i];
      #pragma GCC unroll 4
      for (int u = 1; u < U; ++u) out[p][i] = _mm512_add_ps(out[p][i], acc[u][p][i]);
    }
}

// ------------------------------------------------------------------------------- int8 weights
// The same tile over int8 k-pair panels ([P, K2/2, 16, 2]) and int16 rows; int32 sums are moved to
// float32 every kFlushPairs pairs, before they could overflow.
template <int NP, int MR>
inline void tile_int8(const int16_t* x, int64_t ldx, const int8_t* const (&panels)[NP], int64_t K2,
                      int64_t ahead, __m512 (&out)[NP][MR]) {
  constexpr int U = unroll_for(NP * MR);
  #pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
    #pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) out[p][i] = _mm512_setzero_ps();
  const int64_t pairs = K2 / 2;
  for (int64_t t0 = 0; t0 < pairs; t0 += kFlushPairs) {
    const int64_t t1 = std::min(pairs, t0 + kFlushPairs);
    __m512i acc[U][NP][MR];
    #pragma GCC unroll 4
    for (int u = 0; u < U; ++u)
      #pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
        #pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[u][p][i] = _mm512_setzero_si512();
    const auto step = [&](int u, int64_t t) __attribute__((always_inline)) {
      #pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        const int8_t* wp = panels[p] + t * 2 * kPanel;
        if (ahead && t % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(wp + ahead), _MM_HINT_T1);
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)));
        #pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[u][p][i] = _mm512_dpwssd_epi32(acc[u][p][i], broadcast_pair(x + i * ldx + 2 * t), w);
      }
    };
    int64_t t = t0;
    for (; t + U <= t1; t += U) {
      #pragma GCC unroll 4
      for (int u = 0; u < U; ++u) step(u, t + u);
    }
    for (; t < t1; ++t) step(0, t);
    #pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
      #pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 4
        for (int u = 0; u < U; ++u) out[p][i] = _mm512_add_ps(out[p][i], _mm512_cvtepi32_ps(acc[u][p][i]));
  }
}

// y[0:num_cols] = acc * row_scale * scale + bias (scale and bias are padded to whole panels).
inline void store_row(__m512 acc, float row_scale, const float* scale, const float* bias, float* y,
                      int64_t num_cols) {
  const __m512 r = _mm512_fmadd_ps(_mm512_mul_ps(acc, _mm512_set1_ps(row_scale)), _mm512_loadu_ps(scale),
                                   _mm512_loadu_ps(bias));
  const __mmask16 mask = num_cols >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << num_cols) - 1);
  _mm512_mask_storeu_ps(y, mask, r);
}

// ------------------------------------------------------------------------------- the GEMM
// What a call needs besides the tiles: the prepared activation rows and the output.
template <typename W>
struct Problem {
  const W* weights;       // packed panels
  int64_t panel_stride;   // elements per panel (K2 times 16)
  int64_t K2;             // x's features rounded up to even (the panels' k pairs)
  const void* x;          // bf16 rows (uint16_t) or int16 rows, [M, K2]
  const float* row_scales;  // int8: one per row; bf16: nullptr (1)
  const float* scale;
  const float* bias;
  float* y;               // [M, N]
  int64_t N;
};

// The first row tile of a panel pair also pulls the thread's next pair toward the cache
// (`ahead`), so its weights arrive from memory while this pair computes.
template <int NP, int MR, typename W>
inline void run_tile(const Problem<W>& pr, int64_t m, const int64_t (&panel)[NP], int64_t ahead = 0) {
  __m512 out[NP][MR];
  const W* panels[NP];
  for (int p = 0; p < NP; ++p) panels[p] = pr.weights + panel[p] * pr.panel_stride;
  if constexpr (std::is_same_v<W, uint16_t>)
    tile_bf16<NP, MR>(static_cast<const uint16_t*>(pr.x) + m * pr.K2, pr.K2, panels, pr.K2, ahead, out);
  else
    tile_int8<NP, MR>(static_cast<const int16_t*>(pr.x) + m * pr.K2, pr.K2, panels, pr.K2, ahead, out);
  for (int p = 0; p < NP; ++p) {
    const int64_t n0 = panel[p] * kPanel, cols = std::min(kPanel, pr.N - n0);
    for (int i = 0; i < MR; ++i) {
      const float rs = pr.row_scales ? pr.row_scales[m + i] : 1.0f;
      store_row(out[p][i], rs, pr.scale + n0, pr.bias + n0, pr.y + (m + i) * pr.N + n0, cols);
    }
  }
}

template <int NP, typename W>
inline void run_rows(const Problem<W>& pr, int64_t m, int64_t mr, const int64_t (&panel)[NP], int64_t ahead) {
  switch (mr) {
    case 8: return run_tile<NP, 8>(pr, m, panel, ahead);
    case 7: return run_tile<NP, 7>(pr, m, panel, ahead);
    case 6: return run_tile<NP, 6>(pr, m, panel, ahead);
    case 5: return run_tile<NP, 5>(pr, m, panel, ahead);
    case 4: return run_tile<NP, 4>(pr, m, panel, ahead);
    case 3: return run_tile<NP, 3>(pr, m, panel, ahead);
    case 2: return run_tile<NP, 2>(pr, m, panel, ahead);
    default: return run_tile<NP, 1>(pr, m, panel, ahead);
  }
}

// Rows [0, M) against panels [begin, end), two panels per tile. With one row a tile takes one panel
// from each of kStreams equal parts of the thread's range: that many sequential streams keep more
// cache-line fetches in flight than one (see two_streams in packed_gemm.h).
template <typename W>
inline void run_panels(const Problem<W>& pr, int64_t M, int64_t begin, int64_t end) {
  if (M == 1) {
    const int64_t part = (end - begin + kStreams - 1) / kStreams;
    for (int64_t j = 0; j < part; ++j) {
      int64_t panel[kStreams];
      int count = 0;
      for (int s = 0; s < kStreams; ++s)
        if (begin + s * part + j < end) panel[count++] = begin + s * part + j;
      if (count == kStreams) {
        run_tile<kStreams, 1>(pr, 0, panel);
      } else {
        for (int s = 0; s < count; ++s) {
          const int64_t one[1] = {panel[s]};
          run_tile<1, 1>(pr, 0, one);
        }
      }
    }
    return;
  }
  for (int64_t p = begin; p < end; p += 2) {
    for (int64_t m = 0; m < M; m += kRows) {
      const int64_t mr = std::min<int64_t>(kRows, M - m);
      const int64_t ahead = m == 0 && p + 3 < end ? 2 * pr.panel_stride : 0;
      if (p + 1 < end) {
        const int64_t panel[2] = {p, p + 1};
        run_rows<2>(pr, m, mr, panel, ahead);
      } else {
        const int64_t panel[1] = {p};
        run_rows<1>(pr, m, mr, panel, 0);
      }
    }
  }
}

// x: [M, K] float32 -> [M, N] float32; wp: P panels of k pairs, [P, K2, 16] bf16 or int8.
template <typename W>
at::Tensor linear(const at::Tensor& x, const W* wp, int64_t P, int64_t KP, const at::Tensor& scale,
                  const at::Tensor& bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), K2 = K + K % 2;
  at::Tensor y = at::empty({M, N}, x.options());
  std::vector<uint16_t> xb;
  std::vector<int16_t> xi;
  std::vector<float> row_scales;
  const float* xp = x.data_ptr<float>();
  Problem<W> pr{wp, KP * kPanel, K2, nullptr, nullptr,
                scale.data_ptr<float>(), bias.data_ptr<float>(), y.data_ptr<float>(), N};
  if constexpr (std::is_same_v<W, uint16_t>) {
    xb = bf16_rows(xp, M, K, K2);
    pr.x = xb.data();
  } else {
    Int16Rows q = quantize_rows(xp, M, K, K2);
    xi = std::move(q.values);
    row_scales = std::move(q.scales);
    pr.x = xi.data();
    pr.row_scales = row_scales.data();
  }
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    Problem<W> block = pr;
    const int64_t rows = std::min(kRowBlock, M - m0);
    if constexpr (std::is_same_v<W, uint16_t>)
      block.x = xb.data() + m0 * K2;
    else
      block.x = xi.data() + m0 * K2, block.row_scales = row_scales.data() + m0;
    block.y = pr.y + m0 * N;
    // Whole panel pairs per thread (a lone panel only at the very end).
    at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t b, int64_t e) {
      run_panels(block, rows, 2 * b, std::min(P, 2 * e));
    });
  }
  return y;
}

}  // namespace tokenmill::gemm::avx512
