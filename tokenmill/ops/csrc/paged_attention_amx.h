// The bf16-cache attention of paged_attention_avx512.h (attend_head) with its two products on AMX tiles:
// a row's scores (q times the keys of a block) and its weighted values (probabilities times the values
// of a block). The cache's pair layout is the tiles' as it lies:
//   keys: a head's chunk of a block is [D/2][16] pairs, so the 16 pair rows of 32 dims are a B tile
//         [16 rows x 64 bytes] of 16 keys: scores tile [rows, 16 keys] += q [rows, 32 dims] x that;
//   values: [8][D] pairs, so 8 pair rows of 16 dims are a B tile [8 rows x 64 bytes] (row stride 4 D
//         bytes): out tile [rows, 16 dims] += p [rows, 16 keys] x that.
// The queries (times scale, bf16), the softmax and its bf16 probabilities are attend_head's.
//
// A row's products are one fixed sequence of tile multiplies over its blocks whatever the rows beside
// it (blocks past a row's context add its zero probabilities: exact zeros), so with AMX on, decode rows
// and prompt rows alike run here and a token's attention is the same bits alone or in a prompt chunk.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"

#ifdef TM_AMX
namespace tokenmill::attn::amx {

constexpr int64_t kRows = 16;  // query rows per tile
constexpr int64_t kKeys = 16;  // keys per block: a scores tile's columns, a values tile's pair rows x 2

// tmm0-3: C tiles [rows, 16] float32; tmm4: queries [rows, 32 dims]; tmm5: probabilities [rows, 16 keys];
// tmm6: keys [16 pair rows, 16 keys]; tmm7: values [8 pair rows, 16 dims].
inline void configure(int64_t rows) {
  tile::Config cfg;
  for (int t = 0; t < 4; ++t) cfg.tile(t, rows, 64);
  cfg.tile(4, rows, 64).tile(5, rows, 32).tile(6, 16, 64).tile(7, 8, 64).load();
}

// s [rows padded to 16][s_stride] <- the scores of rows [0, rows) against the blocks of each 16-row
// group's context (keys_of(r0): the keys its last row sees). qb: [rows padded to 16][D / 2] bf16 pairs.
// Scores past a row's context are computed (from whatever those slots hold) and never read.
template <int C, typename KeysOf>
inline void scores(const uint32_t* qb, int64_t rows, const at::BFloat16* const* k_blocks, float* s, int64_t s_stride,
                   const KeysOf& keys_of) {
  constexpr int64_t kPairs = 8 * C;  // D / 2
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const uint32_t* q = qb + r0 * kPairs;
    for (int64_t j = 0, blocks = (keys_of(r0) + kKeys - 1) / kKeys; j < blocks; ++j) {
      _tile_zero(0);
#pragma GCC unroll 4
      for (int c = 0; c < C / 2; ++c) {  // 32 dims at a time
        _tile_loadd(4, q + c * 16, kPairs * 4);
        _tile_loadd(6, k_blocks[j] + c * 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, s + r0 * s_stride + j * kKeys, s_stride * 4);
    }
  }
}

// A block's values with the slots from key `keys` on zeroed, into buf ([8][D] pairs): slots past a
// context may never have been written (a reused block may hold anything, NaN included), and a zero
// probability times NaN would be NaN.
template <int C>
inline const at::BFloat16* values_up_to(const at::BFloat16* block, int64_t keys, at::BFloat16* buf) {
  constexpr int64_t D = 16 * C;
  std::memcpy(buf, block, kKeys * D * sizeof(at::BFloat16));
  for (int64_t t = keys; t < kKeys; ++t)  // key t: pair row t / 2, the first or second of each pair
    for (int64_t d = 0; d < D; ++d) buf[(t / 2) * 2 * D + 2 * d + t % 2] = at::BFloat16(0.0f);
  return buf;
}

// o [rows padded to 16][16 C] <- the probabilities p ([rows padded to 16][p_stride] bf16 pairs) times the
// values of each 16-row group's context (keys_of, as scores), unscaled.
template <int C, typename KeysOf>
inline void weighted_values(const uint32_t* p, int64_t p_stride, int64_t rows, const at::BFloat16* const* v_blocks,
                            float* o, const KeysOf& keys_of) {
  constexpr int64_t D = 16 * C;
  alignas(64) at::BFloat16 last[kKeys * D];
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t keys = keys_of(r0), blocks = (keys + kKeys - 1) / kKeys;
    for (int c0 = 0; c0 < C; c0 += 4) {  // 4 output tiles of 16 dims at a time
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t j = 0; j < blocks; ++j) {
        _tile_loadd(5, p + r0 * p_stride + j * kKeys / 2, p_stride * 4);
        const bool partial = j == blocks - 1 && keys % kKeys;
        const at::BFloat16* v =
            (partial ? (c0 == 0 ? values_up_to<C>(v_blocks[j], keys % kKeys, last) : last) : v_blocks[j]) + 32 * c0;
        _tile_loadd(7, v, D * 4);
        _tile_dpbf16ps(0, 5, 7);
        if constexpr (C >= 2) {
          _tile_loadd(7, v + 32, D * 4);
          _tile_dpbf16ps(1, 5, 7);
        }
        if constexpr (C >= 4) {
          _tile_loadd(7, v + 64, D * 4);
          _tile_dpbf16ps(2, 5, 7);
          _tile_loadd(7, v + 96, D * 4);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* out = o + r0 * D + 16 * c0;
      _tile_stored(0, out, D * 4);
      if constexpr (C >= 2) _tile_stored(1, out + 16, D * 4);
      if constexpr (C >= 4) {
        _tile_stored(2, out + 32, D * 4);
        _tile_stored(3, out + 48, D * 4);
      }
    }
  }
}

}  // namespace tokenmill::attn::amx
#endif  // TM_AMX
