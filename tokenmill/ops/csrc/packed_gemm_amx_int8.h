// The int8 packed GEMM (packed_gemm_avx512.h's tile_q8) on AMX-INT8 tiles, bit for bit.
//
// The weights are the VNNI kernel's k quads offset by 128 ([P, K4/4, 16, 4] u8): 8 quad rows of a panel
// (32 k, 64 bytes apart) are an AMX B tile as they lie. The activations are that kernel's int8 groups
// of 32 (one scale each, and the offset correction -128 * their sum). tdpbsud multiplies signed A
// (activations) by unsigned B (weights): one 32-k group is a tile multiply [rows, 32] x [8, 64] into an
// int32 C tile [rows, 16 channels], the exact integer sum vpdpbusd reaches for that group. So after
// each group the C tiles are stored and, as tile_q8 does, offset, converted and scaled by the rows'
// group scales into float32 totals, in group order: the same bits as the VNNI kernel, so which one
// runs may depend on the row count (kRows) without a row's result depending on its batch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"

namespace tokenmill::gemm::amx::q8 {

// From this many rows a GEMM takes the tiles (below it the VNNI tiles are as fast: a tile multiply of
// a few rows costs as much as one of 16).
constexpr int64_t kRows = 8;

// tmm0-3: C tiles [rows, 16] int32; tmm4, tmm5: A tiles [rows, 32] int8; tmm6, tmm7: B tiles [8, 64].
inline void configure(int64_t rows) {
  tile::Config cfg;
  for (int t = 0; t < 4; ++t) cfg.tile(t, rows, 64);
  cfg.tile(4, rows, 32).tile(5, rows, 32).tile(6, 8, 64).tile(7, 8, 64).load();
}

// One group: NA A tiles (rows [0, 16 NA) of a, lda bytes apart) x NB panels' B tiles -> c [16 NA][32] int32.
template <int NA, int NB>
inline void group_tiles(const int8_t* a, int64_t lda, const int8_t* const (&b)[NB], int32_t* c) {
  constexpr int64_t ldc = 32 * 4;  // bytes
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (NA == 2) _tile_zero(2);
  if constexpr (NA == 2 && NB == 2) _tile_zero(3);
  _tile_loadd(6, b[0], 64);
  if constexpr (NB == 2) _tile_loadd(7, b[1], 64);
  _tile_loadd(4, a, lda);
  _tile_dpbsud(0, 4, 6);
  if constexpr (NB == 2) _tile_dpbsud(1, 4, 7);
  if constexpr (NA == 2) {
    _tile_loadd(5, a + kTileRows * lda, lda);
    _tile_dpbsud(2, 5, 6);
    if constexpr (NB == 2) _tile_dpbsud(3, 5, 7);
  }
  _tile_stored(0, c, ldc);
  if constexpr (NB == 2) _tile_stored(1, c + 16, ldc);
  if constexpr (NA == 2) _tile_stored(2, c + 16 * 32, ldc);
  if constexpr (NA == 2 && NB == 2) _tile_stored(3, c + 16 * 32 + 16, ldc);
}

// Rows [m, m + rows) (rows <= kUnitRows; x holds whole tiles of rows from m) of panel pair q, as
// avx512::run_tile writes them (bias, per-channel scale, silu_mul).
inline void run_unit(const avx512::Problem<int8_t>& pr, int64_t P, int64_t m, int64_t rows, int64_t q) {
  const int64_t p0 = pr.up_panels ? q : 2 * q, p1 = pr.up_panels ? q + pr.up_panels : 2 * q + 1;
  const int64_t G = pr.KP / avx512::kGroup, np = p1 < P ? 2 : 1;
  const int8_t* x = static_cast<const int8_t*>(pr.x) + m * pr.KP;
  alignas(64) int32_t c[kUnitRows * 32];
  __m512 out[kUnitRows][2];
  for (int64_t i = 0; i < rows; ++i) out[i][0] = out[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* a = x + g * avx512::kGroup;
    const int8_t* const w0 = pr.weights + p0 * pr.panel_stride + g * avx512::kGroup * kPanel;
    if (np == 2) {
      const int8_t* const b[2] = {w0, pr.weights + p1 * pr.panel_stride + g * avx512::kGroup * kPanel};
      rows > kTileRows ? group_tiles<2, 2>(a, pr.KP, b, c) : group_tiles<1, 2>(a, pr.KP, b, c);
    } else {
      const int8_t* const b[1] = {w0};
      rows > kTileRows ? group_tiles<2, 1>(a, pr.KP, b, c) : group_tiles<1, 1>(a, pr.KP, b, c);
    }
    for (int64_t i = 0; i < rows; ++i) {  // tile_q8's group step: (offset + dot) as float, times the scale
      const __m512i offset = _mm512_set1_epi32(pr.group_offsets[(m + i) * G + g]);
      const __m512 s = _mm512_set1_ps(pr.group_scales[(m + i) * G + g]);
      for (int64_t p = 0; p < np; ++p) {
        const __m512i dot = _mm512_add_epi32(offset, _mm512_load_si512(c + i * 32 + 16 * p));
        out[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, out[i][p]);
      }
    }
  }
  if (pr.up_panels) {
    const int64_t g0 = p0 * kPanel, u0 = p1 * kPanel;
    for (int64_t i = 0; i < rows; ++i)
      avx512::store_silu_mul(avx512::scaled(out[i][0], pr.scale + g0, pr.bias + g0),
                             avx512::scaled(out[i][1], pr.scale + u0, pr.bias + u0), pr.y + (m + i) * pr.ldy + g0);
    return;
  }
  for (int64_t p = 0; p < np; ++p) {
    const int64_t n0 = (p == 0 ? p0 : p1) * kPanel, cols = std::min(kPanel, pr.N - n0);
    for (int64_t i = 0; i < rows; ++i)
      avx512::store_row(out[i][p], pr.scale + n0, pr.bias + n0, pr.y + (m + i) * pr.ldy + n0, cols);
  }
}

// Thread t of `threads`: its equal static share of the panel pairs (as amx::run_share), for the decode stack.
inline void run_share(const avx512::Problem<int8_t>& pr, int64_t M, int64_t P, int64_t t, int64_t threads) {
  const int64_t pairs = (P + 1) / 2, first = t * pairs / threads, last = (t + 1) * pairs / threads;
  if (first == last) return;
  configure(std::min(M, kTileRows));
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock)
    for (int64_t q = first; q < last; ++q)
      for (int64_t m = m0; m < std::min(M, m0 + kRowBlock); m += kUnitRows)
        run_unit(pr, P, m, std::min(kUnitRows, M - m), q);
}

