// exp of 16 floats at once on AVX-512, shared by the kernels that include it (prefill_attention.cpp,
// vllm_paged_attention.cpp); kvtier/kernels/build.py puts this text in place of the include line.
#ifndef KVTIER_KERNELS_CSRC_SIMD_EXP_H_
#define KVTIER_KERNELS_CSRC_SIMD_EXP_H_

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// exp(x) for x <= 0 (softmax scores minus their max): 2^n * 2^f, f in [-0.5, 0.5], degree-6 polynomial
// (relative error ~1e-7, the fp32 rounding of std::exp); x = -inf gives 0.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // ln 2 * frac
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace

#endif  // __AVX512F__
#endif  // KVTIER_KERNELS_CSRC_SIMD_EXP_H_
