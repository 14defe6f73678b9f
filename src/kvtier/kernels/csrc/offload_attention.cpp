// offload_attention: two-level block selection over 1-bit key sketches and exact attention over
// the selected offloaded blocks read where they lie (no gather), built by
// kvtier/kernels/offload_cpu.py (which documents the arguments and names the torch references).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "numeric.h"

namespace {

// n values of storage dtype `dt` (0 fp16, 1 bf16, 2 fp32) at p -> floats.
inline void to_float(const void* p, int dt, int64_t n, float* __restrict out) {
  if (dt == 2) {
    std::memcpy(out, p, n * sizeof(float));
  } else if (dt == 1) {
    bf16s_to_floats(static_cast<const uint16_t*>(p), out, n);
  } else {
    halves_to_floats8(static_cast<const uint16_t*>(p), out, n);
  }
}

#if defined(__AVX512F__)
// The 16 validity bits of tokens t0 .. t0 + 15 (t0 a multiple of 8).
inline __mmask16 bits16(const uint8_t* bits, int64_t t0) {
  return __mmask16(uint16_t(bits[t0 >> 3]) | uint16_t(bits[(t0 >> 3) + 1]) << 8);
}
#endif

#if defined(__AVX512F__)
// The lanes of w[0..3] (64 channels) whose bit is set in bm, summed per lane: w . bits = its hsum.
inline __m512 masked_sum(const __m512 (&w)[4], uint64_t bm) {
  __m512 acc = _mm512_maskz_mov_ps(__mmask16(bm), w[0]);
  acc = _mm512_mask_add_ps(acc, __mmask16(bm >> 16), acc, w[1]);
  acc = _mm512_mask_add_ps(acc, __mmask16(bm >> 32), acc, w[2]);
  return _mm512_mask_add_ps(acc, __mmask16(bm >> 48), acc, w[3]);
}

// Sketch estimates of one block's T tokens for G rows (at most 4) of a 64-wide head:
// x[g * T + t] = bias[g] + alpha[t] * (2 w_g . bits_t - wsum[g]) (-inf for invalid tokens), where
// w_g . bits_t is the sum of w_g over the channels whose sign bit is set (masked adds, no unpacking;
// a token's 64 bits are loaded once for the G rows; 16 tokens reduced at once by hsum16).
template <int G>
inline void sketch64(const float* w, const float* bias, const float* wsum, const uint8_t* codes, const float* alpha,
                     const uint8_t* okb, int64_t T, float* x) {
  __m512 wv[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) wv[g][c] = _mm512_loadu_ps(w + g * 64 + 16 * c);
  alignas(64) __m512 part[G][16];
  const int64_t T16 = T / 16 * 16;
  for (int64_t t0 = 0; t0 < T16; t0 += 16) {
    for (int u = 0; u < 16; ++u) {
      uint64_t bm;
      std::memcpy(&bm, codes + (t0 + u) * 8, 8);
      for (int g = 0; g < G; ++g) part[g][hslot(u)] = masked_sum(wv[g], bm);
    }
    const __m512 a = _mm512_loadu_ps(alpha + t0);
    const __mmask16 ok = bits16(okb, t0);
    for (int g = 0; g < G; ++g) {
      const __m512 dot = hsum16(part[g]);
      const __m512 est = _mm512_fmadd_ps(a, _mm512_sub_ps(_mm512_add_ps(dot, dot), _mm512_set1_ps(wsum[g])),
                                         _mm512_set1_ps(bias[g]));
      _mm512_storeu_ps(x + g * T + t0, _mm512_mask_blend_ps(ok, _mm512_set1_ps(NEG), est));
    }
  }
  for (int64_t t = T16; t < T; ++t) {
    uint64_t bm;
    std::memcpy(&bm, codes + t * 8, 8);
    for (int g = 0; g < G; ++g) {
      const float dot = _mm512_reduce_add_ps(masked_sum(wv[g], bm));
      x[g * T + t] = bit(okb, t) ? bias[g] + alpha[t] * (2.f * dot - wsum[g]) : NEG;
    }
  }
}
#endif

// Block i's per-channel sketch scale (uint8 codes of smax) and mean (int8 codes of mmax) -> floats.
inline void decode_block(const uint8_t* ks, const int8_t* km, const uint16_t* sm, const uint16_t* mm, int64_t i,
                         int64_t D, float* __restrict scale, float* __restrict mean) {
  const float fs = half_to_float(sm[i]) / 255.f, fm = half_to_float(mm[i]) / 127.f;
  const uint8_t* s = ks + i * D;
  const int8_t* m = km + i * D;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) {
    scale[d] = float(s[d]) * fs;
    mean[d] = float(m[d]) * fm;
  }
}

