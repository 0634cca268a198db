// Mixture-of-experts layers on packed expert weights, in one call and one parallel region:
//
//   out[t] = sum over the k experts e chosen for token t of weight[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
//
// The T * k (token, expert) rows are grouped by expert (each expert's rows start at a multiple of
// kAlign, whole bf16 row tiles), then the threads of one region run, with a barrier between steps:
//   1. each row's activations gathered and prepared for the gate/up weights (bf16 tiles or int8 groups);
//   2. the gate/up GEMM of every expert over its rows, units of (expert, row block, panel pair), with
//      silu(gate) * up in the epilogue where the kernels have one;
//   3. those rows prepared for the down weights;
//   4. the down GEMM of every expert, units as in 2;
//   5. per token, the weighted sum of its k rows, in the order of its choices.
// The units are packed_gemm's: the AVX-512 tiles (bf16 k pairs, int8 k quads, grouped 4/8-bit levels:
// avx512::run_pair; on AMX, int8 units of 8 rows or more (the same bits) and every bf16 unit), the float32 /
// bf16-interleaved panels of AVX2 builds (panel_rows, also built into AVX-512 builds for float32
// experts) and AVX2's int8 (int8_rows) and grouped (grouped::run) tiles. Builds without AVX2 run each
// expert through packed_linear in turn, still in this one call.
// Stacked weights: [E, P, KP, width] as packed_gemm.h packs one layer, scale [E, P * 16] float32 (per
// channel; ones for bf16 and float32) or the grouped params [E, P, G, (2,) 16].
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "packed_gemm.h"
#include "team.h"

namespace tokenmill::moe {

constexpr int64_t kPanel = 16;
constexpr int64_t kTileRows = 16;  // rows of an AMX A tile
constexpr int64_t kAlign = 8;      // rows per bf16 activation tile (avx512::kRows)

// The (token, choice) rows grouped by expert.
struct Rows {
  std::vector<int64_t> start;   // [E + 1] each expert's first row, a multiple of kAlign
  std::vector<int64_t> count;   // [E] its rows
  std::vector<int64_t> source;  // [R] the token of each row (-1: padding)
  std::vector<int64_t> row_of;  // [T * k] the row of (token t, choice j) at t * k + j
  int64_t total() const { return start.back(); }
};

inline Rows group_rows(const int64_t* ids, int64_t T, int64_t k, int64_t E) {
  Rows r;
  r.count.assign(E, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "expert id ", ids[i], " out of range: this layer has ", E, " experts");
    ++r.count[ids[i]];
  }
  r.start.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) r.start[e + 1] = r.start[e] + (r.count[e] + kAlign - 1) / kAlign * kAlign;
  r.source.assign(r.total(), -1);
  r.row_of.resize(T * k);
  std::vector<int64_t> next(r.start.begin(), r.start.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t row = next[ids[i]]++;
    r.source[row] = i / k;
    r.row_of[i] = row;
  }
  return r;
}

// A unit of GEMM work: rows [m0, m0 + rows) of expert e against panel pair q.
struct Unit {
  int64_t e, m0, rows, q;
};

inline std::vector<Unit> gemm_units(const Rows& r, int64_t row_block, int64_t pairs) {
  std::vector<Unit> units;
  for (int64_t e = 0; e < static_cast<int64_t>(r.count.size()); ++e)
    for (int64_t m0 = 0; m0 < r.count[e]; m0 += row_block)
      for (int64_t q = 0; q < pairs; ++q) units.push_back({e, m0, std::min(row_block, r.count[e] - m0), q});
  return units;
}

// Thread t's equal static share [first, last) of n items.
inline std::pair<int64_t, int64_t> share_of(int64_t n, int64_t t, int64_t threads) {
  return {t * n / threads, (t + 1) * n / threads};
}

// The rows of tile `tile` (kAlign rows) that hold a token; the padding rows follow them.
inline int64_t valid_rows(const Rows& r, int64_t tile) {
  int64_t valid = 0;
  for (int64_t i = tile * kAlign; i < (tile + 1) * kAlign; ++i) valid += r.source[i] >= 0;
  return valid;
}

