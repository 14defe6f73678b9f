// Causal attention of a prefill chunk in bf16 with fp32 accumulation, on AVX-512 BF16 dot products.
//
// prefill_attend(q [n, Hq, D], k [L, H, D], v [L, H, D], out [n, Hq, D], scale): query i (of the
// chunk's n new tokens, the last n of the L keys) attends keys 0 .. L - n + i; query head g reads
// KV head g / (Hq / H) (GQA). All bf16; rows need only a contiguous last dim.
//
// A flash-attention loop (online softmax over blocks of 64 keys): keys and values are first
// repacked per KV head into the pair-interleaved layout of VDPBF16PS (keys: dword p of 16 keys side
// by side; values: rows 2m and 2m+1 interleaved channel by channel), then each task (KV head, 16
// query tokens x its G query heads) computes scores 4 rows x 64 keys at a time, exact products of
// bf16 summed in fp32; probabilities are rounded to bf16 (as in FlashAttention) for P.V, which is
// summed in fp32; the output is divided by the fp32 row sum and rounded to bf16 once.
// D in {64, 128}. Tasks run on torch's threads (built with OpenMP: kvtier/kernels/build.py), early
// and late query tiles interleaved so that causal work splits evenly.
// Reference: kvtier.kernels.prefill_cpu.attend_reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "simd_exp.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kSupported = true;

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

constexpr int KB = 64;  // keys per softmax block
constexpr int QT = 16;  // query tokens per task

// One task: rows [G x tokens] of KV head h; D channels, RB rows at a time.
template <int D>
struct Task {
  static constexpr int NP = D / 2;   // dword pairs of a row
  static constexpr int ND = D / 16;  // fp32 vectors of a row
  static constexpr int RB = D == 64 ? 6 : 3;  // rows at a time: 24 accumulators

  // kp: [ceil(L/16)][NP][16] dwords; vp: [ceil(L/2)][ND][16] dwords (one KV head)
  const uint32_t* kp;
  const uint32_t* vp;
  int64_t L, c;  // keys, and keys before the chunk (query i sees keys < c + i + 1)
  float scale;

