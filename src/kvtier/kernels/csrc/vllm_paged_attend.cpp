// vllm_paged_attend: one layer's attention of one vLLM step over kvtier's packed pages
// (kvtier/codecs/pages.py): attention of each request's new tokens over its packed blocks (block
// table) and its exact tokens, read in place in the model dtype: the side buffer's rows of its partly
// filled block, then the step's new K/V (causal). Output written straight into vLLM's output. One
// module with the step's two other calls, vllm_paged_encode.cpp (update) and vllm_paged_decode.cpp;
// vllm_paged.h holds the pieces they share, page_codes.h the page's layout and codes.
//
// Per (request, kv head) task, every query row that shares the head (G query heads x q tokens) runs
// an online softmax over: the packed blocks (all visible; a cached block read in part: its first
// rows), then the exact rows (causal: query i of q sees exact row j < ne - q + i + 1). With AVX-512
// and head_dim 64, keys are scored 16 tokens at a time (unpacked once, one transpose-and-add tree
// for the 16 dot products of a row) and packed values are dequantized in registers and folded into
// 4 query rows at a time. Sparse decode (struct Sparse, PagePolicy.sparse_mass): a request of at most
// max_query new tokens scores all its packed tokens first, then folds the values of only the tokens
// some row keeps (row mass rule, local window, sinks). Tasks run on torch's threads (built with
// OpenMP: kvtier/kernels/build.py).
// Reference: kvtier.vllm.pages.paged.attend_request.
//
// Sections: the online softmax (Rows) and the per-page steps (score_page, fold_page, attend_page,
// select_row, keep_tokens); the tasks of one call (plan_splits, sparse_packed, dense_packed,
// exact_rows, merge_splits, attend_impl); the checked entry point.

#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "page_codes.h"
#include "numeric.h"
#include "vllm_paged.h"

// score_page's parts are inlined into it (always_inline): the compiler sees one loop nest as before.
#define KVTIER_INLINE inline __attribute__((always_inline))

namespace {

#if defined(__AVX512F__)
// 32 4-bit codes (16 bytes, low nibble first) as two vectors of 16 floats, in code order.
inline void unpack32(const uint8_t* c, __m512& a, __m512& b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m128i m = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
  a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
}
#endif

#if defined(__AVX512F__)
// 64 3-bit codes (a 2-bit plane of 16 bytes, then a 1-bit plane of 8: kvtier.quant.pack_bits) as four
// vectors of 16 floats, in code order
inline void unpack64_3(const uint8_t* c, __m512* v) {
  const __m512i s2 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i s1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int j = 0; j < 4; ++j) {
    uint32_t lo;
    uint16_t hi;
    std::memcpy(&lo, c + 4 * j, 4);
    std::memcpy(&hi, c + 16 + 2 * j, 2);
    const __m512i a = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(lo)), s2), _mm512_set1_epi32(3));
    const __m512i b = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(hi), s1), _mm512_set1_epi32(1));
    v[j] = _mm512_cvtepi32_ps(_mm512_or_si512(a, _mm512_slli_epi32(b, 2)));
  }
}

// p[row * n + t + i] = q[row] . kb[i] - sub[row] (no subtraction when sub is null) for 16 tokens
// kb [16, 64] and R query rows q [R, 64].
inline void score16_d64(const float* kb, const float* q, int64_t R, const float* sub, float* p, int64_t n, int64_t t) {
  for (int64_t row = 0; row < R; ++row) {
    const float* qq = q + row * 64;
    const __m512 q0 = _mm512_loadu_ps(qq), q1 = _mm512_loadu_ps(qq + 16);
    const __m512 q2 = _mm512_loadu_ps(qq + 32), q3 = _mm512_loadu_ps(qq + 48);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
      const float* k = kb + i * 64;
      __m512 x = _mm512_mul_ps(q0, _mm512_load_ps(k));
      x = _mm512_fmadd_ps(q1, _mm512_load_ps(k + 16), x);
      x = _mm512_fmadd_ps(q2, _mm512_load_ps(k + 32), x);
      acc[i] = _mm512_fmadd_ps(q3, _mm512_load_ps(k + 48), x);
    }
    __m512 sc = reduce16(acc);
    if (sub) sc = _mm512_sub_ps(sc, _mm512_set1_ps(sub[row]));
    _mm512_storeu_ps(p + row * n + t, sc);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// 32 4-bit codes (16 bytes, low nibble first) as 32 bf16 in code order: dword j holds codes 2j, 2j+1
// (the pair layout of VDPBF16PS). Codes 0..15 are exact in bf16 (a 16-entry table).
inline __m512i codes32_bf16(const uint8_t* c) {
  const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                       0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
                                       0x4040, 0x4000, 0x3F80, 0x0000);
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  const __m512i lo = _mm512_and_si512(x, _mm512_set1_epi32(15));
  // lo | ((x << 12) & 0xF0000): the high nibble into the upper word
  const __m512i idx = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi32(x, 12), _mm512_set1_epi32(0xF0000), 0xF8);
  return _mm512_permutexvar_epi16(idx, lut);
}

// fp32 row x [64] as bf16 hi + lo (hi = bf16(x), lo = bf16(x - hi): x to ~2^-17 of itself), each
// two vectors of 32 in channel order
inline void split_bf16(const float* x, __m512i* hi, __m512i* lo) {
  for (int j = 0; j < 2; ++j) kvtier_pages::split_bf16_32(x + 32 * j, hi[j], lo[j]);
}

