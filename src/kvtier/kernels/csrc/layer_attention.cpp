// layer_attention: one decode step over a whole tiered layer (exact segments, packed affine tiers
// and vector-code tiers, merged by log-sum-exp), built by kvtier/kernels/fused_cpu.py (which
// documents the arguments and the per-tier path it replaces and is tested against). A vq tier is
// read by vq_tier.h's routine, the one the tier-alone vq kernel (vq_attention.cpp) runs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "common.h"
#include "numeric.h"
#include "vq_tier.h"

namespace {

// --- fixed-shape code paths: (bits, D) known at compile time, so every loop unrolls into SIMD ---
constexpr int width_at(int bits, int k) {
  constexpr int W[9][3] = {{0, 0, 0}, {1, 0, 0}, {2, 0, 0}, {2, 1, 0}, {4, 0, 0},
                           {4, 1, 0}, {4, 2, 0}, {4, 2, 1}, {8, 0, 0}};
  return W[bits][k];
}
constexpr int npad_of(int bits, int D) { return bits == 8 ? D : (D + 7) / 8 * 8; }
// Positions the fast path unpacks a token into: codes of <= 3 bits are whole codes in channel
// order (their 2- and 1-bit planes combined); wider ones one position per plane and channel.
constexpr bool combined(int bits) { return bits <= 3; }
constexpr int npos_of(int bits, int D) {
  const int planes = (width_at(bits, 0) > 0) + (width_at(bits, 1) > 0) + (width_at(bits, 2) > 0);
  return combined(bits) ? npad_of(bits, D) : npad_of(bits, D) * planes;
}

// Byte -> its 4 two-bit sub-values as floats, in channel order (one-bit ones: numeric.h's kBits).
struct Bits4x2 {
  alignas(16) float v[256][4];
  Bits4x2() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 4; ++i) v[b][i] = float((b >> (2 * i)) & 3);
  }
};
const Bits4x2 kBits2;

// True when the fast path lays a width-W plane out in channel order (a table lookup per byte);
// wider planes stay in term order (each term is one shift of every byte: a SIMD loop).
constexpr bool lut_plane(int W) { return W == 1 || W == 2; }

template <int W, int NPAD>
inline void plane(const uint8_t* __restrict code, float* __restrict u) {
  constexpr int per = 8 / W, size = NPAD / per, mask = (1 << W) - 1;
  if constexpr (W == 1) {
    for (int j = 0; j < size; ++j) std::memcpy(u + 8 * j, kBits.v[code[j]], 8 * sizeof(float));
  } else if constexpr (W == 2) {
    for (int j = 0; j < size; ++j) std::memcpy(u + 4 * j, kBits2.v[code[j]], 4 * sizeof(float));
  } else {
    for (int i = 0; i < per; ++i) {
#pragma omp simd
      for (int j = 0; j < size; ++j) u[i * size + j] = float((code[j] >> (W * i)) & mask);
    }
  }
}

// Codes of one token in term order (kvtier.quant.pack_bits layout) as floats.
template <int BITS, int D>
inline void unpack_t(const uint8_t* __restrict code, float* __restrict u) {
  constexpr int NPAD = npad_of(BITS, D), W0 = width_at(BITS, 0), W1 = width_at(BITS, 1), W2 = width_at(BITS, 2);
  if constexpr (BITS == 3) {  // whole codes: 2-bit plane + 4 x 1-bit plane, channel order
    alignas(64) float hi[NPAD];
    plane<2, NPAD>(code, u);
    plane<1, NPAD>(code + NPAD / 4, hi);
#pragma omp simd
    for (int c = 0; c < NPAD; ++c) u[c] += 4.f * hi[c];
    return;
  }
  plane<W0, NPAD>(code, u);
  if constexpr (W1 > 0) plane<W1, NPAD>(code + NPAD / (8 / W0), u + NPAD);
  if constexpr (W2 > 0) plane<W2, NPAD>(code + NPAD / (8 / W0) + NPAD / (8 / W1), u + 2 * NPAD);
}

// s[r * N + tt] = bias[r] + qs[r] . codes(tt) for the T tokens of one block (NEG where invalid).
using ScoreFn = void (*)(const uint8_t*, const bool*, int64_t, int64_t, int64_t, const float*, const float*, float*,
                         int64_t);
// Unpack one token's codes, or acc += p * u over all positions.
using UnpackFn = void (*)(const uint8_t*, float*);
using AxpyFn = void (*)(float, const float*, float*);

template <int BITS, int D>
void scores_t(const uint8_t* codes, const bool* okb, int64_t T, int64_t P, int64_t R, const float* qs,
              const float* bias, float* s, int64_t N) {
  constexpr int NPOS = npos_of(BITS, D);
#if defined(__AVX512F__)
  if constexpr (NPOS % 16 == 0) {  // 16 tokens at a time: lane partials, then one transpose-and-add tree
    alignas(64) float u16[16 * NPOS];
    alignas(64) float out[16];
    for (int64_t t0 = 0; t0 < T; t0 += 16) {
      const int64_t nt = std::min<int64_t>(16, T - t0);
      for (int64_t i = 0; i < 16; ++i) {
        if (i < nt && okb[t0 + i]) unpack_t<BITS, D>(codes + (t0 + i) * P, u16 + i * NPOS);
        else std::memset(u16 + i * NPOS, 0, NPOS * sizeof(float));
      }
      for (int64_t r = 0; r < R; ++r) {
        const float* q = qs + r * NPOS;
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) {
          const float* uu = u16 + i * NPOS;
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_load_ps(uu));
          for (int k = 16; k < NPOS; k += 16) x = _mm512_fmadd_ps(_mm512_loadu_ps(q + k), _mm512_load_ps(uu + k), x);
          acc[i] = x;
        }
        _mm512_store_ps(out, _mm512_add_ps(reduce16(acc), _mm512_set1_ps(bias[r])));
        for (int64_t i = 0; i < nt; ++i) s[r * N + t0 + i] = okb[t0 + i] ? out[i] : NEG;
      }
    }
    return;
  }
