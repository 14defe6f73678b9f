// vq_attention: attention of query rows over one tier of vector codes (kvtier.codecs.vq), read in
// place, product-quantization style; built by kvtier/kernels/vq_cpu.py (which documents the
// arguments and the torch reference, kvtier.attention.partials.vq_partial).
//
// Per (batch, KV head), in parallel, and per group of G query rows:
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

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "numeric.h"

namespace {

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

// A token's P indices (each within one byte: the codec packs the bits above 8 apart and this
// kernel refuses them) from its planes, returned in place when the one plane is 8 bits wide.
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

}  // namespace

std::vector<torch::Tensor> vq_attention(torch::Tensor rows, torch::Tensor k_idx, std::vector<int64_t> k_planes,
                                        torch::Tensor k_book, torch::Tensor k_mean, torch::Tensor k_rms,
                                        torch::Tensor v_idx, std::vector<int64_t> v_planes, torch::Tensor v_book,
                                        torch::Tensor v_rms, torch::Tensor v_mean, torch::Tensor valid,
                                        torch::Tensor fp8) {
  TORCH_CHECK(rows.dtype() == torch::kFloat32 && rows.is_contiguous(), "rows: contiguous float32");
  for (const auto& t : {k_book, v_book, fp8})
    TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(), "codebooks and the fp8 table: contiguous float32");
  TORCH_CHECK(fp8.numel() == 256, "fp8: the 256 values of the parameters' byte format");
  for (const auto& t : {k_idx, v_idx, k_rms, v_rms, v_mean})
    TORCH_CHECK(t.dtype() == torch::kUInt8 && t.is_contiguous(), "indices and fp8 parameters: contiguous uint8");
  TORCH_CHECK(k_mean.dtype() == torch::kFloat16 && k_mean.is_contiguous(), "k_mean: contiguous float16");
  TORCH_CHECK(valid.dtype() == torch::kBool && valid.is_contiguous(), "valid: contiguous bool");
  const int64_t B = rows.size(0), H = rows.size(1), R = rows.size(2), D = rows.size(3);
  const int64_t n = k_idx.size(2), T = k_idx.size(3), KB = k_idx.size(4), VB = v_idx.size(4);
  const int64_t Ck = k_book.size(0), dk = k_book.size(1), Cv = v_book.size(0), dv = v_book.size(1);
  const int64_t Pk = D / dk, Pv = D / dv;
  TORCH_CHECK(Pk * dk == D && Pv * dv == D, "the codebooks' sub-vectors do not tile head_dim");
  TORCH_CHECK(Ck <= 256 && Cv <= 256, "at most 256 centres (one byte per index)");
  auto out = torch::zeros({B, H, R, D}, rows.options());
  auto mean_out = torch::zeros({B, H, R}, rows.options());
  auto lse = torch::full({B, H, R}, NEG, rows.options());
  const float* q = rows.data_ptr<float>();
  const uint8_t* ki = k_idx.data_ptr<uint8_t>();
  const uint8_t* vi = v_idx.data_ptr<uint8_t>();
  const float* kbook = k_book.data_ptr<float>();
  const float* vbook = v_book.data_ptr<float>();
  const uint16_t* kmean = reinterpret_cast<const uint16_t*>(k_mean.data_ptr<at::Half>());
  const uint8_t* krms = k_rms.data_ptr<uint8_t>();
  const uint8_t* vrms = v_rms.data_ptr<uint8_t>();
  const uint8_t* vmean = v_mean.data_ptr<uint8_t>();
  const float* f8 = fp8.data_ptr<float>();
  const bool* ok = valid.data_ptr<bool>();
  float* o = out.data_ptr<float>();
  float* mo = mean_out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  const int64_t N = n * T, groups = (R + G - 1) / G;
  at::parallel_for(0, B * H * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ktab(Pk * Ck * G), vacc(Pv * Cv * G), w(N * G), qm(n * G), mean(D);
    std::vector<uint8_t> kix((Pk + 7) / 8 * 8), vix((Pv + 7) / 8 * 8);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / groups, r0 = (task % groups) * G, g = std::min(G, R - r0), b = bh / H;
      const float* qb = q + (bh * R + r0) * D;
      // keys: the tables, then each block's mean score
      for (int64_t p = 0; p < Pk; ++p)
        for (int64_t c = 0; c < Ck; ++c) {
          float* e = ktab.data() + (p * Ck + c) * G;
          for (int64_t r = 0; r < G; ++r) e[r] = r < g ? dot_n(qb + r * D + p * dk, kbook + c * dk, dk) : 0.f;
        }
      for (int64_t blk = 0; blk < n; ++blk) {
        halves_to_floats(kmean + (bh * n + blk) * D, mean.data(), D);
        for (int64_t r = 0; r < G; ++r) qm[blk * G + r] = r < g ? dot_n(qb + r * D, mean.data(), D) : 0.f;
      }
      float m[G], s[G], mv[G], acc[G];
      std::fill(m, m + G, NEG);
      for (int64_t t = 0; t < N; ++t) {
        if (!ok[b * N + t]) continue;
        std::fill(acc, acc + G, 0.f);
        gather_sum(ktab.data(), token_indices(ki + (bh * N + t) * KB, k_planes, Pk, kix.data()), Pk, Ck, acc);
        const float rms = f8[krms[bh * N + t]];
        const float* qmb = qm.data() + (t / T) * G;
        float* wt = w.data() + t * G;
        for (int64_t r = 0; r < G; ++r) {
          wt[r] = rms * acc[r] + qmb[r];
          m[r] = std::max(m[r], wt[r]);
        }
      }
      // values: softmax weights summed per sub-space and centre
      std::fill(s, s + G, 0.f);
      std::fill(mv, mv + G, 0.f);
      std::fill(vacc.begin(), vacc.end(), 0.f);
      for (int64_t t = 0; t < N; ++t) {
        if (!ok[b * N + t]) continue;
        float* wt = w.data() + t * G;
        const float rms = f8[vrms[bh * N + t]], vm = f8[vmean[bh * N + t]];
        for (int64_t r = 0; r < G; ++r) {
          const float x = fexp(wt[r] - m[r]);
          s[r] += x;
          mv[r] += x * vm;
          acc[r] = x * rms;
        }
        scatter_add(vacc.data(), token_indices(vi + (bh * N + t) * VB, v_planes, Pv, vix.data()), Pv, Cv, acc);
      }
      // expanded once per row through the value codebook
      for (int64_t r = 0; r < g; ++r) {
        if (s[r] <= 0.f) continue;  // nothing valid: out 0, lse -inf
        const float inv = 1.f / s[r];
        float* orow = o + (bh * R + r0 + r) * D;
        for (int64_t p = 0; p < Pv; ++p)
          for (int64_t c = 0; c < Cv; ++c) {
            const float x = vacc[(p * Cv + c) * G + r];
            if (x == 0.f) continue;
            for (int64_t i = 0; i < dv; ++i) orow[p * dv + i] += x * vbook[c * dv + i];
          }
        for (int64_t i = 0; i < D; ++i) orow[i] *= inv;
        mo[bh * R + r0 + r] = mv[r] * inv;
        l[bh * R + r0 + r] = m[r] + std::log(s[r]);
      }
    }
  });
  return {out, mean_out, lse};
}
