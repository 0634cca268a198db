// Fused element-wise ops for CPU decoder layers (float32). Each one replaces several torch ops and
// their temporaries with one pass over the rows, so a decode step spends its time in the GEMMs.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "avx2_math.h"

namespace tokenmill::ops {

// One row of add_rms_norm_: r += x; x = w * r / rms(r), both [h].
inline void add_rms_norm_row(float* x, float* r, const float* w, int64_t h, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < h; ++d) {
    r[d] += x[d];
    sum += r[d] * r[d];
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t d = 0; d < h; ++d) x[d] = w[d] * (r[d] * inv);
}

// residual += x; x = weight * residual / rms(residual). In place on both: [n, hidden] float32.
inline void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && residual.scalar_type() == torch::kFloat &&
                  weight.scalar_type() == torch::kFloat,
              "float32 inputs");
  const int64_t n = x.size(0), h = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) add_rms_norm_row(xp + i * h, rp + i * h, wp, h, static_cast<float>(eps));
  });
}

// One [gate | up] row (2 * inter floats) -> silu(gate) * up (inter floats).
inline void silu_mul_row(const float* g, float* o, int64_t inter) {
  const float* u = g + inter;
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; d + 8 <= inter; d += 8) {
    const __m256 gv = _mm256_loadu_ps(g + d);
    const __m256 sig =
        _mm256_div_ps(one, _mm256_add_ps(one, tokenmill::exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + d)));
  }
#endif
  for (; d < inter; ++d) o[d] = g[d] / (1.0f + std::exp(-g[d])) * u[d];
}

// [n, 2 * inter] (gate | up) -> [n, inter]: silu(gate) * up.
inline torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.scalar_type() == torch::kFloat, "contiguous float32 input");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) silu_mul_row(gp + i * 2 * inter, op + i * inter, inter);
  });
  return out;
}

// One head rotated in place: (x[d], x[d + half]) by the angle of (c[d], s[d]), d < half.
inline void rotate_head(float* x, const float* c, const float* s, int64_t half) {
  float* x2 = x + half;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d], b = x2[d];
    x[d] = a * c[d] - b * s[d];
    x2[d] = b * c[d] + a * s[d];
  }
}

// Rotary embedding (rotate-half form) in place on the first `num_heads` heads of each row of `qk`
// ([n, row_stride] float32, heads of `head_dim` side by side: the q and k heads of a fused QKV
// output). cos/sin: [n, head_dim / 2], each token's angles.
inline void rotary_(torch::Tensor qk, int64_t num_heads, int64_t head_dim, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qk.scalar_type() == torch::kFloat && qk.stride(1) == 1, "float32 rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == qk.size(0) * (head_dim / 2) &&
                  sin.numel() == cos.numel(),
              "contiguous [n, head_dim / 2] cos and sin");
  TORCH_CHECK(num_heads * head_dim <= qk.size(1), "the heads do not fit in a row");
  const int64_t n = qk.size(0), row_stride = qk.stride(0), half = head_dim / 2;
  float* base = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + i * half;
      const float* s = sp + i * half;
      for (int64_t hd = 0; hd < num_heads; ++hd) rotate_head(base + i * row_stride + hd * head_dim, c, s, half);
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
inline float sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// exp((l[t] - max) * inv_t) for the first n (may be <= 0) of eight logits, 0 past them and for -inf (masked).
inline __m256 weights8(const float* l, int64_t n, float max, float inv_t) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 x;
  if (n >= 8) {
    x = _mm256_loadu_ps(l);
  } else {
    alignas(32) float part[8];
    for (int64_t t = 0; t < 8; ++t) part[t] = t < n ? l[t] : -std::numeric_limits<float>::infinity();
    x = _mm256_load_ps(part);
  }
  const __m256 live = _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ);
  const __m256 e = exp256(_mm256_mul_ps(_mm256_sub_ps(x, _mm256_set1_ps(max)), _mm256_set1_ps(inv_t)));
  return _mm256_and_ps(live, e);
}
#endif