#endif
  alignas(64) float u[NPOS];
  for (int64_t tt = 0; tt < T; ++tt) {
    if (!okb[tt]) {
      for (int64_t r = 0; r < R; ++r) s[r * N + tt] = NEG;
      continue;
    }
    unpack_t<BITS, D>(codes + tt * P, u);
    for (int64_t r = 0; r < R; ++r) s[r * N + tt] = bias[r] + dot_t<NPOS>(qs + r * NPOS, u);
  }
}

template <int BITS, int D>
void unpack_fn(const uint8_t* code, float* u) { unpack_t<BITS, D>(code, u); }

template <int NPOS>
void axpy_t(float a, const float* __restrict x, float* __restrict y) {
#pragma omp simd
  for (int j = 0; j < NPOS; ++j) y[j] += a * x[j];
}

struct Fast {
  ScoreFn scores = nullptr;
  UnpackFn unpack = nullptr;
  AxpyFn axpy = nullptr;
};

template <int D>
Fast fast_for_bits(int64_t bits) {
  switch (bits) {
    case 1: return {scores_t<1, D>, unpack_fn<1, D>, axpy_t<npos_of(1, D)>};
    case 2: return {scores_t<2, D>, unpack_fn<2, D>, axpy_t<npos_of(2, D)>};
    case 3: return {scores_t<3, D>, unpack_fn<3, D>, axpy_t<npos_of(3, D)>};
    case 4: return {scores_t<4, D>, unpack_fn<4, D>, axpy_t<npos_of(4, D)>};
    case 6: return {scores_t<6, D>, unpack_fn<6, D>, axpy_t<npos_of(6, D)>};
    case 8: return {scores_t<8, D>, unpack_fn<8, D>, axpy_t<npos_of(8, D)>};
    default: return {};
  }
}

// The compiled fixed-shape path for (bits, D), or empty (the runtime loops run instead).
Fast fast_for(int64_t bits, int64_t D) {
  if (D == 64) return fast_for_bits<64>(bits);
  if (D == 128) return fast_for_bits<128>(bits);
  return {};
}

// One row of D exact values as floats.
inline void load_row(const void* p, int64_t kind, int64_t D, float* out) {
  if (kind == 0) {
    std::memcpy(out, p, D * sizeof(float));
  } else if (kind == 1) {  // float16
    halves_to_floats8(static_cast<const uint16_t*>(p), out, D);
  } else {  // bfloat16
    bf16s_to_floats(static_cast<const uint16_t*>(p), out, D);
  }
}

// fp8 e4m3fn byte -> float (metadata of tiers stored with fp8 parameters).
struct Fp8Lut {
  float v[256];
  Fp8Lut() {
    for (int b = 0; b < 256; ++b) v[b] = static_cast<float>(c10::Float8_e4m3fn(uint8_t(b), c10::Float8_e4m3fn::from_bits()));
  }
};
const Fp8Lut kFp8;

struct Exact {
  const uint8_t* k;
  const uint8_t* v;
  int64_t kind, esize, sB, sH, sL, L;  // strides in elements
  const bool* mask;
  int64_t mB, mR, mL;  // mask strides (0 = broadcast)
};

// Affine metadata as stored (kind 0 fp32, 1 fp16, 3 fp8 e4m3fn), x = a * code + b with (a, b) from the two stored
// parameters (p1, p2) by the codec's mode (kvtier.codecs.AFFINE_MODES): 0 "ab" a = p1, b = p2;
// 1 "scale_zero" (k-bit) a = p1, b = -p1 * p2; 2 "scale_mean" (sign) a = 2 p1, b = p2 - p1.
struct Meta {
  const void *s, *z;
  int64_t kind;
  int64_t mode;
  inline float f(const void* p, int64_t i) const {
    if (kind == 0) return static_cast<const float*>(p)[i];
    if (kind == 3) return kFp8.v[static_cast<const uint8_t*>(p)[i]];
#if defined(__F16C__)
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
#else
    return static_cast<float>(c10::Half(static_cast<const uint16_t*>(p)[i], c10::Half::from_bits()));
#endif
  }
  // D consecutive values of a and b from element i
  inline void ab(int64_t i, int64_t D, float* a, float* b, float* tmp) const {
    if (kind == 3) {
      const uint8_t* ps = static_cast<const uint8_t*>(s) + i;
      const uint8_t* pz = static_cast<const uint8_t*>(z) + i;
      for (int64_t c = 0; c < D; ++c) { a[c] = kFp8.v[ps[c]]; tmp[c] = kFp8.v[pz[c]]; }
    } else {
      const int64_t esz = kind == 0 ? 4 : 2;
      load_row(static_cast<const uint8_t*>(s) + i * esz, kind, D, a);
      load_row(static_cast<const uint8_t*>(z) + i * esz, kind, D, tmp);
    }
    if (mode == 2) {
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) { b[c] = tmp[c] - a[c]; a[c] *= 2.f; }
    } else if (mode == 1) {
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) b[c] = -a[c] * tmp[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) b[c] = tmp[c];
    }
  }
  inline float a(int64_t i) const { return mode == 2 ? 2.f * f(s, i) : f(s, i); }
  inline float b(int64_t i) const {
    return mode == 2 ? f(z, i) - f(s, i) : mode == 1 ? -f(s, i) * f(z, i) : f(z, i);
  }
};