// 5. out[t] = sum_j weight[t, j] * d[row_of[t, j]] for tokens [first, last); d: [R, H].
inline void weighted_sum(const Rows& r, const float* d, const float* weights, int64_t k, int64_t H, float* out,
                         int64_t first, int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    float* o = out + t * H;
    const float* row = d + r.row_of[t * k] * H;
    const float w0 = weights[t * k];
    for (int64_t h = 0; h < H; ++h) o[h] = w0 * row[h];
    for (int64_t j = 1; j < k; ++j) {
      const float* rj = d + r.row_of[t * k + j] * H;
      const float wj = weights[t * k + j];
      for (int64_t h = 0; h < H; ++h) o[h] += wj * rj[h];
    }
  }
}

// The gathered input rows, x[source[i]] (zeros for padding), tiles [first, last).
inline void gather(const Rows& r, const float* x, int64_t H, float* xg, int64_t first, int64_t last) {
  for (int64_t i = first * kAlign; i < last * kAlign; ++i) {
    if (r.source[i] >= 0)
      std::memcpy(xg + i * H, x + r.source[i] * H, H * sizeof(float));
    else
      std::memset(xg + i * H, 0, H * sizeof(float));
  }
}

#ifdef TM_AVX512
namespace vnni {
namespace av = gemm::avx512;

// One projection of every expert on the AVX-512 tiles: W uint16_t (bf16 k pairs), int8_t (k quads) or
// uint8_t (grouped levels).
template <typename W>
class Stack {
 public:
  // packed [E, P, KP, width], scale [E, ...] (see the top of the file); y: [R, ldy] output rows.
  // amx: int8 units of at least amx::q8::kRows rows on AMX tiles (the VNNI tiles' bits), and bf16 at every
  // row count (AMX sums in an order of its own: a row's bits then do not depend on its expert's rows).
  Stack(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zeros, const Rows& r, float* y, int64_t N,
        bool silu_mul, bool amx)
      : r_(r), P_(packed.size(1)), KP_(packed.size(2)), amx_(amx) {
    const int64_t E = packed.size(0), R = r.total();
    if constexpr (std::is_same_v<W, uint16_t>) {
      if (amx_)  // plain bf16 rows, read by whole A tiles of 16 rows (see q_)
        rows_ = av::buffer<uint16_t>((R + 2 * kTileRows) * KP_);
      else
        tiles_ = av::buffer<uint32_t>(R * KP_ / 2);
    } else {
      const int64_t G = KP_ / av::kGroup;
      // AMX A tiles read whole tiles of 16 rows: the last expert's may reach kTileRows past its rows
      q_ = av::Q8Rows{av::buffer<int8_t>((R + 2 * kTileRows) * KP_), av::buffer<float>(R * G),
                      av::buffer<int32_t>(R * G)};
    }
    const int64_t ldy = silu_mul ? N / 2 : N;
    const W* base = reinterpret_cast<const W*>(packed.data_ptr());
    const int64_t per_expert = packed.numel() / E;  // elements (bytes for uint8)
    for (int64_t e = 0; e < E; ++e) {
      av::Problem<W> pr = av::layer_problem(base + e * per_expert, P_, KP_, scale.select(0, e), zeros,
                                            y + r.start[e] * ldy, N, silu_mul, packed.size(3));
      const int64_t m = r.start[e];
      if constexpr (std::is_same_v<W, uint16_t>) {
#ifdef TM_AMX
        if (amx_)
          bf16_problems_.push_back(gemm::amx::Problem{base + e * per_expert, P_, KP_, rows_.get() + m * KP_,
                                                      zeros.data_ptr<float>(), y + m * ldy, N, ldy,
                                                      silu_mul ? P_ / 2 : 0});
#endif
        pr.x = amx_ ? nullptr : tiles_.get() + m * KP_ / 2;
      } else {
        const int64_t G = KP_ / av::kGroup;
        pr.x = q_.values.get() + m * KP_;
        pr.group_scales = q_.scales.get() + m * G;
        pr.group_offsets = q_.offsets.get() + m * G;
      }
      problems_.push_back(pr);
    }
    units_ = gemm_units(r, av::kRowBlock, silu_mul ? P_ / 2 : (P_ + 1) / 2);
  }

