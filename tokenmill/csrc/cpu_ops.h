// Fused element-wise ops for CPU decoder layers (float32). Each one replaces several torch ops and
// their temporaries with one pass over the rows, so a decode step spends its time in the GEMMs.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "avx2_math.h"

namespace tokenmill::ops {

// residual += x; x = weight * residual / rms(residual). In place on both: [n, hidden] float32.
inline void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && residual.scalar_type() == torch::kFloat &&
              weight.scalar_type() == torch::kFloat, "float32 inputs");
  const int64_t n = x.size(0), h = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xi = xp + i * h;
      float* ri = rp + i * h;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < h; ++d) {
        ri[d] += xi[d];
        sum += ri[d] * ri[d];
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t d = 0; d < h; ++d) xi[d] = wp[d] * (ri[d] * inv);
    }
  });
}

// [n, 2 * inter] (gate | up) -> [n, inter]: silu(gate) * up.
inline torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.scalar_type() == torch::kFloat, "contiguous float32 input");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* g = gp + i * 2 * inter;
      const float* u = g + inter;
      float* o = op + i * inter;
      int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; d + 8 <= inter; d += 8) {
        const __m256 gv = _mm256_loadu_ps(g + d);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, tokenmill::exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + d)));
      }
#endif
      for (; d < inter; ++d) o[d] = g[d] / (1.0f + std::exp(-g[d])) * u[d];
    }
  });
  return out;
}

// Rotary embedding (rotate-half form) in place on the first `num_heads` heads of each row of `qk`
// ([n, row_stride] float32, heads of `head_dim` side by side: the q and k heads of a fused QKV
// output). cos/sin: [n, head_dim / 2], each token's angles.
inline void rotary_(torch::Tensor qk, int64_t num_heads, int64_t head_dim, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qk.scalar_type() == torch::kFloat && qk.stride(1) == 1, "float32 rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == qk.size(0) * (head_dim / 2) &&
              sin.numel() == cos.numel(), "contiguous [n, head_dim / 2] cos and sin");
  TORCH_CHECK(num_heads * head_dim <= qk.size(1), "the heads do not fit in a row");
  const int64_t n = qk.size(0), row_stride = qk.stride(0), half = head_dim / 2;
  float* base = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + i * half;
      const float* s = sp + i * half;
      for (int64_t hd = 0; hd < num_heads; ++hd) {
        float* x1 = base + i * row_stride + hd * head_dim;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = x1[d], b = x2[d];
          x1[d] = a * c[d] - b * s[d];
          x2[d] = b * c[d] + a * s[d];
        }
      }
    }
  });
}

}  // namespace tokenmill::ops