inline float logaddexp(float a, float b) {
  if (a == NEG) return b;
  if (b == NEG) return a;
  const float m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

}  // namespace

namespace {

// --- offload_select (kvtier.attention.offloaded.select_two_level_torch), one (batch, KV head) at a time ---

// The sketch of one call: per block j of (batch, head) bh, index bh * n + j; sizes B, H, R rows, D
// channels (Dp padded to the sign bytes), n blocks of T tokens (P sign bytes each, TB valid bytes).
struct Sketch {
  const uint8_t* sg;  // sign bits [B, H, n, T, P]
  const uint8_t* ks;  // per-channel scale codes [B, H, n, D]
  const int8_t* km;   // per-channel mean codes [B, H, n, D]
  const uint8_t* al;  // per-token alpha codes [B, H, n, T]
  const uint16_t *am, *sm, *mm;  // fp16 amax, smax, mmax [B, H, n]
  const uint8_t* ok;  // valid bits [B, n, TB]
  int64_t H, R, D, Dp, n, T, P, TB;
};

// One task's buffers.
struct SelectBuffers {
  std::vector<float> ub, sbuf, mbuf, w, bias, wsum, tot, suf, bits, abuf, x, bmax;
  std::vector<int64_t> order, cnt, rank_order;
  explicit SelectBuffers(const Sketch& S)
      : ub(S.R * S.n), sbuf(S.D), mbuf(S.D), w(S.R * S.Dp, 0.f), bias(S.R), wsum(S.R), tot(S.R),
        suf(S.R * (S.n + 1)), bits(S.T * S.Dp), abuf(S.T), x(S.R * S.T), bmax(S.n), order(S.n), cnt(S.n),
        rank_order(S.n) {}
};

// 1. coarse_bounds: an upper bound ub[r * n + j] of each block's sketch log-sum-exp, from resident
//    per-block data: q . mean + amax * sum_c |q_c scale_c| + log(valid tokens); cnt[j]: valid tokens.
void coarse_bounds(const Sketch& S, int64_t bh, const float* qb, SelectBuffers& u) {
  const int64_t b = bh / S.H, n = S.n, R = S.R, D = S.D;
  for (int64_t j = 0; j < n; ++j) {
    int64_t c = 0;
    const uint8_t* okb = S.ok + (b * n + j) * S.TB;
    for (int64_t t = 0; t < S.TB; ++t) c += std::popcount(unsigned(okb[t]));
    u.cnt[j] = c;
    decode_block(S.ks, S.km, S.sm, S.mm, bh * n + j, D, u.sbuf.data(), u.mbuf.data());
    const float a = half_to_float(S.am[bh * n + j]);
    for (int64_t r = 0; r < R; ++r) {
      float dm = 0.f, da = 0.f;
#pragma omp simd reduction(+ : dm, da)
      for (int64_t d = 0; d < D; ++d) {
        dm += qb[r * D + d] * u.mbuf[d];
        da += std::fabs(qb[r * D + d] * u.sbuf[d]);
      }
      u.ub[r * n + j] = c ? dm + a * da + std::log(float(c)) : NEG;
    }
  }
}

// 2. The walk's order: blocks by descending bound (max over rows, ties by index), and each row's
//    suffix log-sum-exp of the bounds in that order (suf[r * (n + 1) + p]: of positions >= p).
void walk_order(const Sketch& S, SelectBuffers& u) {
  const int64_t n = S.n, R = S.R;
  for (int64_t j = 0; j < n; ++j) {
    float mx = NEG;
    for (int64_t r = 0; r < R; ++r) mx = std::max(mx, u.ub[r * n + j]);
    u.bmax[j] = mx;
  }
  std::iota(u.order.begin(), u.order.end(), 0);
  std::stable_sort(u.order.begin(), u.order.end(), [&](int64_t a, int64_t c) { return u.bmax[a] > u.bmax[c]; });
  for (int64_t r = 0; r < R; ++r) {
    float* s = u.suf.data() + r * (n + 1);
    s[n] = NEG;
    for (int64_t p = n - 1; p >= 0; --p) s[p] = logaddexp(s[p + 1], u.ub[r * n + u.order[p]]);
  }
}

// token_scores (kvtier.offload.sketch) of block j: x[r * T + t] = q . mean + alpha_t (2 w . bits_t - w . 1),
// w = q * scale (-inf for invalid tokens).
template <int DC>
void sketch_scores(const Sketch& S, int64_t bh, int64_t j, const float* qb, SelectBuffers& u) {
  const int64_t b = bh / S.H, n = S.n, R = S.R, D = S.D, T = S.T, P = S.P, Dp = S.Dp;
  decode_block(S.ks, S.km, S.sm, S.mm, bh * n + j, D, u.sbuf.data(), u.mbuf.data());
  {
    const float f = half_to_float(S.am[bh * n + j]) / 255.f;
    const uint8_t* ab = S.al + (bh * n + j) * T;
    for (int64_t t = 0; t < T; ++t) u.abuf[t] = float(ab[t]) * f;
  }
  const uint8_t* codes = S.sg + (bh * n + j) * T * P;
#if defined(__AVX512F__)
  constexpr bool masked = DC == 64;  // a token's 64 sign bits are one AVX-512 mask word
#else
  constexpr bool masked = false;
#endif
  if constexpr (!masked)
    for (int64_t t = 0; t < T * P; ++t) std::memcpy(u.bits.data() + 8 * t, kBits.v[codes[t]], 8 * sizeof(float));
  const uint8_t* okb = S.ok + (b * n + j) * S.TB;
  for (int64_t r = 0; r < R; ++r) {
    float* wr = u.w.data() + r * Dp;
    float dm = 0.f, ws = 0.f;
#pragma omp simd reduction(+ : dm, ws)
    for (int64_t d = 0; d < D; ++d) {
      wr[d] = qb[r * D + d] * u.sbuf[d];
      dm += qb[r * D + d] * u.mbuf[d];
      ws += wr[d];
    }
    u.bias[r] = dm;
    u.wsum[r] = ws;
  }
#if defined(__AVX512F__)
  if constexpr (masked) {
    // rows in groups of up to 4 sharing each token's sign masks
    const float *w = u.w.data(), *bias = u.bias.data(), *wsum = u.wsum.data(), *abuf = u.abuf.data();
    float* x = u.x.data();
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      switch (std::min<int64_t>(4, R - r0)) {
        case 4: sketch64<4>(w + r0 * 64, bias + r0, wsum + r0, codes, abuf, okb, T, x + r0 * T); break;
        case 3: sketch64<3>(w + r0 * 64, bias + r0, wsum + r0, codes, abuf, okb, T, x + r0 * T); break;
        case 2: sketch64<2>(w + r0 * 64, bias + r0, wsum + r0, codes, abuf, okb, T, x + r0 * T); break;
        default: sketch64<1>(w + r0 * 64, bias + r0, wsum + r0, codes, abuf, okb, T, x + r0 * T);
      }
    }
  } else
#endif
  {
    for (int64_t r = 0; r < R; ++r) {
      const float* wr = u.w.data() + r * Dp;
      float* xr = u.x.data() + r * T;
      for (int64_t t = 0; t < T; ++t) {
        const float* bt = u.bits.data() + t * Dp;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += wr[d] * bt[d];
        xr[t] = bit(okb, t) ? u.bias[r] + u.abuf[t] * (2.f * dot - u.wsum[r]) : NEG;
      }
    }
  }
}

