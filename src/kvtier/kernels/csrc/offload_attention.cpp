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

namespace {

constexpr float NEG = -std::numeric_limits<float>::infinity();

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

struct Bits8 {
  alignas(32) float v[256][8];
  Bits8() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) v[b][i] = float((b >> i) & 1);
  }
};
const Bits8 kBits;

inline float half_to_float(uint16_t h) { return float(c10::Half(h, c10::Half::from_bits())); }

// n values of storage dtype `dt` (0 fp16, 1 bf16, 2 fp32) at p -> floats.
inline void to_float(const void* p, int dt, int64_t n, float* __restrict out) {
  if (dt == 2) {
    std::memcpy(out, p, n * sizeof(float));
  } else if (dt == 1) {
    const uint16_t* h = static_cast<const uint16_t*>(p);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(uint32_t(h[i]) << 16);
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(p);
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
    for (; i < n; ++i) out[i] = half_to_float(h[i]);
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

// Coarse bound, walk, sketch scores and the mass rule; see offload_cpu.offload_select. DC: the
// head dim when known at compile time (loops unroll into SIMD registers), 0 otherwise.
template <int DC>
std::vector<torch::Tensor> select_impl(torch::Tensor qr, torch::Tensor signs, torch::Tensor scale,
                                          torch::Tensor mean, torch::Tensor alpha, torch::Tensor amax,
                                          torch::Tensor valid, torch::Tensor lse_res, torch::Tensor forced_from,
                                          double mass, int64_t min_blocks, int64_t max_blocks, double tol) {
  TORCH_CHECK(qr.dtype() == torch::kFloat32 && qr.is_contiguous(), "rows: contiguous float32");
  TORCH_CHECK(scale.dtype() == torch::kFloat16 && mean.dtype() == torch::kFloat16 &&
                  alpha.dtype() == torch::kFloat16, "scale, mean, alpha: float16");
  const int64_t B = qr.size(0), H = qr.size(1), R = qr.size(2), D = DC > 0 ? DC : qr.size(3);
  const int64_t n = signs.size(2), T = signs.size(3), P = signs.size(4), Dp = DC > 0 ? (DC + 7) / 8 * 8 : 8 * P;
  TORCH_CHECK(Dp >= D, "signs do not cover head_dim");
  auto keep = torch::zeros({B, H, R, n}, qr.options().dtype(torch::kBool));
  auto lse = torch::full({B, H, R, n}, NEG, qr.options());
  auto scored = torch::zeros({B * H}, qr.options().dtype(torch::kLong));
  const float* q = qr.data_ptr<float>();
  const uint8_t* sg = signs.data_ptr<uint8_t>();
  const uint16_t* ks = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* km = reinterpret_cast<const uint16_t*>(mean.data_ptr<at::Half>());
  const uint16_t* al = reinterpret_cast<const uint16_t*>(alpha.data_ptr<at::Half>());
  const float* am = amax.data_ptr<float>();
  const bool* ok = valid.data_ptr<bool>();
  const float* lr = lse_res.data_ptr<float>();
  const int64_t* ff = forced_from.data_ptr<int64_t>();
  bool* kp = keep.data_ptr<bool>();
  float* lo = lse.data_ptr<float>();
  int64_t* sc = scored.data_ptr<int64_t>();
  const float log_tol = tol > 0 ? float(std::log(tol)) : NEG;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ub(R * n), sbuf(D), mbuf(D), w(R * Dp, 0.f), bias(R), wsum(R), tot(R), suf(R * (n + 1));
    std::vector<float> bits(T * Dp), abuf(T), x(T), bmax(n);
    std::vector<int64_t> order(n), cnt(n), rank_order(n);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H;
      const float* qb = q + bh * R * D;
      // 1. coarse: an upper bound of each block's sketch log-sum-exp, from resident per-block data:
      //    q . mean + amax * sum_c |q_c scale_c| + log(valid tokens).
      for (int64_t j = 0; j < n; ++j) {
        int64_t c = 0;
        const bool* okb = ok + (b * n + j) * T;
        for (int64_t t = 0; t < T; ++t) c += okb[t];
        cnt[j] = c;
        to_float(ks + (bh * n + j) * D, 0, D, sbuf.data());
        to_float(km + (bh * n + j) * D, 0, D, mbuf.data());
        const float a = am[bh * n + j];
        for (int64_t r = 0; r < R; ++r) {
          float dm = 0.f, da = 0.f;
#pragma omp simd reduction(+ : dm, da)
          for (int64_t d = 0; d < D; ++d) {
            dm += qb[r * D + d] * mbuf[d];
            da += std::fabs(qb[r * D + d] * sbuf[d]);
          }
          ub[r * n + j] = c ? dm + a * da + std::log(float(c)) : NEG;
        }
      }
      // 2. walk blocks by descending bound (max over rows, ties by index); stop once what is left
      //    is bounded by tol times every row's estimated total.
      for (int64_t j = 0; j < n; ++j) {
        float mx = NEG;
        for (int64_t r = 0; r < R; ++r) mx = std::max(mx, ub[r * n + j]);
        bmax[j] = mx;
      }
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return bmax[a] > bmax[c]; });
      for (int64_t r = 0; r < R; ++r) {
        float* s = suf.data() + r * (n + 1);
        s[n] = NEG;
        for (int64_t p = n - 1; p >= 0; --p) s[p] = logaddexp(s[p + 1], ub[r * n + order[p]]);
        tot[r] = lr[bh * R + r];
      }
      int64_t nscored = 0;
      for (int64_t p = 0; p < n; ++p) {
        const int64_t j = order[p];
        if (cnt[j] == 0) break;  // only empty blocks are left (their bound is -inf)
        bool done = true;
        for (int64_t r = 0; r < R && done; ++r) done = suf[r * (n + 1) + p] <= log_tol + tot[r];
        if (done) break;
        // sketch scores of block j: q . mean + alpha_t (2 w . bits_t - w . 1), w = q * scale
        to_float(ks + (bh * n + j) * D, 0, D, sbuf.data());
        to_float(km + (bh * n + j) * D, 0, D, mbuf.data());
        to_float(al + (bh * n + j) * T, 0, T, abuf.data());
        const uint8_t* codes = sg + (bh * n + j) * T * P;
#if defined(__AVX512F__)
        constexpr bool masked = DC == 64;  // a token's 64 sign bits are one AVX-512 mask word
#else
        constexpr bool masked = false;
#endif
        if constexpr (!masked)
          for (int64_t t = 0; t < T * P; ++t) std::memcpy(bits.data() + 8 * t, kBits.v[codes[t]], 8 * sizeof(float));
        const bool* okb = ok + (b * n + j) * T;
        for (int64_t r = 0; r < R; ++r) {
          float* wr = w.data() + r * Dp;
          float dm = 0.f, ws = 0.f;
#pragma omp simd reduction(+ : dm, ws)
          for (int64_t d = 0; d < D; ++d) {
            wr[d] = qb[r * D + d] * sbuf[d];
            dm += qb[r * D + d] * mbuf[d];
            ws += wr[d];
          }
          float m = NEG;
#if defined(__AVX512F__)
          if constexpr (masked) {
            // w . bits = the sum of w over the channels whose bit is set: masked adds, no unpacking
            const __m512 w0 = _mm512_loadu_ps(wr), w1 = _mm512_loadu_ps(wr + 16);
            const __m512 w2 = _mm512_loadu_ps(wr + 32), w3 = _mm512_loadu_ps(wr + 48);
            for (int64_t t = 0; t < T; ++t) {
              uint64_t bm;
              std::memcpy(&bm, codes + t * 8, 8);
              __m512 acc = _mm512_maskz_mov_ps(__mmask16(bm), w0);
              acc = _mm512_mask_add_ps(acc, __mmask16(bm >> 16), acc, w1);
              acc = _mm512_mask_add_ps(acc, __mmask16(bm >> 32), acc, w2);
              acc = _mm512_mask_add_ps(acc, __mmask16(bm >> 48), acc, w3);
              const float dot = _mm512_reduce_add_ps(acc);
              x[t] = okb[t] ? dm + abuf[t] * (2.f * dot - ws) : NEG;
              m = std::max(m, x[t]);
            }
          } else
#endif
          {
            for (int64_t t = 0; t < T; ++t) {
              const float* bt = bits.data() + t * Dp;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += wr[d] * bt[d];
              x[t] = okb[t] ? dm + abuf[t] * (2.f * dot - ws) : NEG;
              m = std::max(m, x[t]);
            }
          }
          float s = 0.f;
          if (m != NEG) {
#pragma omp simd reduction(+ : s)
            for (int64_t t = 0; t < T; ++t) s += fexp(x[t] - m);
          }
          const float v = m == NEG ? NEG : m + std::log(s);
          lo[(bh * R + r) * n + j] = v;
          tot[r] = logaddexp(tot[r], v);
        }
        ++nscored;
      }
      sc[bh] = nscored;
      // 3. per row: keep scored blocks by descending estimate while the resident mass plus the
      //    kept blocks cover less than `mass` of the estimated total; caps; forced blocks.
      for (int64_t r = 0; r < R; ++r) {
        const float* lv = lo + (bh * R + r) * n;
        bool* kr = kp + (bh * R + r) * n;
        std::iota(rank_order.begin(), rank_order.end(), 0);
        std::stable_sort(rank_order.begin(), rank_order.end(), [&](int64_t a, int64_t c) { return lv[a] > lv[c]; });
        const float total_raw = tot[r];
        const float total = std::isfinite(total_raw) ? total_raw : 0.f;
        float covered = std::exp(lr[bh * R + r] - total);
        for (int64_t k = 0; k < n; ++k) {
          const int64_t j = rank_order[k];
          if (lv[j] == NEG) break;
          bool on = mass <= 0 || covered < mass;
          if (max_blocks > 0 && k >= max_blocks) on = false;
          if (k < min_blocks) on = true;
          kr[j] = on;
          covered += std::exp(lv[j] - total);
        }
        for (int64_t j = std::max<int64_t>(0, ff[r]); j < n; ++j) kr[j] = kr[j] || cnt[j] > 0;
      }
    }
  });
  return {keep, lse, scored};
}

}  // namespace