// The codes of one side of a tier (keys or values: each has its own bit width).
struct Side {
  int64_t bits, P, npos, G;
  std::vector<Term> terms;
  Fast fast;
  // per position of the unpacked codes (the order the path unpacks in): channel (>= D: padding),
  // plane weight, value group
  std::vector<int64_t> pchan, pgroup;
  std::vector<float> pw;
  bool identity = false;  // pchan[k] == k, pw[k] == 1
};

struct Tier {
  const uint8_t *kc, *vc;
  Meta km, vm;
  const float* rot;
  const bool* ok;
  int64_t n, T, NG, G, start;
  Side ks, vs;  // key codes, value codes
};

// Position maps of one side: term order (runtime path), or with lut_plane planes in channel order.
void position_maps(Side& t, int64_t D) {
  t.pchan.clear();
  t.pw.clear();
  if (t.fast.scores && combined((int)t.bits)) {  // whole codes in channel order
    const int64_t npad = (D + 7) / 8 * 8;
    for (int64_t c = 0; c < npad; ++c) { t.pchan.push_back(c); t.pw.push_back(1.f); }
    t.pgroup.resize(npad);
    for (int64_t c = 0; c < npad; ++c) t.pgroup[c] = c < D ? c / t.G : 0;
    return;
  }
  int64_t prev_start = -1, plane_pos = 0;
  for (const auto& term : t.terms) {
    const int64_t w = 8 / term.per;
    if (term.start != prev_start) { prev_start = term.start; plane_pos = (int64_t)t.pchan.size(); }
    const bool lut = t.fast.scores && lut_plane((int)w);
    for (int64_t j = 0; j < term.nbytes; ++j) {
      const int64_t c = j * term.per + term.i;
      if (lut) {  // channel order inside the plane: position plane_pos + c
        const int64_t pos = plane_pos + c;
        if ((int64_t)t.pchan.size() <= pos) { t.pchan.resize(pos + 1, D); t.pw.resize(pos + 1, 0.f); }
        t.pchan[pos] = c;
        t.pw[pos] = term.weight;
      } else {
        t.pchan.push_back(c);
        t.pw.push_back(term.weight);
      }
    }
  }
  t.pgroup.resize(t.pchan.size());
  for (size_t k = 0; k < t.pchan.size(); ++k) t.pgroup[k] = t.pchan[k] < D ? t.pchan[k] / t.G : 0;
}

int64_t kind_of(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat32) return 0;
  if (t.scalar_type() == torch::kFloat16) return 1;
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, "exact segments: float32, float16 or bfloat16");
  return 2;
}

// --- the arguments: exact segments and packed tiers ---

// The exact segments' k, v and mask (3 tensors per segment).
std::vector<Exact> read_exact(const std::vector<torch::Tensor>& exact, int64_t D) {
  std::vector<Exact> ex;
  for (size_t s = 0; s < exact.size() / 3; ++s) {
    const auto &k = exact[3 * s], &v = exact[3 * s + 1], &m = exact[3 * s + 2];
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(3) == D && k.stride(3) == 1 &&
                    v.strides() == k.strides() && k.scalar_type() == v.scalar_type(),
                "exact k, v: [B,H,L,D] with the same strides and a contiguous last axis");
    TORCH_CHECK(m.dtype() == torch::kBool && m.dim() == 3 && m.size(2) == k.size(2), "exact mask: bool [Bm,Rm,L]");
    ex.push_back({static_cast<const uint8_t*>(k.data_ptr()), static_cast<const uint8_t*>(v.data_ptr()), kind_of(k),
                  (int64_t)k.element_size(), k.size(0) == 1 ? 0 : k.stride(0), k.stride(1), k.stride(2), k.size(2),
                  m.data_ptr<bool>(), m.size(0) == 1 ? 0 : m.stride(0), m.size(1) == 1 ? 0 : m.stride(1),
                  m.stride(2)});
  }
  return ex;
}

// The packed tiers (8 tensors and 4 ints of tier_info per tier), each side with its position maps.
std::vector<Tier> read_tiers(const std::vector<torch::Tensor>& tiers, const std::vector<int64_t>& tier_info, int64_t D) {
  std::vector<Tier> tv;
  for (size_t s = 0; s < tiers.size() / 8; ++s) {
    const torch::Tensor* f = &tiers[8 * s];
    for (int i = 0; i < 7; ++i) TORCH_CHECK(f[i].is_contiguous(), "tier tensors must be contiguous");
    Tier t;
    const int64_t mode = tier_info[4 * s + 3];
    TORCH_CHECK(mode >= 0 && mode <= 2, "affine mode: 0 (ab), 1 (scale_zero) or 2 (scale_mean)");
    for (int i : {1, 2, 4, 5})
      TORCH_CHECK(f[i].scalar_type() == torch::kFloat16 || f[i].scalar_type() == torch::kFloat32 ||
                      f[i].scalar_type() == at::ScalarType::Float8_e4m3fn,
                  "tier metadata: float16, float32 or float8_e4m3fn");
    TORCH_CHECK(f[1].scalar_type() == f[2].scalar_type() && f[4].scalar_type() == f[5].scalar_type(),
                "tier metadata: scale and zero of one dtype");
    t.kc = f[0].data_ptr<uint8_t>();
    auto meta_kind = [](const torch::Tensor& m) -> int64_t {
      return m.scalar_type() == torch::kFloat32 ? 0 : m.scalar_type() == torch::kFloat16 ? 1 : 3;
    };
    t.km = {f[1].data_ptr(), f[2].data_ptr(), meta_kind(f[1]), mode};
    t.vc = f[3].data_ptr<uint8_t>();
    t.vm = {f[4].data_ptr(), f[5].data_ptr(), meta_kind(f[4]), mode};
    t.ok = f[6].data_ptr<bool>();
    t.rot = f[7].numel() ? f[7].data_ptr<float>() : nullptr;
    t.n = f[0].size(2);
    t.T = f[0].size(3);
    t.NG = f[4].size(4);
    TORCH_CHECK(t.NG >= 1 && t.NG <= 64 && D % t.NG == 0, "value groups per token: 1..64, dividing D");
    t.G = D / t.NG;
    t.start = tier_info[4 * s + 2];
    for (int side = 0; side < 2; ++side) {
      Side& sd = side == 0 ? t.ks : t.vs;
      sd.bits = tier_info[4 * s + side];
      sd.P = f[side == 0 ? 0 : 3].size(4);
      sd.G = t.G;
      sd.terms = make_terms(sd.bits, D, t.G);
      sd.fast = fast_for(sd.bits, D);
      position_maps(sd, D);
      sd.npos = (int64_t)sd.pchan.size();
      sd.identity = true;
      for (int64_t k = 0; k < sd.npos; ++k) sd.identity = sd.identity && sd.pchan[k] == k && sd.pw[k] == 1.f;
    }
    tv.push_back(std::move(t));
  }
  return tv;
}