  // Steps 1 and 3: tile `tile` of src ([R, K] float32) into this projection's activations.
  void prepare(const float* src, int64_t K, int64_t tile) {
    const int64_t valid = valid_rows(r_, tile), m = tile * kAlign;
    if (!valid) return;
    if constexpr (std::is_same_v<W, uint16_t>) {
#ifdef TM_AMX
      if (amx_) {
        for (int64_t i = m; i < m + valid; ++i) gemm::amx::bf16_row(src + i * K, K, KP_, rows_.get() + i * KP_);
        return;
      }
#endif
      av::bf16_tile(src + m * K, valid, K, KP_, tiles_.get() + m * KP_ / 2);
    } else {
      const int64_t G = KP_ / av::kGroup;
      for (int64_t i = m; i < m + valid; ++i)
        av::quantize_q8_row(src + i * K, K, KP_, q_.values.get() + i * KP_, q_.scales.get() + i * G,
                            q_.offsets.get() + i * G);
    }
  }

  // Steps 2 and 4: units, each thread its share first (requesting its next unit's panels ahead), then
  // the others' from their back ends. reset(shares, threads) first, with every thread of the region idle.
  void reset(std::vector<av::Share>& shares, int64_t threads) const {
    for (int64_t t = 0; t < threads; ++t) {
      const auto [first, last] = share_of(static_cast<int64_t>(units_.size()), t, threads);
      shares[t].reset(last - first);
    }
  }

  void run(std::vector<av::Share>& shares, int64_t t, int64_t threads) const {
    const int64_t n = static_cast<int64_t>(units_.size());
    const auto run_unit = [&](int64_t owner, int64_t u, bool own) {
      const auto [first, last] = share_of(n, owner, threads);
      const Unit& unit = units_[first + u];
      const bool ahead =
          own && first + u + 1 < last && units_[first + u + 1].e == unit.e && units_[first + u + 1].m0 == unit.m0;
#ifdef TM_AMX
      if constexpr (std::is_same_v<W, int8_t>) {
        if (amx_ && unit.rows >= gemm::amx::q8::kRows) {
          gemm::amx::q8::configure(std::min(unit.rows, kTileRows));
          for (int64_t m = unit.m0; m < unit.m0 + unit.rows; m += gemm::amx::kUnitRows)
            gemm::amx::q8::run_unit(problems_[unit.e], P_, m, std::min(gemm::amx::kUnitRows, unit.m0 + unit.rows - m),
                                    unit.q);
          return;
        }
      } else if constexpr (std::is_same_v<W, uint16_t>) {
        if (amx_) {
          gemm::amx::configure(std::min(unit.rows, kTileRows));
          for (int64_t m = unit.m0; m < unit.m0 + unit.rows; m += gemm::amx::kUnitRows)
            gemm::amx::run_unit(bf16_problems_[unit.e], m, std::min(gemm::amx::kUnitRows, unit.m0 + unit.rows - m),
                                unit.q);
          return;
        }
      }
#endif
      av::run_pair(av::rows_from(problems_[unit.e], unit.m0), unit.rows, P_, unit.q, ahead ? unit.q + 1 : -1);
    };
    for (int64_t u; (u = shares[t].take_front()) >= 0;) run_unit(t, u, true);
    for (int64_t v = 1; v < threads; ++v) {
      const int64_t owner = (t + v) % threads;
      for (int64_t u; (u = shares[owner].take_back()) >= 0;) run_unit(owner, u, false);
    }
  }