// block_lse (kvtier.offload.sketch) of block j from its token scores x: lo[r * n + j] per row, added into tot[r].
void block_lse(const Sketch& S, int64_t j, float* lo, SelectBuffers& u) {
  const int64_t n = S.n, T = S.T;
  for (int64_t r = 0; r < S.R; ++r) {
    const float* xr = u.x.data() + r * T;
    float m = NEG;
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < T; ++t) m = std::max(m, xr[t]);
    float s = 0.f;
    if (m != NEG) {
#pragma omp simd reduction(+ : s)
      for (int64_t t = 0; t < T; ++t) s += fexp(xr[t] - m);
    }
    const float v = m == NEG ? NEG : m + std::log(s);
    lo[r * n + j] = v;
    u.tot[r] = logaddexp(u.tot[r], v);
  }
}

// 3. keep_blocks, per row: keep scored blocks by descending estimate while the resident mass plus the
//    kept blocks cover less than `mass` of the estimated total; caps; forced blocks (from ff[r]).
void keep_blocks(const Sketch& S, const float* lo, const float* lr, const int64_t* ff, double mass, int64_t min_blocks,
                 int64_t max_blocks, bool* kp, SelectBuffers& u) {
  const int64_t n = S.n;
  for (int64_t r = 0; r < S.R; ++r) {
    const float* lv = lo + r * n;
    bool* kr = kp + r * n;
    std::iota(u.rank_order.begin(), u.rank_order.end(), 0);
    std::stable_sort(u.rank_order.begin(), u.rank_order.end(), [&](int64_t a, int64_t c) { return lv[a] > lv[c]; });
    const float total_raw = u.tot[r];
    const float total = std::isfinite(total_raw) ? total_raw : 0.f;
    float covered = std::exp(lr[r] - total);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t j = u.rank_order[k];
      if (lv[j] == NEG) break;
      bool on = mass <= 0 || covered < mass;
      if (max_blocks > 0 && k >= max_blocks) on = false;
      if (k < min_blocks) on = true;
      kr[j] = on;
      covered += std::exp(lv[j] - total);
    }
    for (int64_t j = std::max<int64_t>(0, ff[r]); j < n; ++j) kr[j] = kr[j] || u.cnt[j] > 0;
  }
}