// p[row * n + t + i] = qs[row] . codes(t + i) - sub[row] for 16 tokens of 4-bit codes kc (32 bytes
// each) and R rows qs [R, 64] (q times the key scales, fp32): codes exact in bf16, qs split into
// bf16 hi + lo, products summed in fp32 (VDPBF16PS), one transpose-and-add tree per row
inline void score16_codes_d64(const uint8_t* kc, const float* qs, int64_t R, const float* sub, float* p, int64_t n,
                              int64_t t) {
  alignas(64) __m512i kb[16][2];
  for (int i = 0; i < 16; ++i) {
    kb[i][0] = codes32_bf16(kc + i * 32);
    kb[i][1] = codes32_bf16(kc + i * 32 + 16);
  }
  for (int64_t row = 0; row < R; ++row) {
    __m512i hi[2], lo[2];
    split_bf16(qs + row * 64, hi, lo);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
      __m512 x = dot_bf16(_mm512_setzero_ps(), kb[i][0], lo[0]);
      x = dot_bf16(x, kb[i][1], lo[1]);
      x = dot_bf16(x, kb[i][0], hi[0]);
      acc[i] = dot_bf16(x, kb[i][1], hi[1]);
    }
    _mm512_storeu_ps(p + row * n + t, _mm512_sub_ps(reduce16(acc), _mm512_set1_ps(sub[row])));
  }
}
#endif

// max(init, p[0..n))
inline float row_max(const float* p, int64_t n, float init) {
  float mx = init;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(p + t));
  mx = _mm512_reduce_max_ps(vm);
#endif
  for (; t < n; ++t) mx = std::max(mx, p[t]);
  return mx;
}

// p[t] = exp(p[t] - mx) (0 for -inf) in place, t < n; returns their sum
inline float exp_sum(float* p, int64_t n, float mx) {
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vs = _mm512_setzero_ps();
  const __m512 vmx = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p + t), vmx));
    _mm512_storeu_ps(p + t, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#endif
  for (; t < n; ++t) {
    const float e = p[t] == -kInf ? 0.f : std::exp(p[t] - mx);
    p[t] = e;
    sum += e;
  }
  return sum;
}

struct Rows {
  int64_t R, D;
  std::vector<float> m, l, acc, p;
  Rows(int64_t R_, int64_t D_, int64_t T)
      : R(R_), D(D_), m(R_, -kInf), l(R_, 0.f), acc(R_ * D_, 0.f), p(R_ * T) {}
  // Fold scores p[r * n + t] (t < n; -inf = masked) into the running softmax, then return
  // the probabilities in place (0 for masked) with acc already rescaled.
  void softmax_block(int64_t n) {
    for (int64_t r = 0; r < R; ++r) {
      float* pr = p.data() + r * n;
      const float mx = row_max(pr, n, m[r]);
      if (mx == -kInf) {
        for (int64_t t = 0; t < n; ++t) pr[t] = 0.f;
        continue;
      }
      float corr = std::exp(m[r] - mx);  // exp(-inf) = 0 on the first block
      l[r] *= corr;
      float* a = acc.data() + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
      const float sum = exp_sum(pr, n, mx);
      l[r] += sum;
      m[r] = mx;
    }
  }
  // acc[row] += sum_t p[row * n + t] * v[t * D:] for every row (v: n rows of D floats); the
  // accumulator of 16 channels stays in a register over the tokens
  void add_values(int64_t n, const float* v) { add_values(n, v, p.data(), n); }
  // the same with probabilities P[row * stride + t]
  void add_values(int64_t n, const float* v, const float* P, int64_t stride) {
#if defined(__AVX512F__)
    if (D == 64) return add_values_blocked<4>(n, v, P, stride);
    if (D == 128) return add_values_blocked<8>(n, v, P, stride);
#endif
    for (int64_t row = 0; row < R; ++row) {
      const float* pr = P + row * stride;
      float* a = acc.data() + row * D;
      int64_t d0 = 0;
#if defined(__AVX512F__)
      for (; d0 + 16 <= D; d0 += 16) {
        __m512 x = _mm512_loadu_ps(a + d0);
        for (int64_t t = 0; t < n; ++t) x = _mm512_fmadd_ps(_mm512_set1_ps(pr[t]), _mm512_loadu_ps(v + t * D + d0), x);
        _mm512_storeu_ps(a + d0, x);
      }
#endif
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = d0; d < D; ++d) a[d] += pr[t] * v[t * D + d];
    }
  }
#if defined(__AVX512F__)
  // acc[row] += sum_t p[row * n + t] * value(t) for D = 16 C, value(t, vv) filling vv[C] with token
  // t's value row: RB rows x C vectors of accumulators stay in registers over the tokens (each value
  // row made once per RB rows; RB x C independent FMA chains). Every (row, channel) still sums its
  // tokens in order from acc: the same fp32 result as the loop in add_values.
  template <int C, typename ValueRow>
  void fold_values(int64_t n, const float* P, int64_t stride, ValueRow value) {
    constexpr int RB = C <= 4 ? 4 : 2;  // RB * C <= 16 accumulators
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      const int rb = static_cast<int>(std::min<int64_t>(RB, R - r0));
      __m512 x[RB][C];
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          x[r][c] = r < rb ? _mm512_loadu_ps(acc.data() + (r0 + r) * D + 16 * c) : _mm512_setzero_ps();
      const float* pr = P + r0 * stride;
      for (int64_t t = 0; t < n; ++t) {
        __m512 vv[C];
        value(t, vv);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) {
          if (r >= rb) break;
          const __m512 b = _mm512_set1_ps(pr[r * stride + t]);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) x[r][c] = _mm512_fmadd_ps(b, vv[c], x[r][c]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r)
        if (r < rb)
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc.data() + (r0 + r) * D + 16 * c, x[r][c]);
    }
  }
  // add_values over value rows v [n, D] already in memory
  template <int C>
  void add_values_blocked(int64_t n, const float* v, const float* P, int64_t stride) {
    fold_values<C>(n, P, stride, [&](int64_t t, __m512* vv) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + t * D + 16 * c);
    });
  }
#endif
};