// The unnormalized probabilities exp((l - max) / T) of tokens [16c, 16c + 16) of a row of v logits,
// zeros past v (a -inf logit, masked, weighs exactly 0); returns their sum.
inline float chunk_weights(const float* l, int64_t v, int64_t c, float max, float inv_t, float* w) {
  const int64_t first = 16 * c, n = std::min<int64_t>(16, v - first);
#ifdef __AVX512F__
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __mmask16 in_row = static_cast<__mmask16>((1u << n) - 1);
  const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), in_row, l + first);
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(neg_inf), _CMP_NEQ_OQ);
  const __m512 e = exp512(_mm512_mul_ps(_mm512_sub_ps(x, _mm512_set1_ps(max)), _mm512_set1_ps(inv_t)));
  const __m512 weights = _mm512_maskz_mov_ps(live, e);
  _mm512_storeu_ps(w, weights);
  return _mm512_reduce_add_ps(weights);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t h = 0; h < 2; ++h) {  // tokens [first + 8h, first + 8h + 8)
    const __m256 weights = weights8(l + first + 8 * h, n - 8 * h, max, inv_t);
    _mm256_storeu_ps(w + 8 * h, weights);
    acc = _mm256_add_ps(acc, weights);
  }
  return sum8(acc);
#else
  float sum = 0.0f;
  for (int64_t t = 0; t < 16; ++t) sum += (w[t] = t < n ? std::exp((l[first + t] - max) * inv_t) : 0.0f);
  return sum;
#endif
}

// The largest of l[0, v) (NaNs aside), and whether any is NaN: four vector maxima in flight.
inline float row_max(const float* l, int64_t v, bool& nan) {
  float max = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#ifdef __AVX512F__
  __m512 m[4];
  for (auto& x : m) x = _mm512_set1_ps(max);
  __mmask16 unordered = 0;
  for (; t + 64 <= v; t += 64)
    for (int j = 0; j < 4; ++j) {
      const __m512 x = _mm512_loadu_ps(l + t + 16 * j);
      unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      m[j] = _mm512_max_ps(x, m[j]);  // a NaN in x keeps m[j] (maxps returns its second operand)
    }
  max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
  nan = unordered != 0;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 m[4];
  for (auto& x : m) x = _mm256_set1_ps(max);
  __m256 unordered = _mm256_setzero_ps();
  for (; t + 32 <= v; t += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 x = _mm256_loadu_ps(l + t + 8 * j);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      m[j] = _mm256_max_ps(x, m[j]);  // a NaN in x keeps m[j] (maxps returns its second operand)
    }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
  for (const float lane : lanes) max = std::max(max, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; t < v; ++t) {
    max = std::max(max, l[t]);
    nan = nan || l[t] != l[t];
  }
  return max;
}

// The total weight of chunks [c0, c1) (see chunk_weights), summed in one vector: a horizontal sum
// per chunk would cost more than its exponentials.
inline float span_weight(const float* l, int64_t v, int64_t c0, int64_t c1, float max, float inv_t) {
#ifdef __AVX512F__
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 shift = _mm512_set1_ps(max), scale = _mm512_set1_ps(inv_t), masked = _mm512_set1_ps(neg_inf);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t first = 16 * c, n = std::min<int64_t>(16, v - first);
    const __mmask16 in_row = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __m512 x = _mm512_mask_loadu_ps(masked, in_row, l + first);
    const __mmask16 live = _mm512_cmp_ps_mask(x, masked, _CMP_NEQ_OQ);
    acc = _mm512_mask_add_ps(acc, live, acc, exp512(_mm512_mul_ps(_mm512_sub_ps(x, shift), scale)));
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t first = 16 * c;
    acc = _mm256_add_ps(acc, weights8(l + first, v - first, max, inv_t));
    acc = _mm256_add_ps(acc, weights8(l + first + 8, v - first - 8, max, inv_t));
  }
  return sum8(acc);
#else
  float w[16], sum = 0.0f;
  for (int64_t c = c0; c < c1; ++c) sum += chunk_weights(l, v, c, max, inv_t, w);
  return sum;
#endif
}