// Coarse bound, walk, sketch scores and the mass rule; see offload_cpu.offload_select. DC: the
// head dim when known at compile time (loops unroll into SIMD registers), 0 otherwise.
template <int DC>
std::vector<torch::Tensor> select_impl(torch::Tensor qr, torch::Tensor signs, torch::Tensor scale,
                                          torch::Tensor mean, torch::Tensor alpha, torch::Tensor amax,
                                          torch::Tensor smax, torch::Tensor mmax, torch::Tensor valid,
                                          torch::Tensor lse_res, torch::Tensor forced_from, double mass,
                                          int64_t min_blocks, int64_t max_blocks, double tol) {
  TORCH_CHECK(qr.dtype() == torch::kFloat32 && qr.is_contiguous(), "rows: contiguous float32");
  TORCH_CHECK(scale.dtype() == torch::kUInt8 && mean.dtype() == torch::kInt8 && alpha.dtype() == torch::kUInt8,
              "scale, mean, alpha: uint8, int8, uint8 codes");
  TORCH_CHECK(amax.dtype() == torch::kFloat16 && smax.dtype() == torch::kFloat16 && mmax.dtype() == torch::kFloat16,
              "amax, smax, mmax: float16");
  TORCH_CHECK(valid.dtype() == torch::kUInt8, "valid: packed uint8 bits");
  const int64_t B = qr.size(0), H = qr.size(1), R = qr.size(2), D = DC > 0 ? DC : qr.size(3);
  const int64_t n = signs.size(2), T = signs.size(3), P = signs.size(4), Dp = DC > 0 ? (DC + 7) / 8 * 8 : 8 * P;
  TORCH_CHECK(Dp >= D, "signs do not cover head_dim");
  auto keep = torch::zeros({B, H, R, n}, qr.options().dtype(torch::kBool));
  auto lse = torch::full({B, H, R, n}, NEG, qr.options());
  auto scored = torch::zeros({B * H}, qr.options().dtype(torch::kLong));
  const Sketch S{signs.data_ptr<uint8_t>(),
                 scale.data_ptr<uint8_t>(),
                 mean.data_ptr<int8_t>(),
                 alpha.data_ptr<uint8_t>(),
                 reinterpret_cast<const uint16_t*>(amax.data_ptr<at::Half>()),
                 reinterpret_cast<const uint16_t*>(smax.data_ptr<at::Half>()),
                 reinterpret_cast<const uint16_t*>(mmax.data_ptr<at::Half>()),
                 valid.data_ptr<uint8_t>(),
                 H, R, D, Dp, n, T, P, (T + 7) / 8};
  const float* q = qr.data_ptr<float>();
  const float* lr = lse_res.data_ptr<float>();
  const int64_t* ff = forced_from.data_ptr<int64_t>();
  bool* kp = keep.data_ptr<bool>();
  float* lo = lse.data_ptr<float>();
  int64_t* sc = scored.data_ptr<int64_t>();
  const float log_tol = tol > 0 ? float(std::log(tol)) : NEG;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    SelectBuffers u(S);
    for (int64_t bh = begin; bh < end; ++bh) {
      const float* qb = q + bh * R * D;
      coarse_bounds(S, bh, qb, u);
      // 2. walk blocks by descending bound; stop once what is left is bounded by tol times every
      //    row's estimated total (tot: the resident lse, then each scored block's added)
      walk_order(S, u);
      for (int64_t r = 0; r < R; ++r) u.tot[r] = lr[bh * R + r];
      int64_t nscored = 0;
      for (int64_t p = 0; p < n; ++p) {
        const int64_t j = u.order[p];
        if (u.cnt[j] == 0) break;  // only empty blocks are left (their bound is -inf)
        bool done = true;
        for (int64_t r = 0; r < R && done; ++r) done = u.suf[r * (n + 1) + p] <= log_tol + u.tot[r];
        if (done) break;
        sketch_scores<DC>(S, bh, j, qb, u);
        block_lse(S, j, lo + bh * R * n, u);
        ++nscored;
      }
      sc[bh] = nscored;
      keep_blocks(S, lo + bh * R * n, lr + bh * R, ff, mass, min_blocks, max_blocks, kp + bh * R * n, u);
    }
  });
  return {keep, lse, scored};
}

}  // namespace