// qsc[row] = q[row] * s and qz[row] = (q[row] * s) . z for one key group (scales s, zeros z [D]).
KVTIER_INLINE void scale_rows(const float* qf, int64_t R, int64_t D, const float* s, const float* z, float* qsc, float* qz) {
  for (int64_t row = 0; row < R; ++row) {  // q * s and (q * s) . z of this key group
    const float* qr = qf + row * D;
    float* qq = qsc + row * D;
    float zz = 0.f;
#pragma omp simd reduction(+ : zz)
    for (int64_t d = 0; d < D; ++d) {
      qq[d] = qr[d] * s[d];
      zz += qq[d] * z[d];
    }
    qz[row] = zz;
  }
}

// Scores of tokens t, t + 16, ... < t1 of 4-bit codes kc (cb bytes each) 16 at a time (head_dim
// 64, AVX-512; none among the sinks): on bf16 dot products where built, else unpacked once into kb.
// Returns the first token left.
KVTIER_INLINE int64_t score16_tokens(const Layout& L, const uint8_t* kc, int64_t cb, int64_t t, int64_t t1, const float* qsc,
                              const float* qz, int64_t R, float* p, int64_t stride) {
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if (L.D == 64) {  // 16 tokens at a time on bf16 dot products (exact codes, q * s as hi + lo)
    for (; t + 16 <= t1; t += 16) {
      if (t < L.s) break;  // a sink among them: one at a time below
      score16_codes_d64(kc + t * cb, qsc, R, qz, p, stride, t);
    }
  }
#endif
  if (L.D == 64) {  // 16 tokens at a time: unpacked once into kb, each row's 16 dot products reduced together
    alignas(64) float kb[16 * 64];
    for (; t + 16 <= t1; t += 16) {
      if (t < L.s) break;  // a sink among them: one at a time below
      for (int64_t i = 0; i < 16; ++i) {
        __m512 a, b, c2, d2;
        unpack32(kc + (t + i) * cb, a, b);
        unpack32(kc + (t + i) * cb + 16, c2, d2);
        _mm512_store_ps(kb + i * 64, a);
        _mm512_store_ps(kb + i * 64 + 16, b);
        _mm512_store_ps(kb + i * 64 + 32, c2);
        _mm512_store_ps(kb + i * 64 + 48, d2);
      }
      score16_d64(kb, qsc, R, qz, p, stride, t);
    }
  }
#endif
  return t;
}

// Scores of one token t: the exact sink row (sk, t < s) against qf, or its 4-bit codes c against
// q * s minus (q * s) . z; kf: a buffer of D floats.
template <typename scalar_t>
KVTIER_INLINE void score_token(const Layout& L, const scalar_t* sk, const uint8_t* kc, int64_t cb, int64_t t,
                        const float* qf, const float* qsc, const float* qz, int64_t R, float* p, int64_t stride,
                        float* kf) {
  const int64_t D = L.D;
  if (t < L.s) {  // exact sink token
    load_row(sk + t * 2 * D, kf, D);
    for (int64_t row = 0; row < R; ++row) {
      const float* qr = qf + row * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qr[d] * kf[d];
      p[row * stride + t] = acc;
    }
    return;
  }
  const uint8_t* c = kc + t * cb;
#if defined(__AVX512F__)
  if (D % 32 == 0) {
    __m512 kv[32];
    for (int64_t j = 0; j < D / 32; ++j) unpack32(c + 16 * j, kv[2 * j], kv[2 * j + 1]);
    for (int64_t row = 0; row < R; ++row) {
      const float* qq = qsc + row * D;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qq), kv[0]);
      for (int64_t j = 1; j < D / 16; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qq + 16 * j), kv[j], acc);
      p[row * stride + t] = _mm512_reduce_add_ps(acc) - qz[row];
    }
    return;
  }
#endif
  for (int64_t j = 0; j < cb; ++j) {
    kf[2 * j] = static_cast<float>(c[j] & 15);
    kf[2 * j + 1] = static_cast<float>(c[j] >> 4);
  }
  for (int64_t row = 0; row < R; ++row) {
    const float* qq = qsc + row * D;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; ++d) acc += qq[d] * kf[d];
    p[row * stride + t] = acc - qz[row];
  }
}

// Scores of one packed block of head h for R pre-scaled query rows qf [R, D]: p[row * stride + t]
// = qf[row] . key(t) for its first n tokens (n = T for a full block; fewer for a cached block read
// in part): per key group, the rows times its scales (scale_rows), then its tokens 16 at a time
// (score16_tokens) and one at a time (score_token).
template <typename scalar_t>
void score_page(const Layout& L, const uint8_t* page, int64_t h, int64_t n, const float* qf, int64_t R, float* p,
                int64_t stride, std::vector<float>& qsc, std::vector<float>& qz, std::vector<float>& kf,
                std::vector<float>& vf) {
  const int64_t T = L.T, D = L.D, nkg = T / L.kg, cb = D / 2;
  const uint16_t* ks = reinterpret_cast<const uint16_t*>(page + L.kscale) + h * nkg * D;
  const uint16_t* kz = reinterpret_cast<const uint16_t*>(page + L.kzero) + h * nkg * D;
  const scalar_t* sk = reinterpret_cast<const scalar_t*>(page + L.sink) + h * L.s * 2 * D;
  const uint8_t* kc = page + L.kcodes + h * T * cb;
  for (int64_t t0 = 0; t0 < n; t0 += L.kg) {
    const int64_t g = t0 / L.kg, t1 = std::min(n, t0 + L.kg);
    halves_to_floats(ks + g * D, kf.data(), D);
    halves_to_floats(kz + g * D, vf.data(), D);
    scale_rows(qf, R, D, kf.data(), vf.data(), qsc.data(), qz.data());
    int64_t t = score16_tokens(L, kc, cb, t0, t1, qsc.data(), qz.data(), R, p, stride);
    for (; t < t1; ++t) score_token(L, sk, kc, cb, t, qf, qsc.data(), qz.data(), R, p, stride, kf.data());
  }
}

