// Attention over kvtier's packed vLLM pages (kvtier/vllm/pages.py) with block tables, plus each
// request's exact tokens (side buffer and this step's new tokens), in one call per layer.
//
// Page of one block (byte offsets given by the caller): kscale/kzero fp16 [H, T/kg, D],
// vscale/vzero fp16 [H, T, D/vg], sink bf16 [H, s, 2, D], kcodes/vcodes uint8 [H, T, D/2]
// (4-bit codes, low nibble first). Keys are (c - z) * s per channel, values per token group.
//
// Per (request, kv head) task, every query row that shares the head (Gq heads x q tokens) runs
// an online softmax over: the packed blocks (all visible), then the exact rows (causal: query i
// of q sees exact row j < ne - q + i + 1). Reference: kvtier.vllm.paged.attend_layer.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

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

// 32 4-bit codes (16 bytes, low nibble first) as two vectors of 16 floats, in code order.
inline void unpack32(const uint8_t* c, __m512& a, __m512& b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m128i m = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
  a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
}
#endif

inline float half_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Layout {
  int64_t H, D, T, kg, vg, s, page;
  int64_t kscale, kzero, vscale, vzero, sink, kcodes, vcodes;
};

struct Rows {
  int64_t R, D;
  std::vector<float> m, l, acc, p;
  Rows(int64_t R_, int64_t D_, int64_t T)
      : R(R_), D(D_), m(R_, -std::numeric_limits<float>::infinity()), l(R_, 0.f), acc(R_ * D_, 0.f), p(R_ * T) {}
  // Fold scores p[r * n + t] (t < n; -inf = masked) into the running softmax, then return
  // the probabilities in place (0 for masked) with acc already rescaled.
  void softmax_block(int64_t n) {
    for (int64_t r = 0; r < R; ++r) {
      float* pr = p.data() + r * n;
      float mx = m[r];
      int64_t t0 = 0;
#if defined(__AVX512F__)
      __m512 vm = _mm512_set1_ps(mx);
      for (; t0 + 16 <= n; t0 += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(pr + t0));
      mx = _mm512_reduce_max_ps(vm);
#endif
      for (int64_t t = t0; t < n; ++t) mx = std::max(mx, pr[t]);
      if (mx == -std::numeric_limits<float>::infinity()) {
        for (int64_t t = 0; t < n; ++t) pr[t] = 0.f;
        continue;
      }
      float corr = std::exp(m[r] - mx);  // exp(-inf) = 0 on the first block
      l[r] *= corr;
      float* a = acc.data() + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
      float sum = 0.f;
      int64_t t1 = 0;
#if defined(__AVX512F__)
      __m512 vs = _mm512_setzero_ps();
      const __m512 vmx = _mm512_set1_ps(mx);
      for (; t1 + 16 <= n; t1 += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(pr + t1), vmx));
        _mm512_storeu_ps(pr + t1, e);
        vs = _mm512_add_ps(vs, e);
      }
      sum = _mm512_reduce_add_ps(vs);
#endif
      for (int64_t t = t1; t < n; ++t) {
        float e = pr[t] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(pr[t] - mx);
        pr[t] = e;
        sum += e;
      }
      l[r] += sum;
      m[r] = mx;
    }
  }
};

}  // namespace

