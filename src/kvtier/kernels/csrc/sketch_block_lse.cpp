// sketch_block_lse: per-block log-sum-exp of 1-bit key-sketch scores (offload block selection),
// built by kvtier/kernels/sketch_cpu.py (which documents the arguments and the torch reference).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

#include "numeric.h"

// score(token) = q . mean + alpha_t * (2 w . bits - w . 1), w = q * scale; one lse per (row, block).
torch::Tensor sketch_block_lse(torch::Tensor rows, torch::Tensor signs, torch::Tensor scale, torch::Tensor mean,
                               torch::Tensor alpha, torch::Tensor valid) {
  TORCH_CHECK(rows.dtype() == torch::kFloat32 && rows.is_contiguous(), "rows: contiguous float32");
  const int64_t B = rows.size(0), H = rows.size(1), R = rows.size(2), D = rows.size(3);
  const int64_t n = signs.size(2), T = signs.size(3), P = signs.size(4), Dp = 8 * P;
  TORCH_CHECK(Dp >= D, "signs do not cover head_dim");
  auto out = torch::empty({B, H, R, n}, rows.options());
  const float* q = rows.data_ptr<float>();
  const uint8_t* sg = signs.data_ptr<uint8_t>();
  const float* ks = scale.data_ptr<float>();
  const float* km = mean.data_ptr<float>();
  const float* al = alpha.data_ptr<float>();
  const bool* ok = valid.data_ptr<bool>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(R * Dp, 0.f), bias(R), wsum(R), m(R), s(R);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H;
      const float* qb = q + bh * R * D;
      for (int64_t blk = 0; blk < n; ++blk) {
        const float* sb = ks + (bh * n + blk) * D;
        const float* mb = km + (bh * n + blk) * D;
        for (int64_t r = 0; r < R; ++r) {
          float acc = 0.f, ws = 0.f;
          for (int64_t c = 0; c < D; ++c) {
            acc += qb[r * D + c] * mb[c];
            w[r * Dp + c] = qb[r * D + c] * sb[c];
            ws += w[r * Dp + c];
          }
          bias[r] = acc;
          wsum[r] = ws;
          m[r] = NEG;
          s[r] = 0.f;
        }
        const bool* okb = ok + (b * n + blk) * T;
        const float* ab = al + (bh * n + blk) * T;
        const uint8_t* codes = sg + (bh * n + blk) * T * P;
        for (int64_t tt = 0; tt < T; ++tt) {
          if (!okb[tt]) continue;
          const uint8_t* code = codes + tt * P;
          for (int64_t r = 0; r < R; ++r) {
            const float* wr = w.data() + r * Dp;
            float dot = 0.f;
            for (int64_t j = 0; j < P; ++j) {
              const float* bt = kBits.v[code[j]];
              const float* wj = wr + 8 * j;
#pragma omp simd reduction(+ : dot)
              for (int i = 0; i < 8; ++i) dot += wj[i] * bt[i];
            }
            const float x = bias[r] + ab[tt] * (2.f * dot - wsum[r]);
            if (x > m[r]) {
              s[r] = s[r] * std::exp(m[r] - x) + 1.f;
              m[r] = x;
            } else {
              s[r] += std::exp(x - m[r]);
            }
          }
        }
        for (int64_t r = 0; r < R; ++r) o[(bh * R + r) * n + blk] = m[r] == NEG ? NEG : m[r] + std::log(s[r]);
      }
    }
  });
  return out;
}