// Sizes of one call: rows per KV head R, head dim D, tiers NT, exact tokens LE, and the largest tier's.
// NT counts the affine tiers and the vq tiers (results of tier ti at index ti; the vq ones last).
struct Shape {
  int64_t R, D, NT, LE = 0, maxN = 0, maxP = 0, maxT = 0, maxpos = 0, maxNG = 1;
  Shape(int64_t R_, int64_t D_, const std::vector<Exact>& ex, const std::vector<Tier>& tv, int64_t nvq)
      : R(R_), D(D_), NT((int64_t)tv.size() + nvq) {
    for (const auto& t : tv) {
      maxN = std::max(maxN, t.n * t.T);
      maxP = std::max(maxP, std::max(t.ks.P, t.vs.P));
      maxT = std::max(maxT, t.T);
      maxpos = std::max(maxpos, std::max(t.ks.npos, t.vs.npos));
      maxNG = std::max(maxNG, t.NG);
    }
    for (const auto& e : ex) LE += e.L;
  }
};

// Token selection of kvtier.attention.sparse.select_tokens: method 0 none, 1 mass, 2 quantile;
// forced_from[r]: the first token of row r's local window (always kept).
struct Select {
  int64_t method;
  double level;
  const int64_t* forced_from;
  float LN2;
};

// One task's buffers (a run of (batch, KV head) pairs); the exact part's and each tier's results.
struct Work {
  std::vector<float> se, kf, eacc, emax, esum;
  std::vector<float> sc, e, qs, qr;
  std::vector<float> ka, kb, bias, uf, u, vacc, zacc, tacc;
  std::vector<float> tlse, tkept, tout, tmp, mo;
  std::vector<int> bk;
  std::vector<uint8_t> ct, anyrow;
  explicit Work(const Shape& S)
      : se(S.R * std::max<int64_t>(S.LE, 1)), kf(S.D), eacc(S.R * S.D), emax(S.R), esum(S.R),
        sc(S.R * std::max<int64_t>(S.maxN, 1)), e(std::max<int64_t>(S.maxN, 1)), qs(S.R * S.maxpos), qr(S.R * S.D),
        ka(S.D), kb(S.D), bias(S.R), uf(S.maxT), u(S.maxpos), vacc(S.R * S.maxpos), zacc(S.R * S.maxNG),
        tacc(S.R * S.D), tlse(S.R * S.NT), tkept(S.R * S.NT), tout(S.NT * S.R * S.D), mo(S.R),
        bk(std::max<int64_t>(S.maxN, 1)), ct(S.maxP * S.maxT), anyrow(std::max<int64_t>(S.maxN, 1)) {}
};

// --- exact_partial (kvtier.attention.partials): the exact segments of one (batch, KV head) ---

// Scores se[r * LE + l] of every exact token (-inf where the mask disallows it); returns the
// (row, token) pairs allowed.
int64_t exact_scores(const std::vector<Exact>& ex, int64_t b, int64_t h, const float* qb, const Shape& S, Work& w) {
  const int64_t R = S.R, D = S.D, LE = S.LE;
  int64_t col = 0, epairs = 0;
  for (const auto& x : ex) {
    for (int64_t l = 0; l < x.L; ++l) {
      load_row(x.k + (b * x.sB + h * x.sH + l * x.sL) * x.esize, x.kind, D, w.kf.data());
      for (int64_t r = 0; r < R; ++r) {
        const bool allowed = x.mask[b * x.mB + r * x.mR + l * x.mL];
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t c = 0; c < D; ++c) acc += qb[r * D + c] * w.kf[c];
        w.se[r * LE + col + l] = allowed ? acc : NEG;
        epairs += allowed;
      }
    }
    col += x.L;
  }
  return epairs;
}

// Softmax of each row's exact scores in place (unnormalized: emax, esum kept apart).
void exact_softmax(const Shape& S, Work& w) {
  const int64_t LE = S.LE;
  for (int64_t r = 0; r < S.R; ++r) {
    float* s = w.se.data() + r * LE;
    float m = NEG;
    for (int64_t l = 0; l < LE; ++l) m = std::max(m, s[l]);
    w.emax[r] = m;
    float sum = 0.f;
    if (m != NEG) {
#pragma omp simd reduction(+ : sum)
      for (int64_t l = 0; l < LE; ++l) {
        s[l] = s[l] == NEG ? 0.f : fexp(s[l] - m);
        sum += s[l];
      }
    }
    w.esum[r] = sum;
  }
}