 private:
  const Rows& r_;
  int64_t P_, KP_;
  bool amx_;
  av::Buffer<uint32_t> tiles_;
  av::Buffer<uint16_t> rows_;
  av::Q8Rows q_;
  std::vector<av::Problem<W>> problems_;
#ifdef TM_AMX
  std::vector<gemm::amx::Problem> bf16_problems_;  // bf16 on AMX tiles
#endif
  std::vector<Unit> units_;
};

template <typename F>
inline void with_weight_type(const at::Tensor& packed, F&& f) {
  if (packed.scalar_type() == at::kBFloat16)
    f(uint16_t{});
  else if (packed.scalar_type() == at::kChar)
    f(int8_t{});
  else
    f(uint8_t{});
}

inline bool fits(const at::Tensor& packed) {
  const auto s = packed.scalar_type();
  return s == at::kBFloat16 || s == at::kChar || s == at::kByte;
}

// x [T, H] -> out [T, H] (see the top of the file), I: the experts' intermediate size (padded: whole panels).
inline void experts(const float* x, const Rows& r, const float* weights, int64_t T, int64_t k, int64_t H, int64_t I,
                    const at::Tensor& w13, const at::Tensor& s13, const at::Tensor& w2, const at::Tensor& s2, bool amx,
                    float* out) {
  const int64_t R = r.total(), tiles = R / kAlign;
  std::vector<float> xg(R * H), h(R * I), d(R * H);
  const at::Tensor zeros = at::zeros({std::max(w13.size(1), w2.size(1)) * kPanel});
  with_weight_type(w13, [&](auto w13_type) {
    with_weight_type(w2, [&](auto w2_type) {
      Stack<decltype(w13_type)> up(w13, s13, zeros, r, h.data(), 2 * I, true, amx);
      Stack<decltype(w2_type)> down(w2, s2, zeros, r, d.data(), H, false, amx);
      std::vector<av::Share> shares(std::max<int64_t>(1, at::get_num_threads()));
      Team::run([&](Team& team, int64_t t) {
        const int64_t n = team.size();
        const auto [first, last] = share_of(tiles, t, n);
        if (t == 0) up.reset(shares, n);
        gather(r, x, H, xg.data(), first, last);
        for (int64_t tile = first; tile < last; ++tile) up.prepare(xg.data(), H, tile);
        team.sync();
        up.run(shares, t, n);
        team.sync();
        if (t == 0) down.reset(shares, n);
        for (int64_t tile = first; tile < last; ++tile) down.prepare(h.data(), I, tile);
        team.sync();
        down.run(shares, t, n);
        team.sync();
        const auto [t0, t1] = share_of(T, t, n);
        weighted_sum(r, d.data(), weights, k, H, out, t0, t1);
      });
    });
  });
}

}  // namespace vnni
#endif

#ifdef TM_AVX2
namespace panels {
namespace g = gemm;

// One projection of every expert in float32 or bf16-interleaved panels (packed_gemm.h's AVX2 layouts):
// the GEMM writes all N outputs; silu(gate) * up is applied when the next step prepares its rows.
template <typename W>
inline void run_units(const std::vector<Unit>& units, std::atomic<int64_t>& next, const Rows& r, const float* src,
                      int64_t K, const W* packed, int64_t P, int64_t KP, const float* scale, const float* bias,
                      float* y, int64_t N) {
  alignas(32) float wbuf[g::kChunk * kPanel];
  float partial[g::kRowBlock * kPanel];
  for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < static_cast<int64_t>(units.size());) {
    const Unit& unit = units[u];
    const int64_t m = r.start[unit.e], n0 = unit.q * kPanel;
    const W* panel = packed + (unit.e * P + unit.q) * KP * kPanel;
    g::panel_rows(src + m * K, K, unit.m0, unit.m0 + unit.rows, panel, scale + unit.e * P * kPanel + n0, bias + n0,
                  y + m * N + n0, N, std::min(kPanel, N - n0), wbuf, partial);
  }
}

