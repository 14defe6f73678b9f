// The numeric helpers every CPU kernel shares: exp (scalar and 16 lanes), fp16 / bf16 conversions,
// the byte -> 8 bits table, the lane-sum trees and the dots. Each function is defined here once;
// a kernel changes none of their operations (its results are bit-identical to these).
//
// Everything sits in an anonymous namespace: each kernel is its own module, built by
// kvtier/kernels/build.py, which puts this file's text in place of the line including it.
#ifndef KVTIER_KERNELS_CSRC_NUMERIC_H_
#define KVTIER_KERNELS_CSRC_NUMERIC_H_

#include <c10/util/Half.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr float NEG = -std::numeric_limits<float>::infinity();

// --- exp ---

// exp(x) for x <= 0 (Cephes polynomial, ~1 ulp), 0 below -87; written so loops vectorize.
inline float fexp(float x) {
  const float xc = std::max(x, -87.0f);
  const float k = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  const float s = std::bit_cast<float>(((int32_t)k + 127) << 23);
  return x < -87.0f ? 0.0f : p * s;
}

#if defined(__AVX512F__)
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
#endif

// --- fp16 / bf16 conversions ---

inline float half_to_float(uint16_t h) { return float(c10::Half(h, c10::Half::from_bits())); }

inline uint16_t float_to_half_bits(float f) { return c10::Half(f).x; }

inline float bf16_to_float(uint16_t x) { return std::bit_cast<float>(uint32_t(x) << 16); }

// dst[i] = src[i] as fp32, i < n (fp16 bits), 16 at a time where AVX-512 is built
inline void halves_to_floats(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// dst[i] = src[i] as fp32, i < n (fp16 bits), 8 at a time where F16C is built
inline void halves_to_floats8(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// dst[i] = src[i] as fp32, i < n (bf16 bits)
inline void bf16s_to_floats(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

// --- bit tables ---

// Byte -> its 8 bits as floats, LSB first (kvtier.quant.pack_bits order).
struct Bits8 {
  alignas(32) float v[256][8];
  Bits8() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) v[b][i] = float((b >> i) & 1);
  }
};
const Bits8 kBits;

// Bit t of packed bits (LSB first, as kvtier.quant.pack_bits).
inline bool bit(const uint8_t* bits, int64_t t) { return (bits[t >> 3] >> (t & 7)) & 1; }

// --- lane sums and dots ---

// Lane-wise partial sums, then a fixed tree over the lanes: SIMD without -ffast-math (a plain
// reduction ends in a serial chain of scalar adds, which dominated the score loop).
template <int L>
inline float hsum(float* p) {
  if constexpr (L == 1) {
    return p[0];
  } else {
#pragma omp simd
    for (int l = 0; l < L / 2; ++l) p[l] += p[l + L / 2];
    return hsum<L / 2>(p);
  }
}

// a . b over N (known at compile time) floats: L lanes of partial sums, then hsum's tree.
template <int N>
inline float dot_t(const float* __restrict a, const float* __restrict b) {
  constexpr int L = N % 16 == 0 ? 16 : (N % 8 == 0 ? 8 : 1);
  alignas(64) float p[L];
#pragma omp simd
  for (int l = 0; l < L; ++l) p[l] = a[l] * b[l];
  for (int k = 1; k < N / L; ++k) {
#pragma omp simd
    for (int l = 0; l < L; ++l) p[l] += a[k * L + l] * b[k * L + l];
  }
  return hsum<L>(p);
}

// Runtime-length dot with the same lane tree (tails summed in order).
inline float dot_n(const float* __restrict a, const float* __restrict b, int64_t n) {
  alignas(64) float p[16] = {0.f};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
#pragma omp simd
    for (int l = 0; l < 16; ++l) p[l] += a[k + l] * b[k + l];
  }
  float acc = hsum<16>(p);
  for (; k < n; ++k) acc += a[k] * b[k];
  return acc;
}

// a . b over n floats as one SIMD reduction (the compiler's lane order).
inline float dot_reduce(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += a[j] * b[j];
  return acc;
}

#if defined(__AVX512F__)
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

// Horizontal sums of 16 vectors in one transposing reduction (another lane order than reduce16):
// lane l of the result is the sum of v[hslot(l)] (so a caller writing token u's partial vector to
// v[hslot(u)] gets token u's sum in lane u).
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = v[2 * i], y = v[2 * i + 1];
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 x = a[2 * i], y = a[2 * i + 1];
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    const __m512 x = b[2 * i], y = b[2 * i + 1];
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}
constexpr int hslot(int u) { return 4 * (u & 3) + (u >> 2); }
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// acc + a . b over bf16 pairs (VDPBF16PS: each fp32 lane adds the products of its two bf16 pairs)
inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}
#endif

}  // namespace

#endif  // KVTIER_KERNELS_CSRC_NUMERIC_H_
