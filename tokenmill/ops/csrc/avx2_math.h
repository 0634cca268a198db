// Vector math shared by our CPU kernels (AVX2 + FMA builds; exp512 on AVX-512 builds).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace tokenmill {

// exp(x) = 2^n * exp(r) with |r| <= ln2/2 and Cephes' degree-5 polynomial (relative error ~1e-7).
// x is clamped to [-87, 88]: below, the result is ~1e-38 (callers treat it as 0). The constants,
// shared by the 8- and 16-lane versions (so both give the same result lane for lane):
namespace exp_poly {
constexpr float kLow = -87.0f, kHigh = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;  // ln2 = kLn2Hi - kLn2Lo, r exact to float
constexpr float kCoeffs[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};  // degree 5 down to 1
}  // namespace exp_poly

inline __m256 exp256(__m256 x) {  // eight lanes
  using namespace exp_poly;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLow)), _mm256_set1_ps(kHigh));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  __m256 p = _mm256_set1_ps(kCoeffs[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kCoeffs[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#ifdef __AVX512F__
inline __m512 exp512(__m512 x) {  // sixteen lanes
  using namespace exp_poly;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kLow)), _mm512_set1_ps(kHigh));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kCoeffs[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kCoeffs[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

}  // namespace tokenmill
#endif