// Tiles [first, last) of gate_up ([R, 2I]) -> h ([R, I]) = silu(gate) * up.
inline void silu_mul(const float* gate_up, int64_t I, float* h, int64_t first, int64_t last) {
  for (int64_t i = first * kAlign; i < last * kAlign; ++i)
    for (int64_t c = 0; c < I; ++c) {
      const float gv = gate_up[i * 2 * I + c];
      h[i * I + c] = gv / (1.0f + std::exp(-gv)) * gate_up[i * 2 * I + I + c];
    }
}

template <typename W>
inline void experts(const float* x, const Rows& r, const float* weights, int64_t T, int64_t k, int64_t H, int64_t I,
                    const at::Tensor& w13, const at::Tensor& s13, const at::Tensor& w2, const at::Tensor& s2,
                    float* out) {
  const int64_t R = r.total(), tiles = R / kAlign;
  std::vector<float> xg(R * H), gate_up(R * 2 * I), h(R * I), d(R * H);
  const std::vector<float> zeros(std::max(w13.size(1), w2.size(1)) * kPanel, 0.0f);
  const std::vector<Unit> units13 = gemm_units(r, g::kRowBlock, w13.size(1));
  const std::vector<Unit> units2 = gemm_units(r, g::kRowBlock, w2.size(1));
  const W* p13 = reinterpret_cast<const W*>(w13.data_ptr());
  const W* p2 = reinterpret_cast<const W*>(w2.data_ptr());
  std::atomic<int64_t> next13{0}, next2{0};
  Team::run([&](Team& team, int64_t t) {
    const auto [first, last] = share_of(tiles, t, team.size());
    gather(r, x, H, xg.data(), first, last);
    team.sync();
    run_units(units13, next13, r, xg.data(), H, p13, w13.size(1), w13.size(2), s13.data_ptr<float>(), zeros.data(),
              gate_up.data(), 2 * I);
    team.sync();
    silu_mul(gate_up.data(), I, h.data(), first, last);
    team.sync();
    run_units(units2, next2, r, h.data(), I, p2, w2.size(1), w2.size(2), s2.data_ptr<float>(), zeros.data(), d.data(),
              H);
    team.sync();
    const auto [t0, t1] = share_of(T, t, team.size());
    weighted_sum(r, d.data(), weights, k, H, out, t0, t1);
  });
}

}  // namespace panels
#endif

#if defined(TM_AVX2) && !defined(TM_AVX512)
namespace integer {
namespace g = gemm;

// One projection of every expert with int8 weights (k pairs, vpmaddwd against int16 activation rows,
// packed_gemm.h) on AVX2 builds.
class Int8Stack {
 public:
  Int8Stack(const at::Tensor& packed, const at::Tensor& scale, const Rows& r, float* y, int64_t N)
      : r_(r),
        weights_(packed.data_ptr<int8_t>()),
        scale_(scale.data_ptr<float>()),
        y_(y),
        N_(N),
        P_(packed.size(1)),
        KP_(packed.size(2)),
        zeros_(P_ * kPanel, 0.0f) {
    q_.values.assign(r.total() * KP_, 0);
    q_.scales.assign(r.total(), 1.0f);
    units_ = gemm_units(r, g::kRowBlock, P_);
  }

  // Tile `tile` of src ([R, K] float32) as int16 rows, one scale each (quantize_rows's rounding).
  void prepare(const float* src, int64_t K, int64_t tile) {
    for (int64_t i = tile * kAlign, end = i + valid_rows(r_, tile); i < end; ++i) {
      const float* row = src + i * K;
      float amax = 0.0f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
      if (!(amax > 0.0f)) continue;  // an all-zero row stays zero
      q_.scales[i] = amax / 32767.0f;
      const float inv = 32767.0f / amax;
      for (int64_t k = 0; k < K; ++k) q_.values[i * KP_ + k] = static_cast<int16_t>(std::nearbyint(row[k] * inv));
    }
  }

  const std::vector<Unit>& units() const { return units_; }