// Values of tokens idx[0..nk) (ascending, < n) of one packed block of head h folded into st, with
// probabilities P[row * stride + j] (already rescaled to st's running max).
template <typename scalar_t>
void fold_page(const Layout& L, const uint8_t* page, int64_t h, int64_t n, const int32_t* idx, int64_t nk,
               const float* P, int64_t stride, Rows& st, std::vector<float>& vf) {
  const int64_t T = L.T, D = L.D, nvg = D / L.vg, cb = L.vrow();
  const uint16_t* vs = reinterpret_cast<const uint16_t*>(page + L.vscale) + h * T * nvg;
  const uint16_t* vz = reinterpret_cast<const uint16_t*>(page + L.vzero) + h * T * nvg;
  const scalar_t* sk = reinterpret_cast<const scalar_t*>(page + L.sink) + h * L.s * 2 * D;
  const uint8_t* vc = page + L.vcodes + h * T * cb;
  if (nk == 0) return;
  int64_t vgroup[64];  // value group of each 16 channels (D <= 1024)
  for (int64_t j = 0; j < D / 16 && j < 64; ++j) vgroup[j] = (16 * j) / L.vg;
#if defined(__AVX512F__)
  if (D == 64 && L.vg % 16 == 0) {  // values dequantized in registers, folded into 4 rows at a time
    alignas(64) float sinkv[64];
    float* vsf = vf.data();  // the block's value scales and zeros as fp32 (vf is free on this path)
    float* vzf = vf.data() + T * nvg;
    halves_to_floats(vs, vsf, n * nvg);
    halves_to_floats(vz, vzf, n * nvg);
    st.fold_values<4>(nk, P, stride, [&](int64_t j, __m512* v) {
      const int64_t t = idx[j];
      if (t < L.s) {
        load_row(sk + t * 2 * D + D, sinkv, D);
        for (int c = 0; c < 4; ++c) v[c] = _mm512_load_ps(sinkv + 16 * c);
        return;
      }
      const uint8_t* cc = vc + t * cb;
      if (L.vb == 4) {
        unpack32(cc, v[0], v[1]);
        unpack32(cc + 16, v[2], v[3]);
      } else {
        unpack64_3(cc, v);
      }
      const float* st_ = vsf + t * nvg;
      const float* zt_ = vzf + t * nvg;
      for (int c = 0; c < 4; ++c) {
        const int64_t g = vgroup[c];
        v[c] = _mm512_mul_ps(_mm512_sub_ps(v[c], _mm512_set1_ps(zt_[g])), _mm512_set1_ps(st_[g]));
      }
    });
    return;
  }
#endif
  for (int64_t j = 0; j < nk; ++j) {  // dequantized values of the tokens: vf [nk, D]
    const int64_t t = idx[j];
    float* vt = vf.data() + j * D;
    if (t < L.s) {
      load_row(sk + t * 2 * D + D, vt, D);
      continue;
    }
    const uint8_t* c = vc + t * cb;
#if defined(__AVX512F__)
    if (L.vb == 4 && D % 32 == 0 && L.vg % 16 == 0) {
      const uint16_t* st_ = vs + t * nvg;
      const uint16_t* zt_ = vz + t * nvg;
      for (int64_t j = 0; j < D / 32; ++j) {
        __m512 a, b;
        unpack32(c + 16 * j, a, b);
        const int64_t ga = vgroup[2 * j], gb = vgroup[2 * j + 1];
        const __m512 sa = _mm512_set1_ps(half_to_float(st_[ga])), za = _mm512_set1_ps(half_to_float(zt_[ga]));
        const __m512 sb = _mm512_set1_ps(half_to_float(st_[gb])), zb = _mm512_set1_ps(half_to_float(zt_[gb]));
        _mm512_storeu_ps(vt + 32 * j, _mm512_mul_ps(_mm512_sub_ps(a, za), sa));
        _mm512_storeu_ps(vt + 32 * j + 16, _mm512_mul_ps(_mm512_sub_ps(b, zb), sb));
      }
      continue;
    }
#endif
    for (int64_t d = 0; d < D; ++d) vt[d] = static_cast<float>(code_at(c, d, L.vb, D));
    for (int64_t gg = 0; gg < nvg; ++gg) {
      const float s = half_to_float(vs[t * nvg + gg]), z = half_to_float(vz[t * nvg + gg]);
      for (int64_t d = gg * L.vg; d < (gg + 1) * L.vg; ++d) vt[d] = (vt[d] - z) * s;
    }
  }
  st.add_values(nk, vf.data(), P, stride);
}

// One packed block of head h read by R pre-scaled query rows qf [R, D], dense: its first n tokens
// folded into st (idx: 0, 1, ..., T - 1).
template <typename scalar_t>
void attend_page(const Layout& L, const uint8_t* page, int64_t h, int64_t n, const float* qf, Rows& st,
                 const int32_t* idx, std::vector<float>& qsc, std::vector<float>& qz, std::vector<float>& kf,
                 std::vector<float>& vf) {
  score_page<scalar_t>(L, page, h, n, qf, st.R, st.p.data(), n, qsc, qz, kf, vf);
  st.softmax_block(n);
  fold_page<scalar_t>(L, page, h, n, idx, n, st.p.data(), n, st, vf);
}

// Sparse decode (kvtier.policy.SparsePolicy's select="tokens", method="mass", in
// kvtier.vllm.pages.paged.select_packed): rows of a request with at most max_query new tokens score
// every packed token, then fold the values of only the tokens some row needs: the smallest set of
// factor-of-two weight buckets (relative to the row's largest packed score) whose complement holds
// at most 1 - level of the row's packed softmax mass, plus the last `window` tokens before the new
// ones and the sinks. The kept weights are renormalized (the row's sum is over kept tokens only).
struct Sparse {
  double level;  // 1: dense
  int64_t window, max_query;
  bool applies(int64_t qn) const { return level < 1.0 && qn <= max_query; }
};