// eacc[r] = sum of p * v over the exact tokens; returns the value rows read.
int64_t exact_values(const std::vector<Exact>& ex, int64_t b, int64_t h, const Shape& S, Work& w) {
  const int64_t R = S.R, D = S.D, LE = S.LE;
  std::fill(w.eacc.begin(), w.eacc.end(), 0.f);
  int64_t col = 0, read = 0;
  for (const auto& x : ex) {
    for (int64_t l = 0; l < x.L; ++l) {
      bool loaded = false;
      for (int64_t r = 0; r < R; ++r) {
        const float p = w.se[r * LE + col + l];
        if (w.emax[r] == NEG || p == 0.f) continue;
        if (!loaded) {
          load_row(x.v + (b * x.sB + h * x.sH + l * x.sL) * x.esize, x.kind, D, w.kf.data());
          loaded = true;
        }
        float* acc = w.eacc.data() + r * D;
#pragma omp simd
        for (int64_t c = 0; c < D; ++c) acc[c] += p * w.kf[c];
      }
      read += loaded;
    }
    col += x.L;
  }
  return read;
}

// --- packed_partial (kvtier.attention.partials): one packed tier of one (batch, KV head) ---

// The rows in a tier's rotated basis (q @ rot), or the rows themselves when it has no rotation.
const float* rotate_rows(const float* rot, const float* qb, const Shape& S, Work& w) {
  if (!rot) return qb;
  const int64_t R = S.R, D = S.D;
  std::fill(w.qr.begin(), w.qr.end(), 0.f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < D; ++j) {  // qr[r] += q[r, j] * rot[j, :]
      const float qj = qb[r * D + j];
      const float* rj = rot + j * D;
      float* dst = w.qr.data() + r * D;
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) dst[c] += qj * rj[c];
    }
  return w.qr.data();
}

