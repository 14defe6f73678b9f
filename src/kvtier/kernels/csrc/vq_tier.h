// One tier of vector codes (kvtier.codecs.vq) attended in place, product-quantization style: the
// per-(batch, KV head) routine shared by vq_attention.cpp (a tier alone, kvtier/kernels/vq_cpu.py)
// and layer_attention.cpp (a vq tier inside the fused whole-layer call, kvtier/kernels/fused_cpu.py).
//
// Per group of G query rows of one (batch, KV head):
//   keys   - one table per sub-space and centre, tab[p][c][r] = q_r[p] . book_k[c] (q rotated), so a
//            key's score is rms_t * sum_p tab[p][idx_tp][r] + q_r . mean_block: P lookups of G lanes
//            per token, no key rebuilt;
//   values - after a safe two-pass softmax each token's weights w_tr * rms_t are added into
//            acc[p][idx_tp][r] (P adds of G lanes), then expanded once per row through the value
//            codebook; the values' token means are summed apart (sum_t w_tr * mean_t).
// Indices are unpacked from their bit planes (widths given by the caller from kvtier.quant.planes:
// the codec owns them) per token into P bytes; the fp8 parameters are read through the caller's
// 256-entry table (kvtier.codecs.vq's FP8 format), the keys' fp16 means per block. Nothing larger
// than the tables is decoded.
//
// Like numeric.h, everything sits in an anonymous namespace (each kernel is its own module); a
// kernel includes numeric.h (NEG, fexp, dot_n, halves_to_floats) before this file.
#ifndef KVTIER_KERNELS_CSRC_VQ_TIER_H_
#define KVTIER_KERNELS_CSRC_VQ_TIER_H_