  // S[r][0 : 16 NV] = scores of rows qrows[0 .. RB) against the NV key vectors of kblk
  template <int NV>
  static inline void scores(const uint32_t* kblk, const uint32_t* const* qrows, float (*S)[KB]) {
    __m512 s[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NV; ++j) s[r][j] = _mm512_setzero_ps();
    for (int p = 0; p < NP; ++p) {
      __m512i kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = _mm512_load_si512(kblk + (j * NP + p) * 16);
      for (int r = 0; r < RB; ++r) {
        const __m512i qb = _mm512_set1_epi32(static_cast<int>(qrows[r][p]));
        for (int j = 0; j < NV; ++j) s[r][j] = dot(s[r][j], kv[j], qb);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NV; ++j) _mm512_store_ps(S[r] + 16 * j, s[r][j]);
  }

  void run(const uint32_t* const* qrows, const int64_t* lim, int64_t R, float* O, float* m, float* l) const {
    // R rows (a multiple of RB), row r sees keys < lim[r]; O [R][D], m [R], l [R][16] (lane sums)
    const int64_t kend = *std::max_element(lim, lim + R);
    alignas(64) uint32_t P[RB][KB / 2];
    for (int64_t r = 0; r < R; ++r) {
      m[r] = -std::numeric_limits<float>::infinity();
      _mm512_store_ps(l + 16 * r, _mm512_setzero_ps());
      std::memset(O + r * D, 0, sizeof(float) * D);
    }
    for (int64_t kb = 0; kb < kend; kb += KB) {
      const int nk = static_cast<int>(std::min<int64_t>(KB, kend - kb));
      const int nv = (nk + 15) / 16;
      const uint32_t* kblk = kp + (kb / 16) * NP * 16;
      for (int64_t r0 = 0; r0 < R; r0 += RB) {
        if (kb >= *std::max_element(lim + r0, lim + r0 + RB)) continue;
        alignas(64) float S[RB][KB];
        switch (nv) {
          case 4: scores<4>(kblk, qrows + r0, S); break;
          case 3: scores<3>(kblk, qrows + r0, S); break;
          case 2: scores<2>(kblk, qrows + r0, S); break;
          default: scores<1>(kblk, qrows + r0, S); break;
        }
        // online softmax of each row over this block (keys past a row's limit masked)
        for (int r = 0; r < RB; ++r) {
          const int64_t rr = r0 + r;
          const int64_t visible = lim[rr] - kb;
          __m512 sv[4];
          for (int j = 0; j < 4; ++j) {
            if (j >= nv || 16 * j >= visible) {
              sv[j] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            } else if (16 * j + 16 <= visible) {
              sv[j] = _mm512_mul_ps(_mm512_load_ps(S[r] + 16 * j), _mm512_set1_ps(scale));
            } else {
              const __mmask16 ok = static_cast<__mmask16>((1u << (visible - 16 * j)) - 1);
              sv[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), ok,
                                         _mm512_load_ps(S[r] + 16 * j), _mm512_set1_ps(scale));
            }
          }
          const float bmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(sv[0], sv[1]), _mm512_max_ps(sv[2], sv[3])));
          const float mnew = std::max(m[rr], bmax);
          if (mnew == -std::numeric_limits<float>::infinity()) {  // nothing visible in this block
            std::memset(P[r], 0, sizeof(P[r]));
            continue;
          }
          const float alpha = std::exp(m[rr] - mnew);  // 0 when m was -inf
          const __m512 mv = _mm512_set1_ps(mnew);
          for (int j = 0; j < 4; ++j) sv[j] = exp512(_mm512_sub_ps(sv[j], mv));
          const __m512 sum = _mm512_add_ps(_mm512_add_ps(sv[0], sv[1]), _mm512_add_ps(sv[2], sv[3]));
          m[rr] = mnew;
          if (alpha != 1.f) {
            float* o = O + rr * D;
            const __m512 av = _mm512_set1_ps(alpha);
            for (int d = 0; d < ND; ++d) _mm512_store_ps(o + 16 * d, _mm512_mul_ps(_mm512_load_ps(o + 16 * d), av));
            _mm512_store_ps(l + 16 * rr, _mm512_fmadd_ps(_mm512_load_ps(l + 16 * rr), av, sum));
          } else {
            _mm512_store_ps(l + 16 * rr, _mm512_add_ps(_mm512_load_ps(l + 16 * rr), sum));
          }
          _mm512_store_si512(P[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(sv[1], sv[0])));
          _mm512_store_si512(P[r] + 16, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(sv[3], sv[2])));
        }
        // O += P . V over this block's key pairs
        __m512 o[RB][ND];
        for (int r = 0; r < RB; ++r)
          for (int d = 0; d < ND; ++d) o[r][d] = _mm512_load_ps(O + (r0 + r) * D + 16 * d);
        const int npairs = (nk + 1) / 2;
        const uint32_t* vblk = vp + (kb / 2) * ND * 16;
        for (int mm = 0; mm < npairs; ++mm) {
          __m512i vv[ND];
          for (int d = 0; d < ND; ++d) vv[d] = _mm512_load_si512(vblk + (mm * ND + d) * 16);
          for (int r = 0; r < RB; ++r) {
            const __m512i pb = _mm512_set1_epi32(static_cast<int>(P[r][mm]));
            for (int d = 0; d < ND; ++d) o[r][d] = dot(o[r][d], vv[d], pb);
          }
        }
        for (int r = 0; r < RB; ++r)
          for (int d = 0; d < ND; ++d) _mm512_store_ps(O + (r0 + r) * D + 16 * d, o[r][d]);
      }
    }
  }
};