void vllm_paged_attention(
    torch::Tensor q,          // float32 [N, Hq, D], pre-scaled
    torch::Tensor pages,      // uint8 [B, page]
    torch::Tensor qstart,     // int64 [R, 2]: begin, end of each request's new tokens
    torch::Tensor pstart,     // int64 [R+1]
    torch::Tensor pids,       // int64 [Np]
    torch::Tensor ek,         // float32 [E, H, D]
    torch::Tensor ev,         // float32 [E, H, D]
    torch::Tensor estart,     // int64 [R+1]
    torch::Tensor out,        // float32 [N, Hq, D]
    std::vector<int64_t> lay  // H, D, T, kg, vg, s, page, kscale, kzero, vscale, vzero, sink, kcodes, vcodes
) {
  TORCH_CHECK(lay.size() == 14, "layout: 14 ints");
  const Layout L{lay[0], lay[1], lay[2], lay[3], lay[4], lay[5], lay[6],
                 lay[7], lay[8], lay[9], lay[10], lay[11], lay[12], lay[13]};
  TORCH_CHECK(q.is_contiguous() && ek.is_contiguous() && ev.is_contiguous() && out.is_contiguous());
  TORCH_CHECK(pages.is_contiguous() && pages.size(1) == L.page, "pages: contiguous [B, page]");
  TORCH_CHECK(L.D % 2 == 0 && L.D <= 512, "head_dim");
  const int64_t Hq = q.size(1), H = L.H, D = L.D, T = L.T;
  const int64_t G = Hq / H;
  const int64_t nreq = qstart.size(0);
  const float* qp = q.data_ptr<float>();
  const uint8_t* pg = pages.data_ptr<uint8_t>();
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int64_t* ps = pstart.data_ptr<int64_t>();
  const int64_t* pid = pids.data_ptr<int64_t>();
  const int64_t* es = estart.data_ptr<int64_t>();
  const float* ekp = ek.data_ptr<float>();
  const float* evp = ev.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t nkg = T / L.kg, nvg = D / L.vg, cb = D / 2;

  at::parallel_for(0, nreq * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qsc, qz, kf(D), vf(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / H, h = task % H;
      const int64_t q0 = qs[2 * r], qn = qs[2 * r + 1] - q0;
      if (qn == 0) continue;
      const int64_t R = qn * G;  // row = i * G + g
      Rows st(R, D, T);
      auto qrow = [&](int64_t row) { return qp + ((q0 + row / G) * Hq + h * G + row % G) * D; };
      qsc.assign(R * D, 0.f);
      qz.assign(R, 0.f);
      // ---- packed blocks ----
      for (int64_t bi = ps[r]; bi < ps[r + 1]; ++bi) {
        const uint8_t* page = pg + pid[bi] * L.page;
        const uint16_t* ks = reinterpret_cast<const uint16_t*>(page + L.kscale) + h * nkg * D;
        const uint16_t* kz = reinterpret_cast<const uint16_t*>(page + L.kzero) + h * nkg * D;
        const uint16_t* vs = reinterpret_cast<const uint16_t*>(page + L.vscale) + h * T * nvg;
        const uint16_t* vz = reinterpret_cast<const uint16_t*>(page + L.vzero) + h * T * nvg;
        const uint16_t* sk = reinterpret_cast<const uint16_t*>(page + L.sink) + h * L.s * 2 * D;
        const uint8_t* kc = page + L.kcodes + h * T * cb;
        const uint8_t* vc = page + L.vcodes + h * T * cb;
        for (int64_t t0 = 0; t0 < T; t0 += L.kg) {
          const int64_t g = t0 / L.kg;
          for (int64_t d = 0; d < D; ++d) {
            kf[d] = half_to_float(ks[g * D + d]);
            vf[d] = half_to_float(kz[g * D + d]);
          }
          for (int64_t row = 0; row < R; ++row) {  // q * s and (q * s) . z of this key group
            const float* qr = qrow(row);
            float* qq = qsc.data() + row * D;
            float z = 0.f;
#pragma omp simd reduction(+ : z)
            for (int64_t d = 0; d < D; ++d) {
              qq[d] = qr[d] * kf[d];
              z += qq[d] * vf[d];
            }
            qz[row] = z;
          }
          for (int64_t t = t0; t < t0 + L.kg; ++t) {
            if (t < L.s) {  // exact sink token
              const uint16_t* kk = sk + t * 2 * D;
              for (int64_t d = 0; d < D; ++d) kf[d] = bf16_to_float(kk[d]);
              for (int64_t row = 0; row < R; ++row) {
                const float* qr = qrow(row);
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < D; ++d) acc += qr[d] * kf[d];
                st.p[row * T + t] = acc;
              }
              continue;
            }
            const uint8_t* c = kc + t * cb;
#if defined(__AVX512F__)
            if (D % 32 == 0) {
              __m512 kv[16];
              for (int64_t j = 0; j < D / 32; ++j) unpack32(c + 16 * j, kv[2 * j], kv[2 * j + 1]);
              for (int64_t row = 0; row < R; ++row) {
                const float* qq = qsc.data() + row * D;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qq), kv[0]);
                for (int64_t j = 1; j < D / 16; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qq + 16 * j), kv[j], acc);
                st.p[row * T + t] = _mm512_reduce_add_ps(acc) - qz[row];
              }
              continue;
            }
#endif
            for (int64_t j = 0; j < cb; ++j) {
              kf[2 * j] = static_cast<float>(c[j] & 15);
              kf[2 * j + 1] = static_cast<float>(c[j] >> 4);
            }
            for (int64_t row = 0; row < R; ++row) {
              const float* qq = qsc.data() + row * D;
              float acc = 0.f;
#pragma omp simd reduction(+ : acc)
              for (int64_t d = 0; d < D; ++d) acc += qq[d] * kf[d];
              st.p[row * T + t] = acc - qz[row];
            }
          }
        }
        // rows' scores are at p[row * T + t]: fold them in
        st.softmax_block(T);
        for (int64_t t = 0; t < T; ++t) {
          if (t < L.s) {
            const uint16_t* vv = sk + t * 2 * D + D;
            for (int64_t d = 0; d < D; ++d) vf[d] = bf16_to_float(vv[d]);
          } else {
            const uint8_t* c = vc + t * cb;
#if defined(__AVX512F__)
            if (D % 32 == 0 && L.vg % 16 == 0) {
              for (int64_t j = 0; j < D / 32; ++j) {
                __m512 a, b;
                unpack32(c + 16 * j, a, b);
                _mm512_storeu_ps(vf.data() + 32 * j, a);
                _mm512_storeu_ps(vf.data() + 32 * j + 16, b);
              }
              for (int64_t j = 0; j < D / 16; ++j) {
                const int64_t gg = (16 * j) / L.vg;
                const __m512 sc = _mm512_set1_ps(half_to_float(vs[t * nvg + gg]));
                const __m512 zs = _mm512_set1_ps(half_to_float(vz[t * nvg + gg]));
                _mm512_storeu_ps(vf.data() + 16 * j, _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(vf.data() + 16 * j), zs), sc));
              }
            } else