  void run(const Unit& u) const {
    const int64_t n0 = u.q * kPanel, cols = std::min(kPanel, N_ - n0), first = r_.start[u.e];
    const int8_t* panel = weights_ + (u.e * P_ + u.q) * KP_ * kPanel;
    const float* sp = scale_ + u.e * P_ * kPanel + n0;
    for (int64_t m = first + u.m0; m < first + u.m0 + u.rows; m += g::kRows)
      g::with_rows(std::min(g::kRows, first + u.m0 + u.rows - m), [&](auto rows) {
        g::int8_rows<decltype(rows)::value>(q_, KP_, m, panel, sp, zeros_.data() + n0, y_ + m * N_ + n0, N_, cols);
      });
  }

 private:
  const Rows& r_;
  const int8_t* weights_;
  const float* scale_;
  float* y_;
  int64_t N_, P_, KP_;
  std::vector<float> zeros_;
  g::Int16Rows q_;
  std::vector<Unit> units_;
};

// One projection of every expert with grouped 4- or 8-bit weights (packed_int4.h) on AVX2 builds.
class GroupedStack {
 public:
  GroupedStack(const at::Tensor& packed, const at::Tensor& params, const Rows& r, float* y, int64_t N)
      : r_(r),
        weights_(packed.data_ptr<uint8_t>()),
        params_(static_cast<const uint8_t*>(params.data_ptr())),
        y_(y),
        N_(N),
        P_(packed.size(1)),
        KP_(packed.size(2)),
        geo_(g::grouped::geometry(params.select(0, 0), KP_, packed.size(3))),
        weight_stride_(packed.numel() / packed.size(0)),
        params_stride_(params.numel() / params.size(0) * params.element_size()),
        zeros_(P_ * kPanel, 0.0f) {
    const int64_t G = KP_ / g::grouped::kGroup;
    q_ = g::grouped::Q8Rows{std::vector<int8_t>(r.total() * KP_), std::vector<float>(r.total() * G),
                            std::vector<int32_t>(r.total() * G)};
    units_ = gemm_units(r, g::grouped::kRowBlock, P_);
  }

  void prepare(const float* src, int64_t K, int64_t tile) {
    const int64_t G = KP_ / g::grouped::kGroup;
    for (int64_t i = tile * kAlign, end = i + valid_rows(r_, tile); i < end; ++i)
      g::grouped::quantize_row(src + i * K, K, KP_, q_.values.data() + i * KP_, q_.scales.data() + i * G,
                               q_.sums.data() + i * G);
  }

  const std::vector<Unit>& units() const { return units_; }

  void run(const Unit& u) const {
    const int64_t first = r_.start[u.e], panel[1] = {u.q};
    const uint8_t* wp = weights_ + u.e * weight_stride_;
    const uint8_t* pp = params_ + u.e * params_stride_;
    for (int64_t m = first + u.m0; m < first + u.m0 + u.rows; m += 3) {
      switch (std::min<int64_t>(3, first + u.m0 + u.rows - m)) {
        case 3:
          g::grouped::run<1, 3>(q_, m, KP_, wp, pp, geo_, panel, zeros_.data(), y_, N_);
          break;
        case 2:
          g::grouped::run<1, 2>(q_, m, KP_, wp, pp, geo_, panel, zeros_.data(), y_, N_);
          break;
        default:
          g::grouped::run<1, 1>(q_, m, KP_, wp, pp, geo_, panel, zeros_.data(), y_, N_);
      }
    }
  }

 private:
  const Rows& r_;
  const uint8_t* weights_;
  const uint8_t* params_;
  float* y_;
  int64_t N_, P_, KP_;
  g::grouped::Geometry geo_;
  int64_t weight_stride_, params_stride_;  // bytes per expert
  std::vector<float> zeros_;
  g::grouped::Q8Rows q_;
  std::vector<Unit> units_;
};

template <typename Stack>
inline void run_units(const Stack& stack, std::atomic<int64_t>& next) {
  const std::vector<Unit>& units = stack.units();
  for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < static_cast<int64_t>(units.size());)
    stack.run(units[u]);
}