// A 64-byte aligned buffer of at least `bytes`, kept per thread and slot and grown on demand: the
// packed K / V of a call (slot 0, calling thread) and each task's accumulators (slot 1) are not
// allocated afresh per layer (large fresh allocations cost page faults and zeroing every call).
void* scratch(int slot, size_t bytes) {
  struct Buf {
    void* p = nullptr;
    size_t n = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf bufs[2];
  Buf& b = bufs[slot];
  if (b.n < bytes) {
    const size_t n = (std::max(bytes, b.n * 2) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, n);
    TORCH_CHECK(p != nullptr, "kvtier prefill kernel: out of memory (", n, " bytes)");
    std::free(b.p);
    b.p = p;
    b.n = n;
  }
  return b.p;
}

// keys of head h into kp [ceil(L/16)][D/2][16] dwords (zero past L)
void pack_keys(const torch::Tensor& k, int64_t h, int64_t D, uint32_t* kp) {
  const int64_t L = k.size(0), NP = D / 2, s0 = k.stride(0), s1 = k.stride(1);
  const uint16_t* base = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()) + h * s1;
  const int64_t blocks = (L + 15) / 16;
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* dst = kp + b * NP * 16;
    for (int t = 0; t < 16; ++t) {
      const int64_t j = b * 16 + t;
      if (j < L) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(base + j * s0);
        for (int64_t p = 0; p < NP; ++p) dst[p * 16 + t] = row[p];
      } else {
        for (int64_t p = 0; p < NP; ++p) dst[p * 16 + t] = 0;
      }
    }
  }
}

// values of head h into vp [ceil(L/2)][D/16][16] dwords: lane c of (pair m, vector d) holds
// (v[2m, 16d + c], v[2m + 1, 16d + c]) (zero past L)
void pack_values(const torch::Tensor& v, int64_t h, int64_t D, uint32_t* vp) {
  const int64_t L = v.size(0), ND = D / 16, s0 = v.stride(0), s1 = v.stride(1);
  const uint16_t* base = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()) + h * s1;
  const int64_t pairs = (L + 1) / 2;
  for (int64_t mm = 0; mm < pairs; ++mm) {
    const uint16_t* a = base + (2 * mm) * s0;
    const uint16_t* b = 2 * mm + 1 < L ? base + (2 * mm + 1) * s0 : nullptr;
    uint32_t* dst = vp + mm * ND * 16;
    for (int64_t c = 0; c < D; ++c) dst[c] = uint32_t(a[c]) | (b ? uint32_t(b[c]) << 16 : 0u);
  }
}