#endif
            {
              for (int64_t j = 0; j < cb; ++j) {
                vf[2 * j] = static_cast<float>(c[j] & 15);
                vf[2 * j + 1] = static_cast<float>(c[j] >> 4);
              }
              for (int64_t gg = 0; gg < nvg; ++gg) {
                const float s = half_to_float(vs[t * nvg + gg]), z = half_to_float(vz[t * nvg + gg]);
                for (int64_t d = gg * L.vg; d < (gg + 1) * L.vg; ++d) vf[d] = (vf[d] - z) * s;
              }
            }
          }
          for (int64_t row = 0; row < R; ++row) {
            const float pr = st.p[row * T + t];
            if (pr == 0.f) continue;
            float* a = st.acc.data() + row * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += pr * vf[d];
          }
        }
      }
      // ---- exact rows (side buffer, cached block heads, new tokens), causal ----
      const int64_t ne = es[r + 1] - es[r];
      for (int64_t t0 = 0; t0 < ne; t0 += T) {
        const int64_t n = std::min(T, ne - t0);
        for (int64_t row = 0; row < R; ++row) {
          const int64_t limit = ne - qn + row / G + 1;  // exact rows visible to this query
          const float* qr = qrow(row);
          for (int64_t t = 0; t < n; ++t) {
            float acc = -std::numeric_limits<float>::infinity();
            if (t0 + t < limit) {
              const float* kk = ekp + ((es[r] + t0 + t) * H + h) * D;
              acc = 0.f;
#pragma omp simd reduction(+ : acc)
              for (int64_t d = 0; d < D; ++d) acc += qr[d] * kk[d];
            }
            st.p[row * n + t] = acc;
          }
        }
        st.softmax_block(n);
        for (int64_t t = 0; t < n; ++t) {
          const float* vv = evp + ((es[r] + t0 + t) * H + h) * D;
          for (int64_t row = 0; row < R; ++row) {
            const float pr = st.p[row * n + t];
            if (pr == 0.f) continue;
            float* a = st.acc.data() + row * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += pr * vv[d];
          }
        }
      }
      for (int64_t row = 0; row < R; ++row) {
        float* o = op + ((q0 + row / G) * Hq + h * G + row % G) * D;
        const float inv = st.l[row] > 0.f ? 1.f / st.l[row] : 0.f;
        const float* a = st.acc.data() + row * D;
        for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
      }
    }
  });
}
