// vq_attention: attention of query rows over one tier of vector codes (kvtier.codecs.vq), read in
// place; built by kvtier/kernels/vq_cpu.py (which documents the arguments and the torch reference).
//
// Per (batch, KV head), in parallel: per stored token its centre indices are unpacked from their bit
// planes (widths given by the caller from kvtier.quant.planes: the codec owns them), its key is
// rebuilt in one D-float tile from the codebook (centre * rms + the block's channel mean) and scored
// against every row sharing the head; a safe two-pass softmax follows, then each value tile
// (centre * rms) is accumulated with the rows' weights and the values' token means apart. Nothing
// larger than a token's tile is decoded.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "numeric.h"

namespace {

// Indices of one token: P codes packed along the last axis in planes of the given widths (each
// dividing 8; LSB first within a byte, plane after plane, each padded to a multiple of 8 codes).
inline void unpack_indices(const uint8_t* bytes, const std::vector<int64_t>& widths, int64_t P, int32_t* idx) {
  if (widths.size() == 1 && widths[0] == 8) {
    for (int64_t j = 0; j < P; ++j) idx[j] = bytes[j];
    return;
  }
  const int64_t P_pad = (P + 7) / 8 * 8;
  for (int64_t j = 0; j < P; ++j) idx[j] = 0;
  int64_t start = 0, offset = 0;
  for (const int64_t w : widths) {
    const int64_t per = 8 / w, mask = (1 << w) - 1;
    for (int64_t j = 0; j < P; ++j) {
      const int64_t code = (bytes[start + j / per] >> ((j % per) * w)) & mask;
      idx[j] |= int32_t(code << offset);
    }
    start += P_pad / per;
    offset += w;
  }
}

}  // namespace

std::vector<torch::Tensor> vq_attention(torch::Tensor rows, torch::Tensor k_idx, std::vector<int64_t> k_planes,
                                        torch::Tensor k_book, torch::Tensor k_mean, torch::Tensor k_rms,
                                        torch::Tensor v_idx, std::vector<int64_t> v_planes, torch::Tensor v_book,
                                        torch::Tensor v_rms, torch::Tensor v_mean, torch::Tensor valid) {
  TORCH_CHECK(rows.dtype() == torch::kFloat32 && rows.is_contiguous(), "rows: contiguous float32");
  for (const auto& t : {k_book, k_mean, k_rms, v_book, v_rms, v_mean})
    TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(), "books and parameters: contiguous float32");
  TORCH_CHECK(k_idx.dtype() == torch::kUInt8 && v_idx.dtype() == torch::kUInt8, "indices: uint8");
  const int64_t B = rows.size(0), H = rows.size(1), R = rows.size(2), D = rows.size(3);
  const int64_t n = k_idx.size(2), T = k_idx.size(3), KB = k_idx.size(4), VB = v_idx.size(4);
  const int64_t dk = k_book.size(1), dv = v_book.size(1), Pk = D / dk, Pv = D / dv;
  TORCH_CHECK(Pk * dk == D && Pv * dv == D, "the codebooks' sub-vectors do not tile head_dim");
  auto out = torch::zeros({B, H, R, D}, rows.options());
  auto mean_out = torch::zeros({B, H, R}, rows.options());
  auto lse = torch::full({B, H, R}, NEG, rows.options());
  const float* q = rows.data_ptr<float>();
  const uint8_t* ki = k_idx.data_ptr<uint8_t>();
  const uint8_t* vi = v_idx.data_ptr<uint8_t>();
  const float* kbook = k_book.data_ptr<float>();
  const float* vbook = v_book.data_ptr<float>();
  const float* kmean = k_mean.data_ptr<float>();
  const float* krms = k_rms.data_ptr<float>();
  const float* vrms = v_rms.data_ptr<float>();
  const float* vmean = v_mean.data_ptr<float>();
  const bool* ok = valid.data_ptr<bool>();
  float* o = out.data_ptr<float>();
  float* mo = mean_out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  const int64_t N = n * T;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(R * N), tile(D), m(R), s(R);
    std::vector<int32_t> idx(std::max(Pk, Pv));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H;
      const float* qb = q + bh * R * D;
      std::fill(m.begin(), m.end(), NEG);
      for (int64_t blk = 0; blk < n; ++blk) {
        const float* mean = kmean + (bh * n + blk) * D;
        for (int64_t tt = 0; tt < T; ++tt) {
          const int64_t t = blk * T + tt;
          if (!ok[b * N + t]) {
            for (int64_t r = 0; r < R; ++r) scores[r * N + t] = NEG;
            continue;
          }
          unpack_indices(ki + (bh * N + t) * KB, k_planes, Pk, idx.data());
          const float rms = krms[bh * N + t];
          for (int64_t p = 0; p < Pk; ++p) {
            const float* c = kbook + int64_t(idx[p]) * dk;
            for (int64_t i = 0; i < dk; ++i) tile[p * dk + i] = c[i] * rms + mean[p * dk + i];
          }
          for (int64_t r = 0; r < R; ++r) {
            const float x = dot_n(qb + r * D, tile.data(), D);
            scores[r * N + t] = x;
            m[r] = std::max(m[r], x);
          }
        }
      }
      std::fill(s.begin(), s.end(), 0.f);
      float* ob = o + bh * R * D;
      float* mb = mo + bh * R;
      for (int64_t t = 0; t < N; ++t) {
        if (!ok[b * N + t]) continue;
        unpack_indices(vi + (bh * N + t) * VB, v_planes, Pv, idx.data());
        const float rms = vrms[bh * N + t];
        for (int64_t p = 0; p < Pv; ++p) {
          const float* c = vbook + int64_t(idx[p]) * dv;
          for (int64_t i = 0; i < dv; ++i) tile[p * dv + i] = c[i] * rms;
        }
        for (int64_t r = 0; r < R; ++r) {
          const float wr = std::exp(scores[r * N + t] - m[r]);
          s[r] += wr;
          mb[r] += wr * vmean[bh * N + t];
          float* orow = ob + r * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) orow[i] += wr * tile[i];
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        if (s[r] <= 0.f) continue;  // nothing valid: out 0, lse -inf
        const float inv = 1.f / s[r];
        for (int64_t i = 0; i < D; ++i) ob[r * D + i] *= inv;
        mb[r] *= inv;
        l[bh * R + r] = m[r] + std::log(s[r]);
      }
    }
  });
  return {out, mean_out, lse};
}