std::vector<torch::Tensor> offload_select(torch::Tensor qr, torch::Tensor signs, torch::Tensor scale,
                                          torch::Tensor mean, torch::Tensor alpha, torch::Tensor amax,
                                          torch::Tensor smax, torch::Tensor mmax, torch::Tensor valid,
                                          torch::Tensor lse_res, torch::Tensor forced_from, double mass,
                                          int64_t min_blocks, int64_t max_blocks, double tol) {
  if (qr.size(3) == 64 && signs.size(4) == 8)
    return select_impl<64>(qr, signs, scale, mean, alpha, amax, smax, mmax, valid, lse_res, forced_from, mass,
                           min_blocks, max_blocks, tol);
  return select_impl<0>(qr, signs, scale, mean, alpha, amax, smax, mmax, valid, lse_res, forced_from, mass,
                        min_blocks, max_blocks, tol);
}

namespace {

#if defined(__AVX512F__)
// 16 values of storage dtype DT (0 fp16, 1 bf16, 2 fp32) at p as floats.
template <int DT>
inline __m512 load16(const void* p) {
  if constexpr (DT == 0) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  } else if constexpr (DT == 1) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(p));
  }
}

// The 64 values of a token at p (dtype DT) as four vectors.
template <int DT>
inline void load64(const uint8_t* p, __m512 (&k)[4]) {
  constexpr int64_t ES = DT == 2 ? 4 : 2;
  for (int c = 0; c < 4; ++c) k[c] = load16<DT>(p + 16 * c * ES);
}

// q . k of 64-wide vectors held in four registers each: the per-lane partial sums.
inline __m512 dot_partial(const __m512 (&q)[4], const __m512 (&k)[4]) {
  __m512 a = _mm512_mul_ps(q[0], k[0]);
  a = _mm512_fmadd_ps(q[1], k[1], a);
  a = _mm512_fmadd_ps(q[2], k[2], a);
  return _mm512_fmadd_ps(q[3], k[3], a);
}