// Key scores sc[r * N + x] = q_r . (a * codes_x + b) of the tier's N tokens (-inf where invalid):
// per block, the rows times the key scales at each unpacked position (qs) and q . b (bias), then
// the codes weighted by qs (the fixed-shape path, or the runtime loops over the block's bytes).
void key_scores(const Tier& t, int64_t bh, int64_t b, const float* qt, const Shape& S, Work& w) {
  const Side& kside = t.ks;
  const int64_t R = S.R, D = S.D;
  const int64_t n = t.n, T = t.T, P = kside.P, N = n * T, npos = kside.npos;
  for (int64_t blk = 0; blk < n; ++blk) {
    t.km.ab((bh * n + blk) * D, D, w.ka.data(), w.kb.data(), w.kf.data());
    const float* a = w.ka.data();
    const float* bo = w.kb.data();
    for (int64_t r = 0; r < R; ++r) {
      w.bias[r] = dot_n(qt + r * D, bo, D);
      float* wr = w.qs.data() + r * npos;
      if (kside.identity) {  // positions are channels (whole codes): a SIMD product
        const float* qr_ = qt + r * D;
#pragma omp simd
        for (int64_t c = 0; c < D; ++c) wr[c] = qr_[c] * a[c];
        for (int64_t k = D; k < npos; ++k) wr[k] = 0.f;
        continue;
      }
      for (int64_t k = 0; k < npos; ++k) {
        const int64_t c = kside.pchan[k];
        wr[k] = c < D ? qt[r * D + c] * a[c] * kside.pw[k] : 0.f;
      }
    }
    const uint8_t* codes = t.kc + ((bh * n + blk) * T) * P;
    const bool* okb = t.ok + (b * n + blk) * T;
    if (kside.fast.scores) {
      kside.fast.scores(codes, okb, T, P, R, w.qs.data(), w.bias.data(), w.sc.data() + blk * T, N);
      continue;
    }
    // runtime shapes: the block's key bytes channel-major, ct[p * T + tt], loops over tokens
    for (int64_t tt = 0; tt < T; ++tt)
      for (int64_t p = 0; p < P; ++p) w.ct[p * T + tt] = codes[tt * P + p];
    for (int64_t r = 0; r < R; ++r) {
      float* s = w.sc.data() + r * N + blk * T;
      const float bi = w.bias[r];
#pragma omp simd
      for (int64_t tt = 0; tt < T; ++tt) s[tt] = bi;
    }
    int64_t pos = 0;
    for (const auto& term : kside.terms) {
      const int sh = (int)term.shift, mk = (int)term.mask;
      for (int64_t j = 0; j < term.nbytes; ++j, ++pos) {
        const uint8_t* cb = w.ct.data() + (term.start + j) * T;
#pragma omp simd
        for (int64_t tt = 0; tt < T; ++tt) w.uf[tt] = float((cb[tt] >> sh) & mk);
        for (int64_t r = 0; r < R; ++r) {
          const float wq = w.qs[r * npos + pos];
          float* s = w.sc.data() + r * N + blk * T;
#pragma omp simd
          for (int64_t tt = 0; tt < T; ++tt) s[tt] += wq * w.uf[tt];
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      float* s = w.sc.data() + r * N + blk * T;
      for (int64_t tt = 0; tt < T; ++tt) if (!okb[tt]) s[tt] = NEG;
    }
  }
}

// select_tokens (kvtier.attention.sparse) over one row: row[x] = ee[x] where token x is kept (its
// score >= the quantile, or its weight bucket within the mass cut, or in the local window), else 0;
// anyrow marks the tokens kept by some row. Returns the kept weight; nkept counts the kept tokens.
float select_tokens(const Tier& t, float* row, const float* ee, int64_t N, int64_t nvalid, float m, float sum,
                    int64_t r, const Select& sel, Work& w, int64_t& nkept) {
  float thr = NEG;     // quantile: keep scores >= thr
  int64_t kstar = 64;  // mass: keep buckets <= kstar
  int* bk = w.bk.data();
  if (sel.method == 2) {
    thr = quantile_threshold(row, N, nvalid, sel.level, w.tmp);
  } else {
#pragma omp simd
    for (int64_t x = 0; x < N; ++x) bk[x] = (int)std::min(63.f, std::floor((m - row[x]) / sel.LN2));  // -inf: 63
    // four interleaved histograms: no store-to-load chain on a popular bucket
    float hist[4][64] = {{0.f}};
    int64_t x4 = 0;
    for (; x4 + 4 <= N; x4 += 4)
      for (int k = 0; k < 4; ++k) hist[k][bk[x4 + k]] += ee[x4 + k];
    for (; x4 < N; ++x4) hist[0][bk[x4]] += ee[x4];
    float bucket[64];
    for (int k = 0; k < 64; ++k) bucket[k] = (hist[0][k] + hist[1][k]) + (hist[2][k] + hist[3][k]);
    // drop at most (1 - level) of the row's mass: this tier's plus the exact tokens'
    const float rest = w.emax[r] == NEG ? 0.f : std::exp(w.emax[r] + std::log(w.esum[r]) - m);
    kstar = mass_cut(bucket, sum, rest, sel.level);
  }
  const int64_t forced = sel.forced_from[r] - t.start;  // token slots >= this are in the local window
  float kept = 0.f;
  int64_t nk = 0;
  const int ks = (int)kstar;
  uint8_t* anyrow = w.anyrow.data();
  if (sel.method == 1) {
#pragma omp simd reduction(+ : kept, nk)
    for (int64_t x = 0; x < N; ++x) {
      const bool keep = row[x] != NEG && (bk[x] <= ks || x >= forced);
      row[x] = keep ? ee[x] : 0.f;
      kept += row[x];
      nk += keep;
      anyrow[x] |= keep;
    }
  } else {
    for (int64_t x = 0; x < N; ++x) {
      const bool keep = row[x] != NEG && (row[x] >= thr || x >= forced);
      row[x] = keep ? ee[x] : 0.f;
      kept += row[x];
      nk += keep;
      anyrow[x] |= keep;
    }
  }
  nkept = nk;
  return kept;
}

// _block_softmax (kvtier.attention.partials): each row's scores -> weights exp(s - max) in place
// (0 where masked or not selected), tlse = the row's log-sum-exp, tkept = the weight kept.
void block_softmax(const Tier& t, int64_t ti, const Shape& S, const Select& sel, Work& w, int64_t* ctn) {
  const int64_t R = S.R, N = t.n * t.T;
  std::fill(w.anyrow.begin(), w.anyrow.begin() + N, 0);
  for (int64_t r = 0; r < R; ++r) {
    float* row = w.sc.data() + r * N;
    float m = NEG;
    int64_t nvalid = 0;
#pragma omp simd reduction(max : m) reduction(+ : nvalid)
    for (int64_t x = 0; x < N; ++x) {
      m = std::max(m, row[x]);
      nvalid += row[x] != NEG;
    }
    ctn[0] += nvalid;
    if (m == NEG) {
      w.tlse[ti * R + r] = NEG;
      w.tkept[ti * R + r] = 0.f;
      std::fill(row, row + N, 0.f);
      continue;
    }
    float* ee = w.e.data();
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t x = 0; x < N; ++x) {
      ee[x] = fexp(row[x] - m);  // masked (-inf) -> 0
      sum += ee[x];
    }
    w.tlse[ti * R + r] = m + std::log(sum);
    if (!sel.method) {
      w.tkept[ti * R + r] = sum;
      std::copy(ee, ee + N, row);
      for (int64_t x = 0; x < N; ++x) w.anyrow[x] |= ee[x] > 0.f;
      ctn[1] += nvalid;
      continue;
    }
    int64_t nkept = 0;
    const float kept = select_tokens(t, row, ee, N, nvalid, m, sum, r, sel, w, nkept);
    ctn[1] += nkept;
    w.tkept[ti * R + r] = kept;
  }
}

// _weighted_codes (kvtier.attention.partials): vacc[r] = sum of p * a * codes over the kept tokens
// (at the value side's unpacked positions), zacc[r, g] = sum of p * b per value group.
void weighted_values(const Tier& t, int64_t bh, const Shape& S, Work& w, int64_t* ctn) {
  const int64_t R = S.R, N = t.n * t.T;
  std::fill(w.vacc.begin(), w.vacc.end(), 0.f);
  std::fill(w.zacc.begin(), w.zacc.end(), 0.f);
  const int64_t NG = t.NG;
  const Side& vside = t.vs;
  const int64_t vpos = vside.npos;
  for (int64_t x = 0; x < N; ++x) {
    if (!w.anyrow[x]) continue;
    ++ctn[2];
    const uint8_t* by = t.vc + (bh * N + x) * vside.P;
    if (vside.fast.unpack) {
      vside.fast.unpack(by, w.u.data());
    } else {
      int64_t pos = 0;
      for (const auto& term : vside.terms) {
        const int sh = (int)term.shift, mk = (int)term.mask;
        const uint8_t* bb = by + term.start;
        float* uu = w.u.data() + pos;
#pragma omp simd
        for (int64_t j = 0; j < term.nbytes; ++j) uu[j] = float((bb[j] >> sh) & mk);
        pos += term.nbytes;
      }
    }
    float a[64], bo[64];
    for (int64_t g = 0; g < NG; ++g) {
      a[g] = t.vm.a((bh * N + x) * NG + g);
      bo[g] = t.vm.b((bh * N + x) * NG + g);
    }
    for (int64_t r = 0; r < R; ++r) {
      const float p = w.sc[r * N + x];
      if (p == 0.f) continue;
      for (int64_t g = 0; g < NG; ++g) w.zacc[r * NG + g] += p * bo[g];
      float* acc = w.vacc.data() + r * vpos;
      if (NG == 1) {
        const float pa = p * a[0];
        if (vside.fast.axpy) {
          vside.fast.axpy(pa, w.u.data(), acc);
          continue;
        }
#pragma omp simd
        for (int64_t j = 0; j < vpos; ++j) acc[j] += pa * w.u[j];
        continue;
      }
      float pa[64];
      for (int64_t g = 0; g < NG; ++g) pa[g] = p * a[g];
      const int64_t* pg = vside.pgroup.data();
      for (int64_t k = 0; k < vpos; ++k) acc[k] += pa[pg[k]] * w.u[k];
    }
  }
}

// tout[ti, r] = tacc[r] in channel order: tacc @ rot^T, or tacc itself when rot is null.
void rotate_back(const float* rot, int64_t ti, const Shape& S, Work& w) {
  const int64_t R = S.R, D = S.D;
  for (int64_t r = 0; r < R; ++r) {
    float* dst = w.tout.data() + (ti * R + r) * D;
    if (!rot) { std::copy(w.tacc.data() + r * D, w.tacc.data() + (r + 1) * D, dst); continue; }
    for (int64_t c = 0; c < D; ++c) dst[c] = dot_n(w.tacc.data() + r * D, rot + c * D, D);  // out @ rot^T
  }
}

// The tier's normalized output tout[ti, r] in channel order (rotated back: out @ rot^T).
void tier_output(const Tier& t, int64_t ti, const Shape& S, Work& w) {
  const int64_t R = S.R, D = S.D, NG = t.NG;
  const Side& vside = t.vs;
  const int64_t vpos = vside.npos;
  for (int64_t r = 0; r < R; ++r) {
    float* dst = w.tacc.data() + r * D;
    std::fill(dst, dst + D, 0.f);
    const float kept = w.tkept[ti * R + r];
    if (kept == 0.f) continue;
    const float* acc = w.vacc.data() + r * vpos;
    for (int64_t k = 0; k < vpos; ++k)
      if (vside.pchan[k] < D) dst[vside.pchan[k]] += acc[k] * vside.pw[k];
    const float inv = 1.f / kept;
    for (int64_t c = 0; c < D; ++c) dst[c] = (dst[c] + w.zacc[r * NG + c / t.G]) * inv;
  }
  rotate_back(t.rot, ti, S, w);
}

// --- vq_partial (kvtier.attention.partials): one vq tier of one (batch, KV head) ---

// A vq tier and its rotation [D, D] (its codes are of x @ rot).
struct VqTier {
  vq::Tier t;
  const float* rot;
};

// The vq tiers: 10 tensors per tier (kvtier.codecs.vq.kernel_operands' tensors, valid [B,n,T],
// rot [D,D]) and 6 ints of vq_info (the key then the value indices' plane widths, 0-padded to 3).
std::vector<VqTier> read_vq(const std::vector<torch::Tensor>& vqt, const std::vector<int64_t>& vq_info,
                            const torch::Tensor& fp8, int64_t B, int64_t H, int64_t D) {
  std::vector<VqTier> out;
  for (size_t s = 0; s < vqt.size() / 10; ++s) {
    const torch::Tensor* f = &vqt[10 * s];
    std::vector<int64_t> kp, vp;
    for (int i = 0; i < 3; ++i) {
      if (vq_info[6 * s + i]) kp.push_back(vq_info[6 * s + i]);
      if (vq_info[6 * s + 3 + i]) vp.push_back(vq_info[6 * s + 3 + i]);
    }
    TORCH_CHECK(f[9].dtype() == torch::kFloat32 && f[9].is_contiguous() && f[9].numel() == D * D,
                "vq rotation: contiguous float32 [D,D]");
    out.push_back({vq::read_tier(f[0], kp, f[1], f[2], f[3], f[4], vp, f[5], f[6], f[7], f[8], fp8, B, H, D),
                   f[9].data_ptr<float>()});
  }
  return out;
}

// tout[ti] and tlse[ti] (tkept 1 where anything is valid) of rows qb over vq tier x, per group of
// vq::G rows; ctn: pairs scored, pairs valued, tokens whose value codes were read.
void vq_tier_output(const VqTier& x, int64_t ti, int64_t bh, int64_t b, const float* qb, const Shape& S, Work& w,
                    vq::Work& vw, int64_t* ctn) {
  const int64_t R = S.R, D = S.D;
  const float* qt = rotate_rows(x.rot, qb, S, w);
  float* tl = w.tlse.data() + ti * R;
  std::fill(tl, tl + R, NEG);
  std::fill(w.tacc.begin(), w.tacc.begin() + R * D, 0.f);
  std::fill(w.mo.begin(), w.mo.end(), 0.f);
  int64_t read = 0;
  for (int64_t r0 = 0; r0 < R; r0 += vq::G)
    read = vq::attend(x.t, bh, b, qt + r0 * D, std::min(vq::G, R - r0), D, vw, w.tacc.data() + r0 * D,
                      w.mo.data() + r0, tl + r0);
  ctn[0] += read * R;
  ctn[1] += read * R;
  ctn[2] += read;
  rotate_back(x.rot, ti, S, w);
  for (int64_t r = 0; r < R; ++r) {
    w.tkept[ti * R + r] = tl[r] == NEG ? 0.f : 1.f;
    float* dst = w.tout.data() + (ti * R + r) * D;
#pragma omp simd
    for (int64_t c = 0; c < D; ++c) dst[c] += w.mo[r];  // the values' token means, one per row
  }
}

// --- merge (kvtier.attention.partials): the exact part and the tiers by log-sum-exp ---

// o [R, D] and ls [R] of one (batch, KV head): the partials weighted by exp(lse - max), normalized.
void merge(const Shape& S, const Work& w, float* o, float* ls) {
  const int64_t R = S.R, D = S.D, NT = S.NT;
  for (int64_t r = 0; r < R; ++r) {
    const float le = w.emax[r] == NEG ? NEG : w.emax[r] + std::log(w.esum[r]);
    float M = le;
    for (int64_t ti = 0; ti < NT; ++ti) M = std::max(M, w.tlse[ti * R + r]);
    float* dst = o + r * D;
    if (M == NEG) { ls[r] = NEG; continue; }
    const float we = le == NEG ? 0.f : std::exp(le - M);
    float total = we;
    const float se_inv = we > 0.f ? we / w.esum[r] : 0.f;
    for (int64_t c = 0; c < D; ++c) dst[c] = w.eacc[r * D + c] * se_inv;
    for (int64_t ti = 0; ti < NT; ++ti) {
      const float l = w.tlse[ti * R + r];
      if (l == NEG || w.tkept[ti * R + r] == 0.f) continue;
      const float wt = std::exp(l - M);
      total += wt;
      const float* src = w.tout.data() + (ti * R + r) * D;
      for (int64_t c = 0; c < D; ++c) dst[c] += wt * src[c];
    }
    const float inv = 1.f / total;
    for (int64_t c = 0; c < D; ++c) dst[c] *= inv;
    ls[r] = M + std::log(total);
  }
}

}  // namespace