// Row of n packed scores s: replaced by e = exp(s - M) (M its max, returned); thr: the weight at
// and above which the row keeps a token (0: every token). Buckets k = min(63, -floor(log2 e)) are
// dropped from the lightest up while their mass stays within (1 - level) of the row's sum: the
// smallest d in 1..64 whose tail f(d) = sum of e < 2^(1 - d) is within budget (f falls with d: a
// binary search of masked sums), keeping e >= 2^(1 - d).
inline float select_row(float* s, int64_t n, double level, float& thr) {
  const float M = row_max(s, n, -kInf), sum = exp_sum(s, n, M);
  auto tail = [&](float below) {  // sum of e < below
    float acc = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 b = _mm512_set1_ps(below);
    __m512 va = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 e = _mm512_loadu_ps(s + i);
      va = _mm512_mask_add_ps(va, _mm512_cmp_ps_mask(e, b, _CMP_LT_OQ), va, e);
    }
    acc = _mm512_reduce_add_ps(va);
#endif
    for (; i < n; ++i) acc += s[i] < below ? s[i] : 0.f;
    return acc;
  };
  const float budget = static_cast<float>((1.0 - level) * sum);
  int lo = 1, hi = 64;  // f(64) = 0: nothing dropped
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (tail(std::ldexp(1.f, 1 - mid)) <= budget)
      hi = mid;
    else
      lo = mid + 1;
  }
  thr = lo <= 63 ? std::ldexp(1.f, 1 - lo) : 0.f;
  return M;
}

// Tokens of one page (n, starting at packed position base) that the rows keep: kept[0..nk) and each
// row's weights compacted into P[row * PS + j]; e: the rows' weights (row stride ntot, page at base).
// Forced: positions >= from, and < sinks. Returns nk; adds the kept weights to l. kept and each row
// of P have 16 entries of slack past n: lanes are compressed in registers and stored whole (a
// compressing store to memory is microcoded on some CPUs).
inline int64_t keep_tokens(const float* e, int64_t ntot, int64_t base, int64_t n, int64_t R, const float* thr,
                           int64_t from, int64_t sinks, int32_t* kept, float* P, int64_t PS, float* l) {
  int64_t nk = 0, t = 0;
#if defined(__AVX512F__)
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (; t + 16 <= n; t += 16) {
    const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(base + t)));
    __mmask16 m = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(from, 1 << 30))));
    m |= _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(sinks)));
    for (int64_t row = 0; row < R; ++row)
      m |= _mm512_cmp_ps_mask(_mm512_loadu_ps(e + row * ntot + base + t), _mm512_set1_ps(thr[row]), _CMP_GE_OQ);
    if (!m) continue;
    const __m512i local = _mm512_sub_epi32(pos, _mm512_set1_epi32(static_cast<int32_t>(base)));
    _mm512_storeu_si512(kept + nk, _mm512_maskz_compress_epi32(m, local));
    for (int64_t row = 0; row < R; ++row)
      _mm512_storeu_ps(P + row * PS + nk, _mm512_maskz_compress_ps(m, _mm512_loadu_ps(e + row * ntot + base + t)));
    nk += __builtin_popcount(m);
  }
#endif
  for (; t < n; ++t) {
    const int64_t pos = base + t;
    bool keep = pos >= from || pos < sinks;
    for (int64_t row = 0; row < R && !keep; ++row) keep = e[row * ntot + pos] >= thr[row];
    if (!keep) continue;
    for (int64_t row = 0; row < R; ++row) P[row * PS + nk] = e[row * ntot + pos];
    kept[nk++] = static_cast<int32_t>(t);
  }
  for (int64_t row = 0; row < R; ++row) {
    const float* pr = P + row * PS;
    float acc = 0.f;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 va = _mm512_setzero_ps();
    for (; j + 16 <= nk; j += 16) va = _mm512_add_ps(va, _mm512_loadu_ps(pr + j));
    if (j < nk) va = _mm512_add_ps(va, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (nk - j)) - 1), pr + j));
    acc = _mm512_reduce_add_ps(va);
    j = nk;
#endif
    for (; j < nk; ++j) acc += pr[j];
    l[row] += acc;
  }
  return nk;
}

// --- attend: the tasks of one call (kvtier.vllm.pages.paged.attend_request) ---

// The tensors of one attend call as pointers and strides (rows of q, key, value, out: [tokens, heads, D]).
template <typename scalar_t, typename out_t>
struct Call {
  const Layout& L;
  int64_t H, D, T, G;
  const scalar_t *qp, *kp, *vp, *sp;
  const uint8_t* pg;
  const int64_t *rq, *ps, *pid;
  out_t* op;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1, os0, os1;
  int64_t side_row;  // one token of a side slot: [2, H, D]
  float sc;
};

// Tasks: (request, kv head, split of its packed blocks). With fewer (request, head) pairs than
// twice the threads, a request's blocks are split so every thread has work; each split keeps its
// own softmax state (the last one also takes the exact rows) and the splits merge at the end.
// A request with sparse selection is never split: its selection reads every packed score.
struct Splits {
  std::vector<int64_t> nsplit, first, rows_at;  // per request: splits, first task, first merge row
};