// One block of a 64-wide head for the rows rk[0..nr) (at most 4): scores q . k of its T tokens
// (invalid ones -inf) into sc[r * T + t], read from the record in its storage dtype (no converted
// copy); 16 tokens' dot products reduced at once (hsum16).
template <int DT, int G>
inline void scores64(const float* qb, const int64_t* rk, const uint8_t* K, const uint8_t* okb, int64_t T,
                     float* sc) {
  constexpr int64_t ES = DT == 2 ? 4 : 2;
  __m512 q[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) q[g][c] = _mm512_loadu_ps(qb + rk[g] * 64 + 16 * c);
  alignas(64) __m512 part[G][16];
  const int64_t T16 = T / 16 * 16;
  for (int64_t t0 = 0; t0 < T16; t0 += 16) {
    for (int u = 0; u < 16; ++u) {
      __m512 k[4];
      load64<DT>(K + (t0 + u) * 64 * ES, k);  // converted once for the G rows
      for (int g = 0; g < G; ++g) part[g][hslot(u)] = dot_partial(q[g], k);
    }
    const __mmask16 ok = bits16(okb, t0);
    for (int g = 0; g < G; ++g)
      _mm512_storeu_ps(sc + rk[g] * T + t0, _mm512_mask_blend_ps(ok, _mm512_set1_ps(NEG), hsum16(part[g])));
  }
  for (int64_t t = T16; t < T; ++t) {
    __m512 k[4];
    load64<DT>(K + t * 64 * ES, k);
    for (int g = 0; g < G; ++g) sc[rk[g] * T + t] = bit(okb, t) ? _mm512_reduce_add_ps(dot_partial(q[g], k)) : NEG;
  }
}

// acc[r] += sum_t p[r * T + t] * v_t for the rows rk[0..nr) (at most 4; rk < 0 skipped by the caller).
template <int DT, int G>
inline void values64(const int64_t* rk, const uint8_t* V, int64_t T, const float* p, float* acc) {
  constexpr int64_t ES = DT == 2 ? 4 : 2;
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_loadu_ps(acc + rk[g] * 64 + 16 * c);
  for (int64_t t = 0; t < T; ++t) {
    __m512 v[4];
    load64<DT>(V + t * 64 * ES, v);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[rk[g] * T + t]);
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + rk[g] * 64 + 16 * c, a[g][c]);
}

// Rows in groups of up to 4 (a group's keys or values loaded once, its accumulators in registers).
template <int DT>
inline void scores64_rows(const float* qb, const int64_t* rk, int64_t nr, const uint8_t* K, const uint8_t* okb,
                          int64_t T, float* sc) {
  for (int64_t i = 0; i < nr; i += 4) {
    switch (std::min<int64_t>(4, nr - i)) {
      case 4: scores64<DT, 4>(qb, rk + i, K, okb, T, sc); break;
      case 3: scores64<DT, 3>(qb, rk + i, K, okb, T, sc); break;
      case 2: scores64<DT, 2>(qb, rk + i, K, okb, T, sc); break;
      default: scores64<DT, 1>(qb, rk + i, K, okb, T, sc);
    }
  }
}

template <int DT>
inline void values64_rows(const int64_t* rk, int64_t nr, const uint8_t* V, int64_t T, const float* p, float* acc) {
  for (int64_t i = 0; i < nr; i += 4) {
    switch (std::min<int64_t>(4, nr - i)) {
      case 4: values64<DT, 4>(rk + i, V, T, p, acc); break;
      case 3: values64<DT, 3>(rk + i, V, T, p, acc); break;
      case 2: values64<DT, 2>(rk + i, V, T, p, acc); break;
      default: values64<DT, 1>(rk + i, V, T, p, acc);
    }
  }
}
#endif

// --- offload_attend (kvtier.attention.offloaded.attend_blocks_torch), one (batch, KV head) at a time ---

// One task's online-softmax state (m, s, acc per row: running max, sum, unnormalized output) and buffers.
struct AttendState {
  std::vector<float> kf, vf, acc, m, s, sc;
  std::vector<int64_t> rk, rv;  // the rows that keep a block; those with a valid token in it
  AttendState(bool fast, int64_t R, int64_t T, int64_t D)
      : kf(fast ? 0 : T * D), vf(fast ? 0 : T * D), acc(R * D), m(R), s(R), sc(R * T), rk(R), rv(R) {}
};