template <typename Up, typename Down>
inline void experts(const float* x, const Rows& r, const float* weights, int64_t T, int64_t k, int64_t H, int64_t I,
                    std::vector<float>& xg, std::vector<float>& gate_up, std::vector<float>& h, std::vector<float>& d,
                    Up& up, Down& down, float* out) {
  const int64_t tiles = r.total() / kAlign;
  std::atomic<int64_t> next13{0}, next2{0};
  Team::run([&](Team& team, int64_t t) {
    const auto [first, last] = share_of(tiles, t, team.size());
    gather(r, x, H, xg.data(), first, last);
    for (int64_t tile = first; tile < last; ++tile) up.prepare(xg.data(), H, tile);
    team.sync();
    run_units(up, next13);
    team.sync();
    panels::silu_mul(gate_up.data(), I, h.data(), first, last);
    for (int64_t tile = first; tile < last; ++tile) down.prepare(h.data(), I, tile);
    team.sync();
    run_units(down, next2);
    team.sync();
    const auto [t0, t1] = share_of(T, t, team.size());
    weighted_sum(r, d.data(), weights, k, H, out, t0, t1);
  });
}

inline bool fits(const at::Tensor& packed) {
  return packed.scalar_type() == at::kChar || packed.scalar_type() == at::kByte;
}

// Calls f(stack) with the stack of `packed`'s kind.
template <typename F>
inline void with_stack(const at::Tensor& packed, const at::Tensor& scale, const Rows& r, float* y, int64_t N, F&& f) {
  if (packed.scalar_type() == at::kChar) {
    Int8Stack stack(packed, scale, r, y, N);
    f(stack);
  } else {
    GroupedStack stack(packed, scale, r, y, N);
    f(stack);
  }
}

inline void experts(const float* x, const Rows& r, const float* weights, int64_t T, int64_t k, int64_t H, int64_t I,
                    const at::Tensor& w13, const at::Tensor& s13, const at::Tensor& w2, const at::Tensor& s2,
                    float* out) {
  const int64_t R = r.total();
  std::vector<float> xg(R * H), gate_up(R * 2 * I), h(R * I), d(R * H);
  with_stack(w13, s13, r, gate_up.data(), 2 * I, [&](auto& up) {
    with_stack(w2, s2, r, d.data(), H,
               [&](auto& down) { experts(x, r, weights, T, k, H, I, xg, gate_up, h, d, up, down, out); });
  });
}

}  // namespace integer
#endif

// Every expert in turn through packed_linear (its own parallel regions): builds without AVX2, and
// mixes of float and integer weights the one-region paths above do not take.
inline void experts_in_turn(const at::Tensor& x, const Rows& r, const float* weights, int64_t T, int64_t k, int64_t I,
                            const at::Tensor& w13, const at::Tensor& s13, const at::Tensor& w2, const at::Tensor& s2,
                            float* out) {
  const int64_t H = x.size(1), R = r.total(), E = w13.size(0);
  std::vector<float> d(R * H, 0.0f);
  const at::Tensor zeros = at::zeros({std::max(w13.size(1), w2.size(1)) * kPanel});
  const float* xp = x.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) {
    if (!r.count[e]) continue;
    at::Tensor xe = at::empty({r.count[e], H}, x.options());
    for (int64_t i = 0; i < r.count[e]; ++i)
      std::memcpy(xe.data_ptr<float>() + i * H, xp + r.source[r.start[e] + i] * H, H * sizeof(float));
    const at::Tensor he = gemm::packed_linear(xe, w13.select(0, e), s13.select(0, e),
                                              zeros.narrow(0, 0, w13.size(1) * kPanel), 2 * I, true);
    const at::Tensor de = gemm::packed_linear(he.contiguous(), w2.select(0, e), s2.select(0, e),
                                              zeros.narrow(0, 0, w2.size(1) * kPanel), H, false);
    std::memcpy(d.data() + r.start[e] * H, de.data_ptr<float>(), r.count[e] * H * sizeof(float));
  }
  weighted_sum(r, d.data(), weights, k, H, out, 0, T);
}