// rows [B,H,R,D] fp32 (scaled). exact: 3 tensors per segment: k, v [B,H,L,D] (last axis contiguous),
// mask bool [Bm,Rm,L] (Bm in {1,B}, Rm in {1,R}). tiers: 8 tensors per tier: k_codes [B,H,n,T,P],
// k_scale, k_zero (or k_mean) [B,H,n,1,D], v_codes, v_scale, v_zero (or v_mean) [B,H,n,T,NG],
// valid [B,n,T], rot ([D,D] or empty); tier_info: (key bits, value bits, start, affine mode) per tier.
// vq_tiers: 10 tensors per vq tier (k_idx, k_book, k_mean, k_rms, v_idx, v_book, v_rms, v_mean as
// kvtier.codecs.vq.kernel_operands gives them, valid [B,n,T], rot [D,D]); vq_info: 6 ints per vq
// tier (key, then value plane widths, 0-padded); fp8: the vq parameters' 256 byte values.
// Returns out [B,H,R,D] (normalized, merged), lse [B,H,R], counts int64 [B*H, 1 + ntiers, 3]
// (the affine tiers, then the vq tiers).
//
// Per (batch, KV head): exact_partial (scores, softmax, values), then per tier packed_partial
// (rotate_rows, key_scores, block_softmax with select_tokens, weighted_values, tier_output), per vq
// tier vq_tier_output, then merge.
std::vector<torch::Tensor> layer_attention(
    torch::Tensor rows, std::vector<torch::Tensor> exact, std::vector<torch::Tensor> tiers,
    std::vector<int64_t> tier_info, std::vector<torch::Tensor> vq_tiers, std::vector<int64_t> vq_info,
    torch::Tensor fp8, int64_t sel_method, double sel_level, torch::Tensor forced_from) {
  TORCH_CHECK(rows.dtype() == torch::kFloat32 && rows.is_contiguous(), "rows: contiguous float32");
  TORCH_CHECK(exact.size() % 3 == 0 && tiers.size() % 8 == 0 && tier_info.size() * 8 == tiers.size() * 4 &&
                  vq_tiers.size() % 10 == 0 && vq_info.size() * 10 == vq_tiers.size() * 6,
              "exact: 3 tensors per segment, tiers: 8 per tier, tier_info: 4 per tier, vq_tiers: 10 and vq_info: 6 per vq tier");
  TORCH_CHECK(vq_tiers.empty() || sel_method == 0, "vq tiers are attended densely: no token selection");
  const int64_t B = rows.size(0), H = rows.size(1), R = rows.size(2), D = rows.size(3);
  const std::vector<Exact> ex = read_exact(exact, D);
  const std::vector<Tier> tv = read_tiers(tiers, tier_info, D);
  const std::vector<VqTier> vt = read_vq(vq_tiers, vq_info, fp8, B, H, D);
  const int64_t NA = (int64_t)tv.size();
  const Shape S(R, D, ex, tv, (int64_t)vt.size());
  const int64_t NT = S.NT;
  const Select sel{sel_method, sel_level, sel_method ? forced_from.data_ptr<int64_t>() : nullptr, std::log(2.0f)};
  const float* q = rows.data_ptr<float>();
  auto out = torch::zeros({B, H, R, D}, rows.options());
  auto lse = torch::empty({B, H, R}, rows.options());
  auto counts = torch::zeros({B * H, 1 + NT, 3}, torch::kInt64);
  int64_t* cnt = counts.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  float* ls = lse.data_ptr<float>();

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    Work w(S);
    std::vector<vq::Work> vw;
    for (const auto& x : vt) vw.emplace_back(x.t, D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* qb = q + bh * R * D;
      int64_t* cn = cnt + bh * (1 + NT) * 3;
      // 1. exact segments: scores, softmax, values
      cn[0] = cn[1] = exact_scores(ex, b, h, qb, S, w);
      exact_softmax(S, w);
      cn[2] += exact_values(ex, b, h, S, w);
      // 2-4. packed tiers
      for (int64_t ti = 0; ti < NA; ++ti) {
        const Tier& t = tv[ti];
        int64_t* ctn = cn + (1 + ti) * 3;
        const float* qt = rotate_rows(t.rot, qb, S, w);
        key_scores(t, bh, b, qt, S, w);
        block_softmax(t, ti, S, sel, w, ctn);
        weighted_values(t, bh, S, w, ctn);
        tier_output(t, ti, S, w);
      }
      for (int64_t vi = 0; vi < NT - NA; ++vi)
        vq_tier_output(vt[vi], NA + vi, bh, b, qb, S, w, vw[vi], cn + (1 + NA + vi) * 3);
      // 5. log-sum-exp merge of the exact part and the tiers
      merge(S, w, o + bh * R * D, ls + bh * R);
    }
  });
  return {out, lse, counts};
}