Splits plan_splits(const int64_t* rq, const int64_t* ps, int64_t nreq, int64_t H, int64_t G, const Sparse& sel) {
  const int64_t threads = at::get_num_threads();
  const int64_t want = nreq * H >= 2 * threads ? 1 : (2 * threads + nreq * H - 1) / (nreq * H);
  Splits s{std::vector<int64_t>(nreq), std::vector<int64_t>(nreq + 1, 0), std::vector<int64_t>(nreq + 1, 0)};
  for (int64_t r = 0; r < nreq; ++r) {
    const bool sparse_r = sel.applies(rq[6 * r + 1] - rq[6 * r]);
    s.nsplit[r] = sparse_r ? 1 : std::max<int64_t>(1, std::min<int64_t>(want, ps[r + 1] - ps[r]));
    s.first[r + 1] = s.first[r] + s.nsplit[r] * H;
    s.rows_at[r + 1] = s.rows_at[r] + (s.nsplit[r] > 1 ? s.nsplit[r] * H * (rq[6 * r + 1] - rq[6 * r]) * G : 0);
  }
  return s;
}

// One task's buffers (reused across the tasks of a thread).
struct TaskBuffers {
  std::vector<float> qf, qsc, qz, kf, vf, big, thr, comp;
  std::vector<int32_t> iota, kept;
  TaskBuffers(int64_t D, int64_t T) : kf(D), vf(T * D), iota(T), kept(T + 16) {
    for (int64_t t = 0; t < T; ++t) iota[t] = t;
  }
};

// One request's (row range of qn queries) entry of reqs: qs, qe, side slot, side rows, head block, head rows.
struct Request {
  int64_t q0, qn, slot, nside, hblock, hrows;
};

// _sparse_packed (kvtier.vllm.pages.paged): every packed score of head h first, each row's threshold
// (select_row), then the values of the tokens some row keeps (keep_tokens, fold_page). Adds the
// (row, token) pairs valued and the tokens scored.
template <typename scalar_t, typename out_t>
void sparse_packed(const Call<scalar_t, out_t>& C, int64_t r, int64_t h, const Request& e, const Sparse& sel,
                   int64_t R, Rows& st, TaskBuffers& b, std::atomic<int64_t>& valued, std::atomic<int64_t>& scored) {
  const Layout& L = C.L;
  const int64_t T = C.T, nb = C.ps[r + 1] - C.ps[r];
  const int64_t ntot = nb * T + e.hrows, ctx = ntot + e.nside;
  auto page_of = [&](int64_t j) { return C.pg + (j < nb ? C.pid[C.ps[r] + j] : e.hblock) * L.page; };
  const int64_t npages = nb + (e.hrows > 0);
  int64_t nvalued = 0;
  b.big.resize(R * std::max<int64_t>(ntot, 1));
  b.thr.resize(R);
  b.comp.resize(R * (T + 16));
  for (int64_t j = 0; j < npages; ++j)
    score_page<scalar_t>(L, page_of(j), h, j < nb ? T : e.hrows, b.qf.data(), R, b.big.data() + j * T, ntot, b.qsc,
                         b.qz, b.kf, b.vf);
  for (int64_t row = 0; row < R && ntot > 0; ++row)
    st.m[row] = select_row(b.big.data() + row * ntot, ntot, sel.level, b.thr[row]);
  for (int64_t j = 0; j < npages; ++j) {
    const int64_t n = j < nb ? T : e.hrows, base = j * T;
    const int64_t nk = keep_tokens(b.big.data(), ntot, base, n, R, b.thr.data(), ctx - sel.window, L.s, b.kept.data(),
                                   b.comp.data(), T + 16, st.l.data());
    if (nk == n)  // every token: the weights in place
      fold_page<scalar_t>(L, page_of(j), h, n, b.iota.data(), n, b.big.data() + base, ntot, st, b.vf);
    else
      fold_page<scalar_t>(L, page_of(j), h, n, b.kept.data(), nk, b.comp.data(), T + 16, st, b.vf);
    nvalued += nk;
  }
  valued += nvalued;  // once per task
  scored += ntot;
}

// The dense packed part of a task: this split's packed blocks, then (last split) the first rows of a
// cached block read in part, each folded into st by attend_page.
template <typename scalar_t, typename out_t>
void dense_packed(const Call<scalar_t, out_t>& C, int64_t r, int64_t h, const Request& e, int64_t split, int64_t ns,
                  Rows& st, TaskBuffers& b) {
  const Layout& L = C.L;
  const int64_t nb = C.ps[r + 1] - C.ps[r];
  for (int64_t bi = C.ps[r] + split * nb / ns; bi < C.ps[r] + (split + 1) * nb / ns; ++bi)
    attend_page<scalar_t>(L, C.pg + C.pid[bi] * L.page, h, C.T, b.qf.data(), st, b.iota.data(), b.qsc, b.qz, b.kf,
                          b.vf);
  if (split == ns - 1 && e.hrows > 0)
    attend_page<scalar_t>(L, C.pg + e.hblock * L.page, h, e.hrows, b.qf.data(), st, b.iota.data(), b.qsc, b.qz, b.kf,
                          b.vf);
}

// The exact rows of head h (last split only): the side rows, then the new tokens; causal over the
// last qn, T rows at a time through st's online softmax.
template <typename scalar_t, typename out_t>
void exact_rows(const Call<scalar_t, out_t>& C, int64_t h, const Request& e, int64_t R, Rows& st, TaskBuffers& b) {
  const int64_t T = C.T, D = C.D, G = C.G, H = C.H, qn = e.qn, nside = e.nside;
  const int64_t ne = nside + qn;
  auto krow = [&](int64_t j) {
    return j < nside ? C.sp + (e.slot * T + j) * C.side_row + h * D : C.kp + (e.q0 + j - nside) * C.ks0 + h * C.ks1;
  };
  auto vrow = [&](int64_t j) {
    return j < nside ? C.sp + (e.slot * T + j) * C.side_row + H * D + h * D
                     : C.vp + (e.q0 + j - nside) * C.vs0 + h * C.vs1;
  };
  for (int64_t t0 = 0; t0 < ne; t0 += T) {
    const int64_t n = std::min(T, ne - t0);
    int64_t t = 0;
#if defined(__AVX512F__)
    if (D == 64) {  // 16 rows at a time while every query row sees all of them
      alignas(64) float kb[16 * 64];
      for (; t + 16 <= n && t0 + t + 16 <= ne - qn + 1; t += 16) {
        for (int64_t i = 0; i < 16; ++i) load_row(krow(t0 + t + i), kb + i * 64, D);
        score16_d64(kb, b.qf.data(), R, nullptr, st.p.data(), n, t);
      }
    }
#endif
    for (; t < n; ++t) {
      load_row(krow(t0 + t), b.kf.data(), D);
      for (int64_t row = 0; row < R; ++row) {
        const int64_t limit = ne - qn + row / G + 1;  // exact rows visible to this query
        float acc = -kInf;
        if (t0 + t < limit) {
          const float* qr = b.qf.data() + row * D;
          acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qr[d] * b.kf[d];
        }
        st.p[row * n + t] = acc;
      }
    }
    st.softmax_block(n);
    for (int64_t t = 0; t < n; ++t) load_row(vrow(t0 + t), b.vf.data() + t * D, D);
    st.add_values(n, b.vf.data());
  }
}

