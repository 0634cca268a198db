// The bf16 packed GEMM (packed_gemm.h) on AMX tiles (Intel Sapphire Rapids and later: AMX-BF16).
//
// A tile multiply (tdpbf16ps) takes A, 16 activation rows x 32 bf16 k (64 bytes a row), and B, 16
// rows of 16 channels' (w[k], w[k+1]) pairs (64 bytes a row), and adds their 16 x 16 products of 32 k
// into a float32 C tile: 8,192 multiply-adds per instruction, 16x an AVX-512 vdpbf16ps. The bf16
// panels of the AVX-512 build ([P, KP/2, 16, 2], k pairs per channel) are B tiles as they lie: 16
// consecutive pair rows (32 k) of a panel, 64 bytes apart. So AMX reads the weights packed for the
// AVX-512 kernels, with KP padded to whole tiles of 32 k (quant/panels.py), and nothing is repacked.
//
// Activations are rounded to bf16 (to nearest even, as bf16_tiles does) into plain rows [M, KP].
// Each C tile holds 16 rows x 16 channels; a unit of work is up to 2 A tiles (32 rows) against 2
// panels (4 C tiles, 2 A and 2 B tile registers).
//
// Batch invariance: a C row depends only on its own A row and the weights, through the same
// sequence of tile multiplies over k whatever M is, so a row's bits are the same alone (decode), in
// a batch or as a verified draft position. That is why, with AMX, bf16 layers run on tiles at every
// row count: AMX sums a tile's products in an order of its own (not vdpbf16ps's), so splitting by
// row count would make a row's bits depend on how many rows share its step.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

namespace tokenmill::gemm::amx {

constexpr int64_t kTileRows = 16;   // rows of an A and a C tile
constexpr int64_t kTileK = 32;      // bf16 k per tile multiply (64 bytes of A row, 16 pair rows of B)
constexpr int64_t kUnitRows = 32;   // rows per unit: 2 A tiles
constexpr int64_t kRowBlock = 256;  // activation rows kept hot (L2) while a thread's panel pairs pass them

// tmm0-3: C tiles [rows, 16] float32; tmm4, tmm5: A tiles [rows, 32] bf16; tmm6, tmm7: B tiles [16, 32].
inline void configure(int64_t rows) {
  tile::Config cfg;
  for (int t = 0; t < 8; ++t) cfg.tile(t, t < 6 ? rows : kTileRows, 64);
  cfg.load();
}

// Rows of x [M, K] float32 rounded to bf16 (nearest even) into a [M, KP] (KP >= K, zeros past K).
inline void bf16_row(const float* x, int64_t K, int64_t KP, uint16_t* a) {
  for (int64_t k = 0; k < KP; k += 16) {
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : K <= k ? 0 : static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 f = _mm512_maskz_loadu_ps(mask, x + k);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + k), (__m256i)_mm512_cvtneps_pbh(f));
  }
}

// The rows an op reads: M rows padded to whole tiles (the pad rows' contents are never stored).
inline avx512::Buffer<uint16_t> bf16_rows(const float* x, int64_t M, int64_t K, int64_t KP) {
  avx512::Buffer<uint16_t> a = avx512::buffer<uint16_t>((M + kTileRows - 1) / kTileRows * kTileRows * KP);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) bf16_row(x + m * K, K, KP, a.get() + m * KP);
  });
  return a;
}