// The state from the previous partial (normalized out_prev [R, D], lse_prev [R]; -inf: nothing).
void start_rows(const float* op, const float* lp, int64_t R, int64_t D, AttendState& st) {
  for (int64_t r = 0; r < R; ++r) {
    const float lv = lp[r];
    st.m[r] = lv;
    st.s[r] = lv == NEG ? 0.f : 1.f;
    for (int64_t d = 0; d < D; ++d) st.acc[r * D + d] = lv == NEG ? 0.f : op[r * D + d];
  }
}

// 1. scores of the kept rows rk[0..nr) against one block's keys into sc[r * T + t] (-inf for invalid tokens).
template <int DC>
void block_scores(const float* qb, int64_t kaddr, int dt, const uint8_t* okb, int64_t nr, int64_t T, int64_t D,
                  AttendState& st) {
#if defined(__AVX512F__)  // the block routines exist only there (a discarded branch still needs them declared)
  constexpr bool fast = DC == 64;  // records read in their dtype by the AVX-512 block routines
  if constexpr (fast) {
    const uint8_t* K = reinterpret_cast<const uint8_t*>(kaddr);
    if (dt == 0) scores64_rows<0>(qb, st.rk.data(), nr, K, okb, T, st.sc.data());
    else if (dt == 1) scores64_rows<1>(qb, st.rk.data(), nr, K, okb, T, st.sc.data());
    else scores64_rows<2>(qb, st.rk.data(), nr, K, okb, T, st.sc.data());
  } else
#endif
  {
    to_float(reinterpret_cast<const void*>(kaddr), dt, T * D, st.kf.data());
    for (int64_t i = 0; i < nr; ++i) {
      const float* qr = qb + st.rk[i] * D;
      float* x = st.sc.data() + st.rk[i] * T;
      for (int64_t t = 0; t < T; ++t) {
        const float* kt = st.kf.data() + t * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kt[d];
        x[t] = bit(okb, t) ? dot : NEG;
      }
    }
  }
}

// 2. online softmax per kept row: rescale its state to the new max, scores -> weights in place;
//    rows with nothing valid in the block drop out. Returns the rows left (rv[0..nv)).
int64_t online_softmax(int64_t nr, int64_t T, int64_t D, AttendState& st) {
  int64_t nv = 0;
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t r = st.rk[i];
    float* x = st.sc.data() + r * T;
    float mb = NEG;
#pragma omp simd reduction(max : mb)
    for (int64_t t = 0; t < T; ++t) mb = std::max(mb, x[t]);
    if (mb == NEG) continue;
    st.rv[nv++] = r;
    const float mn = std::max(st.m[r], mb);
    const float f = st.m[r] == NEG ? 0.f : std::exp(st.m[r] - mn);
    st.s[r] *= f;
    float* ar = st.acc.data() + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ar[d] *= f;
    st.m[r] = mn;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < T; ++t) {
      x[t] = fexp(x[t] - mn);
      sum += x[t];
    }
    st.s[r] += sum;
  }
  return nv;
}

// 3. the block's values weighted by the rows rv[0..nv) into acc.
template <int DC>
void block_values(int64_t vaddr, int dt, int64_t nv, int64_t T, int64_t D, AttendState& st) {
#if defined(__AVX512F__)
  constexpr bool fast = DC == 64;
  if constexpr (fast) {
    const uint8_t* V = reinterpret_cast<const uint8_t*>(vaddr);
    if (dt == 0) values64_rows<0>(st.rv.data(), nv, V, T, st.sc.data(), st.acc.data());
    else if (dt == 1) values64_rows<1>(st.rv.data(), nv, V, T, st.sc.data(), st.acc.data());
    else values64_rows<2>(st.rv.data(), nv, V, T, st.sc.data(), st.acc.data());
  } else
#endif
  {
    to_float(reinterpret_cast<const void*>(vaddr), dt, T * D, st.vf.data());
    for (int64_t i = 0; i < nv; ++i) {
      const float* x = st.sc.data() + st.rv[i] * T;
      float* ar = st.acc.data() + st.rv[i] * D;
      for (int64_t t = 0; t < T; ++t) {
        const float p = x[t];
        if (p == 0.f) continue;
        const float* vt = st.vf.data() + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += p * vt[d];
      }
    }
  }
}