// merge (kvtier.attention.partials) of the split requests: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)
template <typename scalar_t, typename out_t>
void merge_splits(const Call<scalar_t, out_t>& C, const Splits& S, int64_t nreq, const std::vector<float>& pm,
                  const std::vector<float>& pl, const std::vector<float>& pacc) {
  const int64_t H = C.H, D = C.D, G = C.G;
  std::vector<float> acc(D);
  for (int64_t r = 0; r < nreq; ++r) {
    const int64_t ns = S.nsplit[r], q0 = C.rq[6 * r], R = (C.rq[6 * r + 1] - q0) * G;
    if (ns == 1) continue;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t row = 0; row < R; ++row) {
        float M = -kInf;
        for (int64_t sp_ = 0; sp_ < ns; ++sp_) M = std::max(M, pm[S.rows_at[r] + (sp_ * H + h) * R + row]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float l = 0.f;
        for (int64_t sp_ = 0; sp_ < ns && M > -kInf; ++sp_) {
          const int64_t i = S.rows_at[r] + (sp_ * H + h) * R + row;
          if (pm[i] == -kInf) continue;
          const float w = std::exp(pm[i] - M);
          l += pl[i] * w;
          const float* a = pacc.data() + i * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * w;
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
        store_row(acc.data(), C.op + (q0 + row / G) * C.os0 + (h * G + row % G) * C.os1, D, inv);
      }
    }
  }
}

// _attend_request (kvtier.vllm.pages.paged) for every (request, KV head): the packed part (sparse_packed or
// dense_packed), the exact rows, then the rows normalized into out (or a split's state kept for merge_splits).
template <typename scalar_t, typename out_t>
void attend_impl(const Layout& L, torch::Tensor q, torch::Tensor key, torch::Tensor value, torch::Tensor side,
                 torch::Tensor pages, torch::Tensor reqs, torch::Tensor pstart, torch::Tensor pids, torch::Tensor out,
                 double scale, const Sparse& sel, int64_t* counts) {
  const int64_t H = L.H, D = L.D, T = L.T, G = q.size(1) / H;
  const int64_t nreq = reqs.size(0);
  const Call<scalar_t, out_t> C{
      L, H, D, T, G,
      q.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), side.data_ptr<scalar_t>(),
      pages.data_ptr<uint8_t>(), reqs.data_ptr<int64_t>(), pstart.data_ptr<int64_t>(), pids.data_ptr<int64_t>(),
      out.data_ptr<out_t>(),
      q.stride(0), q.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
      out.stride(0), out.stride(1),
      2 * H * D, static_cast<float>(scale)};
  const Splits S = plan_splits(C.rq, C.ps, nreq, H, G, sel);
  std::atomic<int64_t> valued{0}, scored{0};
  // partial softmax states of split requests: m, l [rows], acc [rows, D]
  std::vector<float> pm(S.rows_at[nreq]), pl(S.rows_at[nreq]), pacc(S.rows_at[nreq] * D);

  at::parallel_for(0, S.first[nreq], 1, [&](int64_t begin, int64_t end) {
    TaskBuffers b(D, T);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = std::upper_bound(S.first.begin(), S.first.end(), task) - S.first.begin() - 1;
      const int64_t local = task - S.first[r], h = local % H, split = local / H, ns = S.nsplit[r];
      const int64_t* x = C.rq + 6 * r;
      const Request e{x[0], x[1] - x[0], x[2], x[3], x[4], x[5]};
      if (e.qn == 0) continue;
      const int64_t R = e.qn * G;  // row = i * G + g
      Rows st(R, D, T);
      b.qf.resize(R * D);
      b.qsc.assign(R * D, 0.f);
      b.qz.assign(R, 0.f);
      for (int64_t row = 0; row < R; ++row)
        load_row(C.qp + (e.q0 + row / G) * C.qs0 + (h * G + row % G) * C.qs1, b.qf.data() + row * D, D, C.sc);
      if (sel.applies(e.qn))  // sparse: every packed score first, then the values of the kept tokens
        sparse_packed(C, r, h, e, sel, R, st, b, valued, scored);
      else
        dense_packed(C, r, h, e, split, ns, st, b);
      if (split == ns - 1) exact_rows(C, h, e, R, st, b);
      if (ns > 1) {  // keep this split's state for the merge
        const int64_t base = S.rows_at[r] + (split * H + h) * R;
        std::copy(st.m.begin(), st.m.end(), pm.begin() + base);
        std::copy(st.l.begin(), st.l.end(), pl.begin() + base);
        std::copy(st.acc.begin(), st.acc.end(), pacc.begin() + base * D);
        continue;
      }
      for (int64_t row = 0; row < R; ++row) {
        const float inv = st.l[row] > 0.f ? 1.f / st.l[row] : 0.f;
        store_row(st.acc.data() + row * D, C.op + (e.q0 + row / G) * C.os0 + (h * G + row % G) * C.os1, D, inv);
      }
    }
  });
  merge_splits(C, S, nreq, pm, pl, pacc);
  if (counts) {
    counts[0] += valued.load();
    counts[1] += scored.load();
  }
}

