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
// prefill_attend_paged: the same with the first P keys read from kvtier's packed vLLM pages (4-bit
// keys per channel, 4- or 3-bit values per token: kvtier/codecs/pages.py) and the rest exact. Codes
// are exact in bf16, so they are packed like exact keys and values, and the scales move to the other
// operand: a packed key block is scored with q_d * s_d split into bf16 hi + lo (exact to ~2^-17 of
// it) minus sum_d q_d s_d z_d; a packed value is read as its centred code c - h (h = 2^(vb-1), exact
// in bf16) weighted by p_t * s_t rounded to bf16 (as p is), and sum_t p_t s_t (z_t - h) is subtracted
// from the row's output (a per-row sum rescaled with it). Centring keeps the rounding error of p s
// (times |c - h| <= h) near that of p times |v| instead of p times |v - min|.
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
#include "page_codes.h"
#include "numeric.h"

namespace {

constexpr int KB = 64;  // keys per softmax block

// The packed pages a call's first P keys come from (PageFormat's byte offsets; P = pages * T)
struct Pages {
  int64_t P = 0;
  const uint8_t* const* page = nullptr;  // [P / T] page of each T keys
  int64_t T = 0, kg = 0, vb = 4, kscale = 0, kzero = 0, vscale = 0, vzero = 0, kcodes = 0, vcodes = 0;
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kSupported = true;

constexpr int QT = 16;  // query tokens per task

// bf16 bits of a small integer (|c| <= 256: exact in bf16)
inline uint16_t int_bf16(int c) {
  const float f = static_cast<float>(c);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// x [n] fp32 (n a multiple of 32) as bf16 hi + lo dword pairs (kvtier_pages::split_bf16_32)
inline void split_pairs(const float* x, int64_t n, uint32_t* hi, uint32_t* lo) {
  for (int64_t j = 0; j < n; j += 32) {
    __m512i h, l;
    kvtier_pages::split_bf16_32(x + j, h, l);
    _mm512_storeu_si512(hi + j / 2, h);
    _mm512_storeu_si512(lo + j / 2, l);
  }
}

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
  const Pages* pg = nullptr;  // the first pg->P keys are packed (every row sees them all)
  int64_t h = 0;              // KV head
  const float* vs = nullptr;  // [P] value scale of each packed token of head h
  const float* vsz = nullptr;  // [P] its scale * zero

  // qh / ql / zt of R rows for the key group of packed key kb: q_d s_d as hi + lo, sum_d q_d s_d z_d
  void scale_rows(const uint32_t* const* qrows, int64_t R, int64_t kb, uint32_t* qh, uint32_t* ql, float* zt) const {
    const int64_t i = kb / pg->T, g = (kb % pg->T) / pg->kg, nkg = pg->T / pg->kg;
    const uint8_t* page = pg->page[i];
    const at::Half* ks = reinterpret_cast<const at::Half*>(page + pg->kscale) + (h * nkg + g) * D;
    const at::Half* kz = reinterpret_cast<const at::Half*>(page + pg->kzero) + (h * nkg + g) * D;
    alignas(64) float sf[D], zf[D], x[D];
    for (int d = 0; d < D; ++d) {
      sf[d] = static_cast<float>(ks[d]);
      zf[d] = static_cast<float>(kz[d]);
    }
    for (int64_t r = 0; r < R; ++r) {
      const uint16_t* q = reinterpret_cast<const uint16_t*>(qrows[r]);
      float z = 0.f;
      for (int d = 0; d < D; ++d) {
        x[d] = bf16_to_float(q[d]) * sf[d];
        z += x[d] * zf[d];
      }
      split_pairs(x, D, qh + r * NP, ql + r * NP);
      zt[r] = z;
    }
  }

  // S[r][0 : 16 NV] = scores of rows qrows[0 .. RB) against the NV key vectors of kblk; with qlo
  // (packed key codes: the rows' q * s split into bf16 hi = qrows and lo = qlo), the sum of both
  template <int NV, bool LO = false>
  static inline void scores(const uint32_t* kblk, const uint32_t* const* qrows, float (*S)[KB],
                            const uint32_t* const* qlo = nullptr) {
    __m512 s[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NV; ++j) s[r][j] = _mm512_setzero_ps();
    for (int p = 0; p < NP; ++p) {
      __m512i kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = _mm512_load_si512(kblk + (j * NP + p) * 16);
      for (int r = 0; r < RB; ++r) {
        const __m512i qb = _mm512_set1_epi32(static_cast<int>(qrows[r][p]));
        if constexpr (LO) {
          const __m512i lb = _mm512_set1_epi32(static_cast<int>(qlo[r][p]));
          for (int j = 0; j < NV; ++j) s[r][j] = dot_bf16(dot_bf16(s[r][j], kv[j], lb), kv[j], qb);
        } else {
          for (int j = 0; j < NV; ++j) s[r][j] = dot_bf16(s[r][j], kv[j], qb);
        }
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NV; ++j) _mm512_store_ps(S[r] + 16 * j, s[r][j]);
  }

  // S[r][0 : 16 nv] = scores of the RB rows from r0 of qrows against this block's keys (packed keys: the
  // rows' q * s as bf16 hi + lo against the codes; zt is subtracted in softmax_rows)
  static inline void block_scores(const uint32_t* kblk, bool packed, int nv, const uint32_t* const* qrows,
                                  const uint32_t* const* qhr, const uint32_t* const* qlr, int64_t r0, float (*S)[KB]) {
    if (packed) {
      scores<4, true>(kblk, qhr + r0, S, qlr + r0);
    } else {
      switch (nv) {
        case 4: scores<4>(kblk, qrows + r0, S); break;
        case 3: scores<3>(kblk, qrows + r0, S); break;
        case 2: scores<2>(kblk, qrows + r0, S); break;
        default: scores<1>(kblk, qrows + r0, S); break;
      }
    }
  }

  // Online softmax of the RB rows from r0 over this block's scores S (keys past a row's limit
  // masked): m, l, za and the rows' O rescaled to the new max; P[r] = the weights as bf16 pairs
  // (packed values: times each token's value scale, with sum p s z into za).
  inline void softmax_rows(const float (*S)[KB], int64_t r0, int64_t kb, int nv, bool packed, const int64_t* lim,
                           const float* zt, float* O, float* m, float* l, float* za, int64_t P0,
                           uint32_t (*P)[KB / 2]) const {
    for (int r = 0; r < RB; ++r) {
      const int64_t rr = r0 + r;
      const int64_t visible = lim[rr] - kb;
      __m512 sv[4];
      for (int j = 0; j < 4; ++j) {
        if (packed) {
          sv[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(S[r] + 16 * j), _mm512_set1_ps(zt[rr])),
                                _mm512_set1_ps(scale));
        } else if (j >= nv || 16 * j >= visible) {
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
        if (P0) _mm512_store_ps(za + 16 * rr, _mm512_mul_ps(_mm512_load_ps(za + 16 * rr), av));
      } else {
        _mm512_store_ps(l + 16 * rr, _mm512_add_ps(_mm512_load_ps(l + 16 * rr), sum));
      }
      if (packed) {  // values: p_t s_t (rounded below) times codes, minus sum_t p_t s_t z_t
        __m512 zs = _mm512_load_ps(za + 16 * rr);
        for (int j = 0; j < 4; ++j) {
          zs = _mm512_fmadd_ps(sv[j], _mm512_loadu_ps(vsz + kb + 16 * j), zs);
          sv[j] = _mm512_mul_ps(sv[j], _mm512_loadu_ps(vs + kb + 16 * j));
        }
        _mm512_store_ps(za + 16 * rr, zs);
      }
      _mm512_store_si512(P[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(sv[1], sv[0])));
      _mm512_store_si512(P[r] + 16, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(sv[3], sv[2])));
    }
  }

  // O [RB][D] += P . V over this block's key pairs (vblk: its values, nk keys)
  static inline void add_values(const uint32_t* vblk, int nk, const uint32_t (*P)[KB / 2], float* O) {
    __m512 o[RB][ND];
    for (int r = 0; r < RB; ++r)
      for (int d = 0; d < ND; ++d) o[r][d] = _mm512_load_ps(O + r * D + 16 * d);
    const int npairs = (nk + 1) / 2;
    for (int mm = 0; mm < npairs; ++mm) {
      __m512i vv[ND];
      for (int d = 0; d < ND; ++d) vv[d] = _mm512_load_si512(vblk + (mm * ND + d) * 16);
      for (int r = 0; r < RB; ++r) {
        const __m512i pb = _mm512_set1_epi32(static_cast<int>(P[r][mm]));
        for (int d = 0; d < ND; ++d) o[r][d] = dot_bf16(o[r][d], vv[d], pb);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int d = 0; d < ND; ++d) _mm512_store_ps(O + r * D + 16 * d, o[r][d]);
  }

  void run(const uint32_t* const* qrows, const int64_t* lim, int64_t R, float* O, float* m, float* l,
           float* za) const {
    // R rows (a multiple of RB), row r sees keys < lim[r]; O [R][D], m [R], l [R][16] (lane sums),
    // za [R][16] (lane sums of p_t s_t z_t over packed values)
    const int64_t kend = *std::max_element(lim, lim + R);
    const int64_t P0 = pg ? pg->P : 0;
    alignas(64) uint32_t P[RB][KB / 2];
    std::vector<uint32_t> qh(P0 ? R * NP : 0), ql(P0 ? R * NP : 0);
    std::vector<const uint32_t*> qhr(P0 ? R : 0), qlr(P0 ? R : 0);  // their rows
    for (int64_t r = 0; r < (P0 ? R : 0); ++r) {
      qhr[r] = qh.data() + r * NP;
      qlr[r] = ql.data() + r * NP;
    }
    std::vector<float> zt(P0 ? R : 0);
    for (int64_t r = 0; r < R; ++r) {
      m[r] = -std::numeric_limits<float>::infinity();
      _mm512_store_ps(l + 16 * r, _mm512_setzero_ps());
      _mm512_store_ps(za + 16 * r, _mm512_setzero_ps());
      std::memset(O + r * D, 0, sizeof(float) * D);
    }
    for (int64_t kb = 0; kb < kend; kb += KB) {
      const int nk = static_cast<int>(std::min<int64_t>(KB, kend - kb));
      const int nv = (nk + 15) / 16;
      const uint32_t* kblk = kp + (kb / 16) * NP * 16;
      const bool packed = kb < P0;  // a whole block of 64 packed keys, visible to every row
      if (packed && kb % pg->kg == 0) scale_rows(qrows, R, kb, qh.data(), ql.data(), zt.data());
      for (int64_t r0 = 0; r0 < R; r0 += RB) {
        if (kb >= *std::max_element(lim + r0, lim + r0 + RB)) continue;
        alignas(64) float S[RB][KB];
        block_scores(kblk, packed, nv, qrows, qhr.data(), qlr.data(), r0, S);
        softmax_rows(S, r0, kb, nv, packed, lim, zt.data(), O, m, l, za, P0, P);
        add_values(vp + (kb / 2) * ND * 16, nk, P, O + r0 * D);
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

// keys of head h into kp [ceil(L/16)][D/2][16] dwords (zero past L): the first pg.P from the pages'
// codes (as bf16 integers), then the exact rows of k
void pack_keys(const torch::Tensor& k, const Pages& pg, int64_t h, int64_t D, uint32_t* kp) {
  const int64_t Le = k.size(0), L = pg.P + Le, NP = D / 2, s0 = k.stride(0), s1 = k.stride(1);
  const uint16_t* base = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()) + h * s1;
  const int64_t blocks = (L + 15) / 16;
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* dst = kp + b * NP * 16;
    for (int t = 0; t < 16; ++t) {
      const int64_t j = b * 16 + t;
      if (j < pg.P) {
        const uint8_t* c = pg.page[j / pg.T] + pg.kcodes + (h * pg.T + j % pg.T) * (D / 2);
        for (int64_t p = 0; p < NP; ++p)
          dst[p * 16 + t] = uint32_t(int_bf16(c[p] & 15)) | uint32_t(int_bf16(c[p] >> 4)) << 16;
      } else if (j < L) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(base + (j - pg.P) * s0);
        for (int64_t p = 0; p < NP; ++p) dst[p * 16 + t] = row[p];
      } else {
        for (int64_t p = 0; p < NP; ++p) dst[p * 16 + t] = 0;
      }
    }
  }
}

// values of head h into vp [ceil(L/2)][D/16][16] dwords: lane c of (pair m, vector d) holds
// (v[2m, 16d + c], v[2m + 1, 16d + c]) (zero past L); the first pg.P from the pages' codes, with
// their scale and scale * (zero - h) into vs, vsz [P], codes read centred (c - h, h = 2^(vb-1))
void pack_values(const torch::Tensor& v, const Pages& pg, int64_t h, int64_t D, uint32_t* vp, float* vs, float* vsz) {
  const int64_t Le = v.size(0), L = pg.P + Le, ND = D / 16, s0 = v.stride(0), s1 = v.stride(1);
  const uint16_t* base = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()) + h * s1;
  const int64_t pairs = (L + 1) / 2, cb = D * pg.vb / 8;
  uint16_t a[512], b[512];
  const int half = 1 << (pg.vb - 1);
  for (int64_t mm = 0; mm < pairs; ++mm) {
    uint32_t* dst = vp + mm * ND * 16;
    if (2 * mm < pg.P) {  // two packed tokens (P is even)
      for (int u = 0; u < 2; ++u) {
        const int64_t j = 2 * mm + u, t = j % pg.T;
        const uint8_t* page = pg.page[j / pg.T];
        const uint8_t* c = page + pg.vcodes + (h * pg.T + t) * cb;
        uint16_t* x = u ? b : a;
        for (int64_t d = 0; d < D; ++d) x[d] = int_bf16(kvtier_pages::code_at(c, d, pg.vb, D) - half);
        const float sc = static_cast<float>(reinterpret_cast<const at::Half*>(page + pg.vscale)[h * pg.T + t]);
        const float z = static_cast<float>(reinterpret_cast<const at::Half*>(page + pg.vzero)[h * pg.T + t]);
        vs[j] = sc;
        vsz[j] = sc * (z - static_cast<float>(half));
      }
      for (int64_t c = 0; c < D; ++c) dst[c] = uint32_t(a[c]) | uint32_t(b[c]) << 16;
      continue;
    }
    const uint16_t* ra = base + (2 * mm - pg.P) * s0;
    const uint16_t* rb = 2 * mm + 1 < L ? base + (2 * mm + 1 - pg.P) * s0 : nullptr;
    for (int64_t c = 0; c < D; ++c) dst[c] = uint32_t(ra[c]) | (rb ? uint32_t(rb[c]) << 16 : 0u);
  }
}

template <int D>
void attend_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& out,
                 double scale, const Pages& pg) {
  const int64_t n = q.size(0), Hq = q.size(1), L = pg.P + k.size(0), H = k.size(1), G = Hq / H, c = L - n;
  const int64_t NP = D / 2, ND = D / 16;
  const int64_t kblocks = (L + 15) / 16, pairs = (L + 1) / 2;
  const int64_t kstride = ((kblocks + 3) / 4 * 4) * NP * 16, vstride = ((pairs + 31) / 32 * 32) * ND * 16;
  // packed K / V of every head (padded to whole 64-key blocks, zero-filled there), then the packed
  // tokens' value scales and scale * zero [H][P]
  uint32_t* kp = static_cast<uint32_t*>(scratch(0, sizeof(uint32_t) * (H * (kstride + vstride + 2 * pg.P) + 16)));
  uint32_t* vp = kp + H * kstride;
  float* vsf = reinterpret_cast<float*>(vp + H * vstride);
  float* vszf = vsf + H * pg.P;
  at::parallel_for(0, 2 * H, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t h = t / 2;
      if (t % 2 == 0) {
        pack_keys(k, pg, h, D, kp + h * kstride);
        std::memset(kp + h * kstride + kblocks * NP * 16, 0, sizeof(uint32_t) * (kstride - kblocks * NP * 16));
      } else {
        pack_values(v, pg, h, D, vp + h * vstride, vsf + h * pg.P, vszf + h * pg.P);
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
    float* Obuf = static_cast<float*>(scratch(1, sizeof(float) * (QT * G + RB) * (D + 32)));
    float* lbuf = Obuf + (QT * G + RB) * D;  // [rows][16] lane sums
    float* zbuf = lbuf + (QT * G + RB) * 16;  // [rows][16] lane sums of p s z over packed values
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
      Task<D> task{kp + h * kstride, vp + h * vstride, L, c, static_cast<float>(scale), pg.P ? &pg : nullptr, h,
                   vsf + h * pg.P, vszf + h * pg.P};
      task.run(qrows.data(), lim.data(), Rp, Obuf, m.data(), lbuf, zbuf);
      for (int64_t r = 0; r < R; ++r) {
        const float inv = 1.f / _mm512_reduce_add_ps(_mm512_load_ps(lbuf + 16 * r));
        const __m512 zsum = _mm512_set1_ps(pg.P ? _mm512_reduce_add_ps(_mm512_load_ps(zbuf + 16 * r)) : 0.f);
        uint16_t* dst = ob + who[r].first * os0 + who[r].second * os1;
        for (int64_t d = 0; d < D; d += 32) {
          const __m512 a = _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(Obuf + r * D + d), zsum), _mm512_set1_ps(inv));
          const __m512 bb = _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(Obuf + r * D + d + 16), zsum), _mm512_set1_ps(inv));
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

namespace {
// The pages prefill_attend_paged reads: T and key groups in multiples of 64, no sink tokens, one value
// group per row, 4- or 3-bit values
bool paged_supported_layout(const kvtier_pages::Layout& L) {
  return L.T % KB == 0 && L.kg % KB == 0 && L.T % L.kg == 0 && L.s == 0 && L.vg >= L.D && (L.vb == 4 || L.vb == 3);
}
}  // namespace

bool prefill_paged_supported(std::vector<int64_t> lay) {
  if (lay.size() != 15 || (lay[14] != 4 && lay[14] != 3)) return false;
  return paged_supported_layout(kvtier_pages::read_layout(lay));
}

namespace {
void attend_checked(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale, const Pages& pg);
}

void prefill_attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale) {
  attend_checked(q, k, v, out, scale, Pages{});
}

void prefill_attend_paged(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale,
    torch::Tensor pages,       // uint8 [B, page]
    torch::Tensor pids,        // int64 [np]: the pages of the first np * T keys, in order
    std::vector<int64_t> lay   // PageFormat.layout(): H, D, T, kg, vg, s, page, offsets (7), vb
) {
  const kvtier_pages::Layout L = kvtier_pages::read_layout(lay);
  TORCH_CHECK(L.H == k.size(1) && L.D == q.size(-1), "layout: heads / head_dim differ from k");
  TORCH_CHECK(paged_supported_layout(L),
              "kvtier paged prefill: pages of T and key groups in multiples of 64, no sink tokens, one value group "
              "per row, 4- or 3-bit values");
  TORCH_CHECK(pages.is_contiguous() && pages.dim() == 2 && pages.size(1) == L.page && pages.scalar_type() == at::kByte,
              "pages: contiguous uint8 [B, page]");
  TORCH_CHECK(pids.scalar_type() == at::kLong && pids.is_contiguous() && pids.dim() == 1, "pids: contiguous int64 [np]");
  const int64_t np = pids.size(0), B = pages.size(0);
  std::vector<const uint8_t*> ptr(np);
  const int64_t* id = pids.data_ptr<int64_t>();
  for (int64_t i = 0; i < np; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < B, "pids: page ", id[i], " out of range");
    ptr[i] = pages.data_ptr<uint8_t>() + id[i] * L.page;
  }
  const Pages pg{np * L.T, ptr.data(), L.T, L.kg, L.vb, L.kscale, L.kzero, L.vscale, L.vzero, L.kcodes, L.vcodes};
  attend_checked(q, k, v, out, scale, pg);
}

namespace {
void attend_checked(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale, const Pages& pg) {
  TORCH_CHECK(kSupported, "kvtier prefill kernel: this CPU build has no AVX-512 BF16");
  const int64_t D = q.size(-1);
  TORCH_CHECK(D == 64 || D == 128, "kvtier prefill kernel: head_dim ", D, " is not supported (64 or 128)");
  check(q, "q", -1, D);
  check(k, "k", -1, D);
  check(v, "v", k.size(1), D);
  check(out, "out", q.size(1), D);
  TORCH_CHECK(v.size(0) == k.size(0) && out.size(0) == q.size(0), "q/out and k/v token counts differ");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads ", q.size(1), " not a multiple of KV heads ", k.size(1));
  TORCH_CHECK(k.size(0) >= q.size(0), "fewer keys (", k.size(0), " exact) than queries (", q.size(0), ")");
  const uintptr_t align = reinterpret_cast<uintptr_t>(q.data_ptr()) | reinterpret_cast<uintptr_t>(k.data_ptr()) |
                          reinterpret_cast<uintptr_t>(v.data_ptr());
  TORCH_CHECK(align % 4 == 0, "q/k/v must be 4-byte aligned");
  if (q.size(0) == 0) return;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (D == 64)
    attend_impl<64>(q, k, v, out, scale, pg);
  else
    attend_impl<128>(q, k, v, out, scale, pg);
#endif
}
}  // namespace