std::vector<torch::Tensor> offload_select(torch::Tensor qr, torch::Tensor signs, torch::Tensor scale,
                                          torch::Tensor mean, torch::Tensor alpha, torch::Tensor amax,
                                          torch::Tensor valid, torch::Tensor lse_res, torch::Tensor forced_from,
                                          double mass, int64_t min_blocks, int64_t max_blocks, double tol) {
  if (qr.size(3) == 64 && signs.size(4) == 8)
    return select_impl<64>(qr, signs, scale, mean, alpha, amax, valid, lse_res, forced_from, mass, min_blocks,
                           max_blocks, tol);
  return select_impl<0>(qr, signs, scale, mean, alpha, amax, valid, lse_res, forced_from, mass, min_blocks,
                        max_blocks, tol);
}

namespace {

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
  const bool* ok = valid.data_ptr<bool>();
  const float* op = out_prev.data_ptr<float>();
  const float* lp = lse_prev.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  int64_t* cn = counts.data_ptr<int64_t>();
  const int dt = int(dtype);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kf(T * D), vf(T * D), acc(R * D), m(R), s(R), sc(R * T);
    std::vector<int64_t> rk(R);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H;
      const float* qb = q + bh * R * D;
      for (int64_t r = 0; r < R; ++r) {
        const float lv = lp[bh * R + r];
        m[r] = lv;
        s[r] = lv == NEG ? 0.f : 1.f;
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] = lv == NEG ? 0.f : op[(bh * R + r) * D + d];
      }
      int64_t blocks = 0, pairs = 0;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t kaddr = ka[bh * n + j];
        if (kaddr == 0) continue;
        int64_t nr = 0;
        for (int64_t r = 0; r < R; ++r)
          if (kp[(bh * R + r) * n + j]) rk[nr++] = r;
        if (nr == 0) continue;
        ++blocks;
        const bool* okb = ok + (b * n + j) * T;
        to_float(reinterpret_cast<const void*>(kaddr), dt, T * D, kf.data());
        bool any = false;
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t r = rk[i];
          const float* qr = qb + r * D;
          float* x = sc.data() + r * T;
          float mb = NEG;
          for (int64_t t = 0; t < T; ++t) {
            const float* kt = kf.data() + t * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qr[d] * kt[d];
            x[t] = okb[t] ? dot : NEG;
            mb = std::max(mb, x[t]);
          }
          pairs += T;
          if (mb == NEG) {
            rk[i] = -1;
            continue;
          }
          any = true;
          const float mn = std::max(m[r], mb);
          const float f = m[r] == NEG ? 0.f : std::exp(m[r] - mn);
          s[r] *= f;
          float* ar = acc.data() + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] *= f;
          m[r] = mn;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < T; ++t) {
            x[t] = fexp(x[t] - mn);
            sum += x[t];
          }
          s[r] += sum;
        }
        if (!any) continue;
        to_float(reinterpret_cast<const void*>(va[bh * n + j]), dt, T * D, vf.data());
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t r = rk[i];
          if (r < 0) continue;
          const float* x = sc.data() + r * T;
          float* ar = acc.data() + r * D;
          if constexpr (DC > 0) {
            alignas(32) float la[DC];
            for (int d = 0; d < DC; ++d) la[d] = ar[d];
            for (int64_t t = 0; t < T; ++t) {
              const float p = x[t];
              const float* vt = vf.data() + t * DC;
#pragma omp simd
              for (int d = 0; d < DC; ++d) la[d] += p * vt[d];
            }
            for (int d = 0; d < DC; ++d) ar[d] = la[d];
          } else {
            for (int64_t t = 0; t < T; ++t) {
              const float p = x[t];
              if (p == 0.f) continue;
              const float* vt = vf.data() + t * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) ar[d] += p * vt[d];
            }
          }
        }
      }
      cn[bh * 2] = blocks;
      cn[bh * 2 + 1] = pairs;
      for (int64_t r = 0; r < R; ++r) {
        const float inv = s[r] > 0.f ? 1.f / s[r] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[(bh * R + r) * D + d] = acc[r * D + d] * inv;
        l[bh * R + r] = s[r] > 0.f ? m[r] + std::log(s[r]) : NEG;
      }
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