// The rows' Partial: normalized o [R, D] and l [R] (-inf where nothing was attended).
void finish_rows(const AttendState& st, int64_t R, int64_t D, float* o, float* l) {
  for (int64_t r = 0; r < R; ++r) {
    const float inv = st.s[r] > 0.f ? 1.f / st.s[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) o[r * D + d] = st.acc[r * D + d] * inv;
    l[r] = st.s[r] > 0.f ? st.m[r] + std::log(st.s[r]) : NEG;
  }
}

// Exact attention over the blocks each row keeps, merged into (out_prev, lse_prev); see
// offload_cpu.offload_attend. DC as for select_impl.
template <int DC>
std::vector<torch::Tensor> attend_impl(torch::Tensor rows, torch::Tensor keep, torch::Tensor kptr,
                                          torch::Tensor vptr, torch::Tensor valid, int64_t T, int64_t dtype,
                                          torch::Tensor out_prev, torch::Tensor lse_prev) {
  TORCH_CHECK(rows.dtype() == torch::kFloat32 && rows.is_contiguous(), "rows: contiguous float32");
  const int64_t B = rows.size(0), H = rows.size(1), R = rows.size(2), D = DC > 0 ? DC : rows.size(3);
  const int64_t n = keep.size(3);
  auto out = torch::empty({B, H, R, D}, rows.options());
  auto lse = torch::empty({B, H, R}, rows.options());
  auto counts = torch::zeros({B * H, 2}, rows.options().dtype(torch::kLong));
  const float* q = rows.data_ptr<float>();
  const bool* kp = keep.data_ptr<bool>();
  const int64_t* ka = kptr.data_ptr<int64_t>();
  const int64_t* va = vptr.data_ptr<int64_t>();
  TORCH_CHECK(valid.dtype() == torch::kUInt8, "valid: packed uint8 bits");
  const uint8_t* ok = valid.data_ptr<uint8_t>();
  const int64_t TB = (T + 7) / 8;
  const float* op = out_prev.data_ptr<float>();
  const float* lp = lse_prev.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  int64_t* cn = counts.data_ptr<int64_t>();
  const int dt = int(dtype);
#if defined(__AVX512F__)
  constexpr bool fast = DC == 64;  // records read in their dtype by the AVX-512 block routines
#else
  constexpr bool fast = false;
#endif
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    AttendState st(fast, R, T, D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H;
      const float* qb = q + bh * R * D;
      start_rows(op + bh * R * D, lp + bh * R, R, D, st);
      int64_t blocks = 0, pairs = 0;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t kaddr = ka[bh * n + j];
        if (kaddr == 0) continue;
        int64_t nr = 0;
        for (int64_t r = 0; r < R; ++r)
          if (kp[(bh * R + r) * n + j]) st.rk[nr++] = r;
        if (nr == 0) continue;
        ++blocks;
        block_scores<DC>(qb, kaddr, dt, ok + (b * n + j) * TB, nr, T, D, st);
        pairs += nr * T;
        const int64_t nv = online_softmax(nr, T, D, st);
        if (nv == 0) continue;
        block_values<DC>(va[bh * n + j], dt, nv, T, D, st);
      }
      cn[bh * 2] = blocks;
      cn[bh * 2 + 1] = pairs;
      finish_rows(st, R, D, o + bh * R * D, l + bh * R);
    }
  });
  return {out, lse, counts};
}

}  // namespace

std::vector<torch::Tensor> offload_attend(torch::Tensor rows, torch::Tensor keep, torch::Tensor kptr,
                                          torch::Tensor vptr, torch::Tensor valid, int64_t T, int64_t dtype,
                                          torch::Tensor out_prev, torch::Tensor lse_prev) {
  if (rows.size(3) == 64) return attend_impl<64>(rows, keep, kptr, vptr, valid, T, dtype, out_prev, lse_prev);
  return attend_impl<0>(rows, keep, kptr, vptr, valid, T, dtype, out_prev, lse_prev);
}