// Throws unless every expert's slice of packed and scale is a packed layer of K in- and N out-features:
// packed_gemm's own checks, but for float32 panels, which AVX-512 builds run here only.
inline void check_stack(const at::Tensor& packed, const at::Tensor& scale, int64_t K, int64_t N, bool silu_mul) {
  TORCH_CHECK(scale.size(0) == packed.size(0), "a scale per expert");
  const at::Tensor one = packed.select(0, 0), one_scale = scale.select(0, 0);
  if (packed.scalar_type() != at::kFloat) {
    gemm::check_packed(one, one_scale, at::zeros({one.size(0) * kPanel}), K, N, silu_mul);
    return;
  }
#ifdef TM_AVX2
  TORCH_CHECK(one.size(2) == kPanel && one.size(1) == K && one.size(0) * kPanel >= N &&
                  one_scale.numel() == one.size(0) * kPanel && scale.scalar_type() == at::kFloat &&
                  reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0,
              "float32 expert panels: [E, P, K, 16], 32-byte aligned, with a float32 scale [E, P * 16]");
#else
  TORCH_CHECK(false, "float32 expert panels need a build with AVX2");
#endif
}

// x [T, H] float32, topk_ids [T, k] int64, topk_weights [T, k] float32, w13 [E, P13, KP, width] with
// P13 = 2 I / 16 ([gate | up] halves of whole panels), w2 [E, P2, KP2, width] -> [T, H] float32.
// amx: int8 experts may run on AMX tiles (where this library's are on): the packed GEMM's switch, passed in.
inline at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              const at::Tensor& w13, const at::Tensor& s13, const at::Tensor& w2, const at::Tensor& s2,
                              int64_t I, bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [T, H] float32");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(
      topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous(),
      "topk_ids: contiguous [T, k] int64");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous(),
              "topk_weights: contiguous [T, k] float32");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(0) == w2.size(0) && w13.is_contiguous() &&
                  w2.is_contiguous() && s13.is_contiguous() && s2.is_contiguous(),
              "w13, w2: contiguous [E, P, KP, width] with the same E");
  TORCH_CHECK(w13.size(1) * kPanel == 2 * I && I % kPanel == 0, "w13: [gate | up] halves of whole panels (I = ", I,
              ")");
  check_stack(w13, s13, H, 2 * I, true);
  check_stack(w2, s2, I, H, false);
  const int64_t k = topk_ids.size(1), E = w13.size(0);
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const Rows r = group_rows(topk_ids.data_ptr<int64_t>(), T, k, E);
  const float* weights = topk_weights.data_ptr<float>();
#ifdef TM_AVX512
  if (vnni::fits(w13) && vnni::fits(w2)) {
    vnni::experts(x.data_ptr<float>(), r, weights, T, k, H, I, w13, s13, w2, s2, amx && gemm::amx_on(),
                  out.data_ptr<float>());
    return out;
  }
#endif
#ifdef TM_AVX2
  const bool f32 = w13.scalar_type() == at::kFloat && w2.scalar_type() == at::kFloat;
#ifdef TM_AVX512
  const bool interleaved = false;  // AVX-512 builds pack bf16 in k pairs (vnni above)
#else
  const bool interleaved = w13.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16;
#endif
  if (f32) {
    panels::experts<float>(x.data_ptr<float>(), r, weights, T, k, H, I, w13, s13, w2, s2, out.data_ptr<float>());
    return out;
  }
  if (interleaved) {
    panels::experts<uint16_t>(x.data_ptr<float>(), r, weights, T, k, H, I, w13, s13, w2, s2, out.data_ptr<float>());
    return out;
  }
#endif
#if defined(TM_AVX2) && !defined(TM_AVX512)
  if (integer::fits(w13) && integer::fits(w2)) {
    integer::experts(x.data_ptr<float>(), r, weights, T, k, H, I, w13, s13, w2, s2, out.data_ptr<float>());
    return out;
  }
#endif
  experts_in_turn(x, r, weights, T, k, I, w13, s13, w2, s2, out.data_ptr<float>());
  return out;
}

}  // namespace tokenmill::moe