// avx512::linear for int8 weights (wp: [P, KP, 16] k quads, KP a multiple of kGroup), on the tiles.
inline at::Tensor linear(const at::Tensor& x, const int8_t* wp, int64_t P, int64_t KP, const at::Tensor& scale,
                         const at::Tensor& bias, int64_t N, bool silu_mul) {
  const int64_t M = x.size(0), K = x.size(1), G = KP / avx512::kGroup, padded = (M + 15) / 16 * 16;
  at::Tensor y = at::empty({M, silu_mul ? N / 2 : N}, x.options());
  avx512::Q8Rows xq{avx512::buffer<int8_t>(padded * KP), avx512::buffer<float>(M * G), avx512::buffer<int32_t>(M * G)};
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      avx512::quantize_q8_row(xp + m * K, K, KP, xq.values.get() + m * KP, xq.scales.get() + m * G,
                              xq.offsets.get() + m * G);
  });
  avx512::Problem<int8_t> pr = avx512::layer_problem(wp, P, KP, scale, bias, y.data_ptr<float>(), N, silu_mul);
  pr.x = xq.values.get();
  pr.group_scales = xq.scales.get();
  pr.group_offsets = xq.offsets.get();
  share_units(
      M, P, [&] { configure(std::min(M, kTileRows)); },
      [&](int64_t m0, int64_t q) {
        for (int64_t m = m0; m < std::min(M, m0 + kRowBlock); m += kUnitRows)
          run_unit(pr, P, m, std::min(kUnitRows, M - m), q);
      });
  return y;
}

}  // namespace tokenmill::gemm::amx::q8