// NA A tiles (rows [0, 16 NA) of a, lda elements apart) x NB panels over KP -> c [16 NA][16 NB]
// float32 (ldc floats apart).
template <int NA, int NB>
inline void tiles(const uint16_t* a, int64_t lda, const uint16_t* const (&b)[NB], int64_t KP, float* c, int64_t ldc) {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (NA == 2) _tile_zero(2);
  if constexpr (NA == 2 && NB == 2) _tile_zero(3);
  for (int64_t k = 0; k < KP; k += kTileK) {
    _tile_loadd(6, b[0] + k * kPanel, 64);  // 16 pair rows of 16 channels
    if constexpr (NB == 2) _tile_loadd(7, b[1] + k * kPanel, 64);
    _tile_loadd(4, a + k, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NA == 2) {
      _tile_loadd(5, a + kTileRows * lda + k, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, ldc * 4);
  if constexpr (NB == 2) _tile_stored(1, c + kPanel, ldc * 4);
  if constexpr (NA == 2) _tile_stored(2, c + kTileRows * ldc, ldc * 4);
  if constexpr (NA == 2 && NB == 2) _tile_stored(3, c + kTileRows * ldc + kPanel, ldc * 4);
}

// LoRA adapters' updates in the epilogue (models/layers/lora.py): before a C tile is stored, each row
// that runs an adapter gains t[row] B^T on the tile's columns, t = x A^T computed beforehand, so the
// update never reads and writes the output again, and [gate | up] keeps its activation here.
struct LoRAEpilogue {
  const int32_t* slot;  // [M]: the adapter slot of each row, -1: the base model
  const int32_t* rank;  // [M]
  const float* t;       // [M, ldt]: x A^T of the row's adapter, piece p's rank columns at p * rank
  int64_t ldt;
  const float* bt;           // [slots, R, N]: B^T of each slot, piece p's rows at [p * rank, (p + 1) * rank)
  int64_t R;                 // rows of a slot
  const int64_t* piece_end;  // piece p holds the output columns [piece_end[p - 1], piece_end[p]): whole panels
  int64_t pieces;

  // c (rows of a C tile, ldc floats apart) += the updates of rows [m, m + rows) on `panel`'s columns.
  void add(float* c, int64_t ldc, int64_t m, int64_t rows, int64_t panel, int64_t N) const {
    const int64_t n0 = panel * kPanel, cols = std::min(kPanel, N - n0);
    const __mmask16 k = cols == kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
    int64_t p = 0;
    while (p + 1 < pieces && n0 >= piece_end[p]) ++p;
    for (int64_t i = 0; i < rows; ++i) {
      const int32_t s = slot[m + i];
      if (s < 0) continue;
      const int64_t r = rank[m + i];
      const float* ti = t + (m + i) * ldt + p * r;
      const float* b = bt + (s * R + p * r) * N + n0;
      // Four sums over the rank, so the FMAs overlap instead of waiting on one another.
      __m512 acc[4] = {_mm512_load_ps(c + i * ldc), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      int64_t j = 0;
      for (; j + 4 <= r; j += 4)
        for (int u = 0; u < 4; ++u)
          acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(ti[j + u]), _mm512_maskz_loadu_ps(k, b + (j + u) * N), acc[u]);
      for (; j < r; ++j) acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(ti[j]), _mm512_maskz_loadu_ps(k, b + j * N), acc[0]);
      _mm512_store_ps(c + i * ldc, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    }
  }
};

// What a call needs: the weights (bf16 k-pair panels), the rows, the output and its epilogue.
struct Problem {
  const uint16_t* weights;  // [P, KP / 2, 16, 2]
  int64_t P, KP;
  const uint16_t* a;  // [ceil(M / 16) * 16, KP] bf16 rows
  const float* bias;  // [P * 16]
  float* y;           // [M, ldy]
  int64_t N, ldy;     // ldy: N, or N / 2 with silu_mul
  int64_t up_panels;  // silu_mul: panel q pairs with q + up_panels (avx512::Problem::up_panels); 0: plain
  const LoRAEpilogue* lora = nullptr;  // LoRA updates before the epilogue's store (none: nullptr)
};

// The panels of pair q: 2q and 2q + 1, or with silu_mul q and q + P / 2 (gate and up of the same channels).
inline std::pair<int64_t, int64_t> pair_panels(const Problem& pr, int64_t q) {
  return pr.up_panels ? std::pair{q, q + pr.up_panels} : std::pair{2 * q, 2 * q + 1};
}

// Rows [m, m + rows) (rows <= kUnitRows) of panel pair q: the tiles, then bias (and silu_mul) into y.
inline void run_unit(const Problem& pr, int64_t m, int64_t rows, int64_t q) {
  alignas(64) float c[kUnitRows * 2 * kPanel];  // [32 rows][2 panels x 16]
  constexpr int64_t ldc = 2 * kPanel;
  const auto [p0, p1] = pair_panels(pr, q);
  const uint16_t* a = pr.a + m * pr.KP;
  const int64_t stride = pr.KP * kPanel;
  if (p1 < pr.P) {
    const uint16_t* const b[2] = {pr.weights + p0 * stride, pr.weights + p1 * stride};
    if (rows > kTileRows)
      tiles<2, 2>(a, pr.KP, b, pr.KP, c, ldc);
    else
      tiles<1, 2>(a, pr.KP, b, pr.KP, c, ldc);
  } else {  // a lone last panel
    const uint16_t* const b[1] = {pr.weights + p0 * stride};
    if (rows > kTileRows)
      tiles<2, 1>(a, pr.KP, b, pr.KP, c, ldc);
    else
      tiles<1, 1>(a, pr.KP, b, pr.KP, c, ldc);
  }
  if (pr.lora != nullptr) {
    pr.lora->add(c, ldc, m, rows, p0, pr.N);
    if (p1 < pr.P) pr.lora->add(c + kPanel, ldc, m, rows, p1, pr.N);
  }
  if (pr.up_panels) {
    const int64_t g0 = p0 * kPanel, u0 = p1 * kPanel;
    for (int64_t i = 0; i < rows; ++i)
      avx512::store_silu_mul(avx512::scaled(_mm512_load_ps(c + i * ldc), nullptr, pr.bias + g0),
                             avx512::scaled(_mm512_load_ps(c + i * ldc + kPanel), nullptr, pr.bias + u0),
                             pr.y + (m + i) * pr.ldy + g0);
    return;
  }
  for (const int64_t p : {p0, p1}) {
    if (p >= pr.P) break;
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, pr.N - n0), off = p == p0 ? 0 : kPanel;
    for (int64_t i = 0; i < rows; ++i)
      avx512::store_row(_mm512_load_ps(c + i * ldc + off), nullptr, pr.bias + n0, pr.y + (m + i) * pr.ldy + n0, cols);
  }
}

// Thread t of `threads`: its equal static share of the panel pairs, past every row block in turn.
// For threads of one region that run a step's ops in turn (decode_stack.cpp).
inline void run_share(const Problem& pr, int64_t M, int64_t t, int64_t threads) {
  const int64_t pairs = (pr.P + 1) / 2, first = t * pairs / threads, last = (t + 1) * pairs / threads;
  if (first == last) return;
  configure(std::min(M, kTileRows));
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock)
    for (int64_t q = first; q < last; ++q)
      for (int64_t m = m0; m < std::min(M, m0 + kRowBlock); m += kUnitRows)
        run_unit(pr, m, std::min(kUnitRows, M - m), q);
}