// One token per row drawn from softmax(logits / temperature) by inverse CDF, without materializing
// the probabilities: the first token whose running sum of weights exceeds uniform * (their total),
// summed in float64 (a token of weight 0 never wins). Replaces softmax, a float64 cumsum and a
// search over [rows, vocab] temporaries. logits: [R, V] float32; temperature: [R] float32 > 0;
// uniform: [R] float64 in [0, 1) -> [R] int64.
inline torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat,
              "logits: contiguous [rows, vocab] float32");
  TORCH_CHECK(temperature.is_contiguous() && temperature.scalar_type() == torch::kFloat &&
                  temperature.numel() == logits.size(0) && uniform.is_contiguous() &&
                  uniform.scalar_type() == torch::kDouble && uniform.numel() == logits.size(0),
              "temperature: [rows] float32, uniform: [rows] float64");
  const int64_t rows = logits.size(0), v = logits.size(1), chunks = (v + 15) / 16;
  auto out = torch::zeros({rows}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const double* up = uniform.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  constexpr int64_t kSpan = 16;  // chunks per partial sum: the walk finds a span, then a chunk in it
  const int64_t spans = (chunks + kSpan - 1) / kSpan;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> span_sums(spans);
    float sums[kSpan];  // the chosen span's chunk totals
    alignas(64) float w[16];
    for (int64_t r = begin; r < end; ++r) {
      const float* l = lp + r * v;
      bool nan = false;
      const float max = row_max(l, v, nan);
      if (!(max > -std::numeric_limits<float>::infinity())) continue;  // every token masked: token 0
      const float inv_t = 1.0f / tp[r];
      double total = 0.0;
      int64_t last = 0;  // the last span of nonzero weight: the draw never lands past it
      for (int64_t sp = 0; sp < spans; ++sp) {
        span_sums[sp] = span_weight(l, v, sp * kSpan, std::min(chunks, (sp + 1) * kSpan), max, inv_t);
        total += span_sums[sp];
        if (span_sums[sp] > 0.0f) last = sp;
      }
      const double target = up[r] * total;
      double running = 0.0;
      int64_t sp = 0;
      for (; sp < last && running + span_sums[sp] <= target; ++sp) running += span_sums[sp];
      const int64_t c0 = sp * kSpan, count = std::min(chunks, c0 + kSpan) - c0;
      int64_t last_chunk = 0;  // within the span, likewise
      for (int64_t i = 0; i < count; ++i) {
        sums[i] = chunk_weights(l, v, c0 + i, max, inv_t, w);
        if (sums[i] > 0.0f) last_chunk = i;
      }
      int64_t i = 0;
      for (; i < last_chunk && running + sums[i] <= target; ++i) running += sums[i];
      chunk_weights(l, v, c0 + i, max, inv_t, w);
      int64_t pick = -1;
      for (int t = 0; t < 16; ++t) {
        if (w[t] <= 0.0f) continue;
        pick = t;
        running += w[t];
        if (running > target) break;
      }
      op[r] = 16 * (c0 + i) + std::max<int64_t>(pick, 0);
    }
  });
  return out;
}

inline int64_t first_nan(const float* l) {  // one is there
  int64_t t = 0;
  while (l[t] == l[t]) ++t;
  return t;
}

inline int64_t first_equal(const float* l, int64_t v, float x) {  // x is one of l[0, v)
  int64_t t = 0;
#ifdef __AVX512F__
  const __m512 target = _mm512_set1_ps(x);
  for (; t + 16 <= v; t += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(l + t), target, _CMP_EQ_OQ);
    if (hit) return t + __builtin_ctz(hit);
  }
#endif
  while (l[t] != x) ++t;
  return t;
}

// The index of each row's largest logit, the first of equals, as torch.argmax (a NaN counts as the
// largest): greedy decoding's pick, one vector pass per row for the maximum and one for its first
// index, the rows shared by the threads.
// logits: [R, V] float32 -> [R] int64.
inline torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(
      logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat && logits.size(1) > 0,
      "logits: contiguous [rows, vocab] float32, vocab > 0");
  const int64_t rows = logits.size(0), v = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* l = lp + r * v;
      bool nan = false;
      const float max = row_max(l, v, nan);
      op[r] = nan ? first_nan(l) : first_equal(l, v, max);
    }
  });
  return out;
}

}  // namespace tokenmill::ops