#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {
namespace vq {

constexpr int64_t G = 8;  // query rows per pass: the lanes of every table entry (one AVX2 register)

// One bit plane of P codes of width W (dividing 8; LSB first within a byte) OR-ed into idx at
// `shift`, a byte at a time (idx holds P rounded up to 8 entries).
template <int W>
inline void or_plane(const uint8_t* bytes, int64_t P, int shift, uint8_t* idx) {
  constexpr int per = 8 / W, mask = (1 << W) - 1;
  for (int64_t i = 0; i < (P + per - 1) / per; ++i) {
    const int x = bytes[i];
    for (int k = 0; k < per; ++k) idx[i * per + k] |= uint8_t(((x >> (k * W)) & mask) << shift);
  }
}

// A token's P indices (each within one byte: the codec packs the bits above 8 apart and the
// kernels refuse them) from its planes, returned in place when the one plane is 8 bits wide.
inline const uint8_t* token_indices(const uint8_t* bytes, const std::vector<int64_t>& widths, int64_t P, uint8_t* idx) {
  if (widths.size() == 1 && widths[0] == 8) return bytes;
  const int64_t P_pad = (P + 7) / 8 * 8;
  std::fill(idx, idx + P_pad, uint8_t(0));
  int shift = 0;
  for (const int64_t w : widths) {
    switch (w) {
      case 1: or_plane<1>(bytes, P, shift, idx); break;
      case 2: or_plane<2>(bytes, P, shift, idx); break;
      case 4: or_plane<4>(bytes, P, shift, idx); break;
      default: or_plane<8>(bytes, P, shift, idx); break;
    }
    bytes += P_pad * w / 8;
    shift += int(w);
  }
  return idx;
}

// Adds table rows tab[p][idx[p]][0..G) over p < P into acc[0..G).
inline void gather_sum(const float* tab, const uint8_t* idx, int64_t P, int64_t C, float* acc) {
  for (int64_t p = 0; p < P; ++p) {
    const float* e = tab + (p * C + idx[p]) * G;
#pragma omp simd
    for (int64_t r = 0; r < G; ++r) acc[r] += e[r];
  }
}

// Adds w[0..G) into acc[p][idx[p]][0..G) for p < P.
inline void scatter_add(float* acc, const uint8_t* idx, int64_t P, int64_t C, const float* w) {
  for (int64_t p = 0; p < P; ++p) {
    float* e = acc + (p * C + idx[p]) * G;
#pragma omp simd
    for (int64_t r = 0; r < G; ++r) e[r] += w[r];
  }
}

// One side's codes: packed indices [B, H, n, T, bytes], their plane widths, the codebook [C, d]
// and the fp8 RMS bytes [B, H, n, T].
struct Side {
  const uint8_t* idx;
  std::vector<int64_t> planes;
  const float* book;
  const uint8_t* rms;
  int64_t bytes, C, d, P;
};

// A tier as kvtier.codecs.vq.kernel_operands passes it, with valid [B, n, T] and the fp8 table.
struct Tier {
  Side k, v;
  const uint16_t* k_mean;  // fp16 [B, H, n, D]: each block's key mean
  const uint8_t* v_mean;   // fp8 [B, H, n, T]: each token's value mean
  const bool* ok;
  const float* fp8;
  int64_t n, T, N;
};

inline Side read_side(const torch::Tensor& idx, const std::vector<int64_t>& planes, const torch::Tensor& book,
                      const torch::Tensor& rms, int64_t D) {
  TORCH_CHECK(idx.dtype() == torch::kUInt8 && idx.is_contiguous() && idx.dim() == 5, "vq indices: contiguous uint8 [B,H,n,T,bytes]");
  TORCH_CHECK(rms.dtype() == torch::kUInt8 && rms.is_contiguous(), "vq fp8 parameters: contiguous uint8");
  TORCH_CHECK(book.dtype() == torch::kFloat32 && book.is_contiguous() && book.dim() == 2, "vq codebook: contiguous float32 [C,d]");
  TORCH_CHECK(!planes.empty() && planes.size() <= 3, "vq plane widths: one to three");
  int64_t width = 0;
  for (const int64_t w : planes) {
    TORCH_CHECK(w == 1 || w == 2 || w == 4 || w == 8, "vq plane widths: 1, 2, 4 or 8 bits");
    width += w;
  }
  TORCH_CHECK(width <= 8, "vq indices: at most one byte each");
  const int64_t C = book.size(0), d = book.size(1);
  TORCH_CHECK(C <= 256 && C <= (int64_t(1) << width), "at most 256 centres (one byte per index), within the planes' width");
  TORCH_CHECK(D % d == 0, "the codebooks' sub-vectors do not tile head_dim");
  return {idx.data_ptr<uint8_t>(), planes, book.data_ptr<float>(), rms.data_ptr<uint8_t>(), idx.size(4), C, d, D / d};
}

inline Tier read_tier(const torch::Tensor& k_idx, const std::vector<int64_t>& k_planes, const torch::Tensor& k_book,
                      const torch::Tensor& k_mean, const torch::Tensor& k_rms, const torch::Tensor& v_idx,
                      const std::vector<int64_t>& v_planes, const torch::Tensor& v_book, const torch::Tensor& v_rms,
                      const torch::Tensor& v_mean, const torch::Tensor& valid, const torch::Tensor& fp8, int64_t B,
                      int64_t H, int64_t D) {
  TORCH_CHECK(fp8.dtype() == torch::kFloat32 && fp8.is_contiguous() && fp8.numel() == 256,
              "fp8: the 256 float32 values of the parameters' byte format");
  TORCH_CHECK(k_mean.dtype() == torch::kFloat16 && k_mean.is_contiguous(), "k_mean: contiguous float16");
  TORCH_CHECK(v_mean.dtype() == torch::kUInt8 && v_mean.is_contiguous(), "vq fp8 parameters: contiguous uint8");
  TORCH_CHECK(valid.dtype() == torch::kBool && valid.is_contiguous(), "valid: contiguous bool");
  Tier t{read_side(k_idx, k_planes, k_book, k_rms, D), read_side(v_idx, v_planes, v_book, v_rms, D),
         reinterpret_cast<const uint16_t*>(k_mean.data_ptr<at::Half>()), v_mean.data_ptr<uint8_t>(),
         valid.data_ptr<bool>(), fp8.data_ptr<float>(), k_idx.size(2), k_idx.size(3), 0};
  t.N = t.n * t.T;
  TORCH_CHECK(k_idx.size(0) == B && k_idx.size(1) == H && v_idx.sizes().slice(0, 4) == k_idx.sizes().slice(0, 4) &&
                  valid.numel() == B * t.N && k_mean.numel() == B * H * t.n * D && k_rms.numel() == B * H * t.N &&
                  v_rms.numel() == B * H * t.N && v_mean.numel() == B * H * t.N,
              "vq tier: fields of [B,H,n,T] tokens for the rows' B and H");
  return t;
}

// One task's buffers for a tier.
struct Work {
  std::vector<float> ktab, vacc, w, qm, mean;
  std::vector<uint8_t> kix, vix;
  Work(const Tier& t, int64_t D)
      : ktab(t.k.P * t.k.C * G), vacc(t.v.P * t.v.C * G), w(std::max<int64_t>(t.N, 1) * G), qm(std::max<int64_t>(t.n, 1) * G),
        mean(D), kix((t.k.P + 7) / 8 * 8), vix((t.v.P + 7) / 8 * 8) {}
};

// Rows qb[0..g) (g <= G; rotated, [g, D]) of (batch b, flat head bh) over the tier: out[r] (rotated
// basis, normalized; left as is when row r has nothing valid), mo[r] the values' mean term, l[r] its
// log-sum-exp (left as is when nothing is valid). Returns the valid tokens read.
inline int64_t attend(const Tier& t, int64_t bh, int64_t b, const float* qb, int64_t g, int64_t D, Work& wk, float* out,
                      float* mo, float* l) {
  const Side &ks = t.k, &vs = t.v;
  const int64_t n = t.n, T = t.T, N = t.N;
  // keys: the tables, then each block's mean score
  for (int64_t p = 0; p < ks.P; ++p)
    for (int64_t c = 0; c < ks.C; ++c) {
      float* e = wk.ktab.data() + (p * ks.C + c) * G;
      for (int64_t r = 0; r < G; ++r) e[r] = r < g ? dot_n(qb + r * D + p * ks.d, ks.book + c * ks.d, ks.d) : 0.f;
    }
  for (int64_t blk = 0; blk < n; ++blk) {
    halves_to_floats(t.k_mean + (bh * n + blk) * D, wk.mean.data(), D);
    for (int64_t r = 0; r < G; ++r) wk.qm[blk * G + r] = r < g ? dot_n(qb + r * D, wk.mean.data(), D) : 0.f;
  }
  float m[G], s[G], mv[G], acc[G];
  std::fill(m, m + G, NEG);
  int64_t read = 0;
  for (int64_t x = 0; x < N; ++x) {
    if (!t.ok[b * N + x]) continue;
    ++read;
    std::fill(acc, acc + G, 0.f);
    gather_sum(wk.ktab.data(), token_indices(ks.idx + (bh * N + x) * ks.bytes, ks.planes, ks.P, wk.kix.data()), ks.P,
               ks.C, acc);
    const float rms = t.fp8[ks.rms[bh * N + x]];
    const float* qmb = wk.qm.data() + (x / T) * G;
    float* wt = wk.w.data() + x * G;
    for (int64_t r = 0; r < G; ++r) {
      wt[r] = rms * acc[r] + qmb[r];
      m[r] = std::max(m[r], wt[r]);
    }
  }
  // values: softmax weights summed per sub-space and centre
  std::fill(s, s + G, 0.f);
  std::fill(mv, mv + G, 0.f);
  std::fill(wk.vacc.begin(), wk.vacc.end(), 0.f);
  for (int64_t x = 0; x < N; ++x) {
    if (!t.ok[b * N + x]) continue;
    float* wt = wk.w.data() + x * G;
    const float rms = t.fp8[vs.rms[bh * N + x]], vm = t.fp8[t.v_mean[bh * N + x]];
    for (int64_t r = 0; r < G; ++r) {
      const float e = fexp(wt[r] - m[r]);
      s[r] += e;
      mv[r] += e * vm;
      acc[r] = e * rms;
    }
    scatter_add(wk.vacc.data(), token_indices(vs.idx + (bh * N + x) * vs.bytes, vs.planes, vs.P, wk.vix.data()), vs.P,
                vs.C, acc);
  }
  // expanded once per row through the value codebook
  for (int64_t r = 0; r < g; ++r) {
    if (s[r] <= 0.f) continue;  // nothing valid
    const float inv = 1.f / s[r];
    float* orow = out + r * D;
    std::fill(orow, orow + D, 0.f);
    for (int64_t p = 0; p < vs.P; ++p)
      for (int64_t c = 0; c < vs.C; ++c) {
        const float x = wk.vacc[(p * vs.C + c) * G + r];
        if (x == 0.f) continue;
        for (int64_t i = 0; i < vs.d; ++i) orow[p * vs.d + i] += x * vs.book[c * vs.d + i];
      }
    for (int64_t i = 0; i < D; ++i) orow[i] *= inv;
    mo[r] = mv[r] * inv;
    l[r] = m[r] + std::log(s[r]);
  }
  return read;
}

}  // namespace vq
}  // namespace

#endif  // KVTIER_KERNELS_CSRC_VQ_TIER_H_