void check_requests(const torch::Tensor& reqs, const torch::Tensor& pstart, const torch::Tensor& pids, int64_t rows,
                    int64_t slots, int64_t T, int64_t npages) {
  const int64_t R = reqs.size(0), Np = pids.size(0);
  TORCH_CHECK(pstart.size(0) == R + 1, "pstart: ", R + 1, " entries for ", R, " requests, got ", pstart.size(0));
  const int64_t* rq = reqs.data_ptr<int64_t>();
  const int64_t* ps = pstart.data_ptr<int64_t>();
  TORCH_CHECK(ps[0] >= 0 && ps[R] <= Np, "pstart: pages [", ps[0], ", ", ps[R], ") outside the ", Np, " pids");
  for (int64_t r = 0; r < R; ++r) {
    const int64_t* e = rq + 6 * r;  // qs, qe, side slot, side rows, head block, head rows
    TORCH_CHECK(0 <= e[0] && e[0] <= e[1] && e[1] <= rows, "reqs[", r, "]: new tokens [", e[0], ", ", e[1],
                ") outside the ", rows, " rows of q, key, value and out");
    TORCH_CHECK(ps[r] <= ps[r + 1], "pstart: decreasing at request ", r);
    TORCH_CHECK(0 <= e[3] && e[3] <= T && (e[3] == 0 || (0 <= e[2] && e[2] < slots)), "reqs[", r, "]: side slot ",
                e[2], " with ", e[3], " rows is outside ", slots, " slots of ", T, " rows");
    TORCH_CHECK(0 <= e[5] && e[5] <= T && (e[5] == 0 || (0 <= e[4] && e[4] < npages)), "reqs[", r, "]: head block ",
                e[4], " with ", e[5], " rows is outside ", npages, " pages of ", T, " tokens");
  }
  check_pages(pids, ps[0], ps[R], npages);
}

}  // namespace

void vllm_paged_attend(
    torch::Tensor q,          // [N, Hq, D] model dtype (rows contiguous), not yet scaled
    torch::Tensor key,        // [N, H, D] this step's new keys
    torch::Tensor value,      // [N, H, D]
    torch::Tensor side,       // [slots, T, 2, H, D] contiguous side buffer of this layer
    torch::Tensor pages,      // uint8 [B, page]
    torch::Tensor reqs,       // int64 [R, 6]: qs, qe, side slot, side rows, head block, head rows
    torch::Tensor pstart,     // int64 [R+1]
    torch::Tensor pids,       // int64 [Np]
    torch::Tensor out,        // [N, Hq, D] fp32 or the model dtype (rows contiguous)
    double scale,
    std::vector<int64_t> lay,  // H, D, T, kg, vg, s, page, kscale, kzero, vscale, vzero, sink, kcodes, vcodes, vb
    double level,              // sparse decode (struct Sparse): 1 = dense
    int64_t window,
    int64_t max_query,
    torch::Tensor counts       // int64 [2] += (tokens valued, tokens scored) of sparse rows, or empty
) {
  const Layout L = read_layout(lay);
  const auto dt = q.scalar_type();
  check_rows(q, "q", dt);
  check_rows(key, "key", dt);
  check_rows(value, "value", dt);
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && (out.scalar_type() == dt || out.scalar_type() == torch::kFloat32),
              "out: [N, Hq, D] rows contiguous, fp32 or the model dtype");
  TORCH_CHECK(side.is_contiguous() && side.scalar_type() == dt && side.dim() == 5, "side: contiguous [slots, T, 2, H, D]");
  TORCH_CHECK(pages.is_contiguous() && pages.size(1) == L.page, "pages: contiguous [B, page]");
  TORCH_CHECK(L.D % 2 == 0 && L.D <= 512 && q.size(2) == L.D && q.size(1) % L.H == 0, "head_dim / heads");
  check_index(reqs, "reqs", 6);
  check_index(pstart, "pstart", 0);
  check_index(pids, "pids", 0);
  TORCH_CHECK(key.size(1) == L.H && value.size(1) == L.H && key.size(2) == L.D && value.size(2) == L.D,
              "key, value: [N, H, D] of the layout's heads and head_dim");
  TORCH_CHECK(out.size(1) == q.size(1) && out.size(2) == L.D, "out: [N, Hq, D] as q");
  TORCH_CHECK(side.size(1) == L.T && side.size(2) == 2 && side.size(3) == L.H && side.size(4) == L.D,
              "side: [slots, T, 2, H, D] of the layout");
  check_requests(reqs, pstart, pids, std::min({q.size(0), key.size(0), value.size(0), out.size(0)}), side.size(0), L.T,
                 pages.size(0));
  TORCH_CHECK(level > 0.0 && level <= 1.0 && window >= 0 && max_query >= 1, "sparse: level in (0, 1], window >= 0");
  TORCH_CHECK(counts.numel() == 0 || (counts.scalar_type() == torch::kInt64 && counts.numel() == 2 && counts.is_contiguous()),
              "counts: empty or contiguous int64 [2]");
  const Sparse sel{level, window, max_query};
  int64_t* cnt = counts.numel() ? counts.data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "vllm_paged_attend", [&] {
    if (out.scalar_type() == torch::kFloat32)
      attend_impl<scalar_t, float>(L, q, key, value, side, pages, reqs, pstart, pids, out, scale, sel, cnt);
    else
      attend_impl<scalar_t, scalar_t>(L, q, key, value, side, pages, reqs, pstart, pids, out, scale, sel, cnt);
  });
}
