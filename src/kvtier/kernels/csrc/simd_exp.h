// AVX-512 helpers shared by the kernels that include it (prefill_attention.cpp, vllm_paged_attention.cpp,
// layer_attention.cpp): exp of 16 floats at once, and the sums of 16 vectors' lanes as one vector;
// kvtier/kernels/build.py puts this text in place of the include line.
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

// s[i] = sum of the 16 lanes of v[i], i < 16: a transpose-and-add tree (pairs within 128-bit lanes,
// then quads, then across the four 128-bit lanes), ~3 instructions per vector instead of a
// horizontal reduction of each.
inline __m512 reduce16(const __m512* v) {
  __m512 u[8], w[4];
  for (int k = 0; k < 8; ++k)
    u[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int m = 0; m < 4; ++m)
    w[m] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0x44), _mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0xEE));
  // w[m]'s 128-bit lane L holds, for vectors 4m..4m+3, the sum of their lane L
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

}  // namespace

#endif  // __AVX512F__
#endif  // KVTIER_KERNELS_CSRC_SIMD_EXP_H_