// Units (a block of kRowBlock rows, a panel pair) over the threads, shared out as avx512::linear's are
// (an owner's front, the others' back): configure() on each thread, then run(m0, q) for each unit.
template <typename Configure, typename Run>
inline void share_units(int64_t M, int64_t P, const Configure& configure, const Run& run) {
  const int64_t pairs = (P + 1) / 2, blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  std::vector<avx512::Share> shares(threads);
  const auto first_pair = [&](int64_t t) { return t * pairs / threads; };
  for (int64_t t = 0; t < threads; ++t) shares[t].reset(blocks * (first_pair(t + 1) - first_pair(t)));
  const auto unit_of = [&](int64_t t, int64_t unit) {
    const int64_t first = first_pair(t), count = first_pair(t + 1) - first;
    run(unit / count * kRowBlock, first + unit % count);
  };
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    configure();
    for (int64_t t = b; t < e; ++t) {
      for (int64_t unit; (unit = shares[t].take_front()) >= 0;) unit_of(t, unit);
      for (int64_t v = 1; v < threads; ++v) {
        const int64_t victim = (t + v) % threads;
        for (int64_t unit; (unit = shares[victim].take_back()) >= 0;) unit_of(victim, unit);
      }
    }
  });
}

// x [M, K] float32 @ bf16 k-pair panels wp ([P, KP, 16], KP a multiple of kTileK) -> [M, N] float32
// (+ bias), or with silu_mul -> [M, N / 2] (see Problem).
inline at::Tensor linear(const at::Tensor& x, const uint16_t* wp, int64_t P, int64_t KP, const at::Tensor& bias,
                         int64_t N, bool silu_mul, const LoRAEpilogue* lora = nullptr) {
  const int64_t M = x.size(0), K = x.size(1), ldy = silu_mul ? N / 2 : N;
  at::Tensor y = at::empty({M, ldy}, x.options());
  const avx512::Buffer<uint16_t> a = bf16_rows(x.data_ptr<float>(), M, K, KP);
  const Problem pr{wp, P, KP, a.get(), bias.data_ptr<float>(), y.data_ptr<float>(), N, ldy, silu_mul ? P / 2 : 0, lora};
  share_units(
      M, P, [&] { configure(std::min(M, kTileRows)); },
      [&](int64_t m0, int64_t q) {
        for (int64_t m = m0; m < std::min(M, m0 + kRowBlock); m += kUnitRows)
          run_unit(pr, m, std::min(kUnitRows, M - m), q);
      });
  return y;
}

}  // namespace tokenmill::gemm::amx