template <int D>
void attend_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& out,
                 double scale) {
  const int64_t n = q.size(0), Hq = q.size(1), L = k.size(0), H = k.size(1), G = Hq / H, c = L - n;
  const int64_t NP = D / 2, ND = D / 16;
  const int64_t kblocks = (L + 15) / 16, pairs = (L + 1) / 2;
  const int64_t kstride = ((kblocks + 3) / 4 * 4) * NP * 16, vstride = ((pairs + 31) / 32 * 32) * ND * 16;
  // packed K / V of every head (padded to whole 64-key blocks, zero-filled there)
  uint32_t* kp = static_cast<uint32_t*>(scratch(0, sizeof(uint32_t) * (H * (kstride + vstride) + 16)));
  uint32_t* vp = kp + H * kstride;
  at::parallel_for(0, 2 * H, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t h = t / 2;
      if (t % 2 == 0) {
        pack_keys(k, h, D, kp + h * kstride);
        std::memset(kp + h * kstride + kblocks * NP * 16, 0, sizeof(uint32_t) * (kstride - kblocks * NP * 16));
      } else {
        pack_values(v, h, D, vp + h * vstride);
        std::memset(vp + h * vstride + pairs * ND * 16, 0, sizeof(uint32_t) * (vstride - pairs * ND * 16));
      }
    }
  });
  const int64_t tiles = (n + QT - 1) / QT, tasks = tiles * H;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const uint16_t* qb = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* ob = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, tasks, 1, [&](int64_t b, int64_t e) {
    constexpr int RB = Task<D>::RB;
    std::vector<float> m;
    std::vector<const uint32_t*> qrows;
    std::vector<int64_t> lim;
    std::vector<std::pair<int64_t, int64_t>> who;  // (token, query head) of each row
    float* Obuf = static_cast<float*>(scratch(1, sizeof(float) * (QT * G + RB) * (D + 16)));
    float* lbuf = Obuf + (QT * G + RB) * D;  // [rows][16] lane sums
    for (int64_t t = b; t < e; ++t) {
      // interleave early and late tiles: t = 0, 1, 2, 3, ... -> tile 0, last, 1, last - 1, ...
      const int64_t h = t % H, u = t / H;
      const int64_t tile = u % 2 == 0 ? u / 2 : tiles - 1 - u / 2;
      const int64_t i0 = tile * QT, i1 = std::min(n, i0 + QT);
      qrows.clear();
      lim.clear();
      who.clear();
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t hq = h * G + g;
          qrows.push_back(reinterpret_cast<const uint32_t*>(qb + i * qs0 + hq * qs1));
          lim.push_back(c + i + 1);
          who.emplace_back(i, hq);
        }
      const int64_t R = static_cast<int64_t>(qrows.size());
      while (qrows.size() % RB) {  // pad to whole row groups (duplicates, not written)
        qrows.push_back(qrows.back());
        lim.push_back(lim.back());
      }
      const int64_t Rp = static_cast<int64_t>(qrows.size());
      m.resize(Rp);
      Task<D> task{kp + h * kstride, vp + h * vstride, L, c, static_cast<float>(scale)};
      task.run(qrows.data(), lim.data(), Rp, Obuf, m.data(), lbuf);
      for (int64_t r = 0; r < R; ++r) {
        const float inv = 1.f / _mm512_reduce_add_ps(_mm512_load_ps(lbuf + 16 * r));
        uint16_t* dst = ob + who[r].first * os0 + who[r].second * os1;
        for (int64_t d = 0; d < D; d += 32) {
          const __m512 a = _mm512_mul_ps(_mm512_load_ps(Obuf + r * D + d), _mm512_set1_ps(inv));
          const __m512 bb = _mm512_mul_ps(_mm512_load_ps(Obuf + r * D + d + 16), _mm512_set1_ps(inv));
          _mm512_storeu_si512(dst + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(bb, a)));
        }
      }
    }
  });
}
#else
constexpr bool kSupported = false;
#endif

void check(const torch::Tensor& x, const char* what, int64_t heads, int64_t D) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 3, what,
              ": expected a CPU bfloat16 tensor [tokens, heads, D]");
  TORCH_CHECK(x.stride(2) == 1 && x.size(2) == D && (heads < 0 || x.size(1) == heads), what, " ",
              x.sizes(), ": expected a contiguous last dim of ", D);
  TORCH_CHECK(x.stride(0) % 2 == 0 && x.stride(1) % 2 == 0, what, ": row strides must be even");
}

}  // namespace

bool prefill_supported() { return kSupported; }

void prefill_attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale) {
  TORCH_CHECK(kSupported, "kvtier prefill kernel: this CPU build has no AVX-512 BF16");
  const int64_t D = q.size(-1);
  TORCH_CHECK(D == 64 || D == 128, "kvtier prefill kernel: head_dim ", D, " is not supported (64 or 128)");
  check(q, "q", -1, D);
  check(k, "k", -1, D);
  check(v, "v", k.size(1), D);
  check(out, "out", q.size(1), D);
  TORCH_CHECK(v.size(0) == k.size(0) && out.size(0) == q.size(0), "q/out and k/v token counts differ");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads ", q.size(1), " not a multiple of KV heads ", k.size(1));
  TORCH_CHECK(k.size(0) >= q.size(0), "fewer keys (", k.size(0), ") than queries (", q.size(0), ")");
  const uintptr_t align = reinterpret_cast<uintptr_t>(q.data_ptr()) | reinterpret_cast<uintptr_t>(k.data_ptr()) |
                          reinterpret_cast<uintptr_t>(v.data_ptr());
  TORCH_CHECK(align % 4 == 0, "q/k/v must be 4-byte aligned");
  if (q.size(0) == 0) return;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (D == 64)
    attend_impl<64>(q, k, v, out, scale);
  else
    attend_impl<128>(q, k, v, out, scale);
#endif
}
