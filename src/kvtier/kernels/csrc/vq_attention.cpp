// vq_attention: attention of query rows over one tier of vector codes (kvtier.codecs.vq), read in
// place, product-quantization style; built by kvtier/kernels/vq_cpu.py (which documents the
// arguments and the torch reference, kvtier.attention.partials.vq_partial). The routine per
// (batch, KV head) and group of rows is vq_tier.h's (shared with the fused layer call,
// layer_attention.cpp); here the tasks are (batch, KV head, group of 8 rows), in parallel.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

#include "numeric.h"
#include "vq_tier.h"

std::vector<torch::Tensor> vq_attention(torch::Tensor rows, torch::Tensor k_idx, std::vector<int64_t> k_planes,
                                        torch::Tensor k_book, torch::Tensor k_mean, torch::Tensor k_rms,
                                        torch::Tensor v_idx, std::vector<int64_t> v_planes, torch::Tensor v_book,
                                        torch::Tensor v_rms, torch::Tensor v_mean, torch::Tensor valid,
                                        torch::Tensor fp8) {
  TORCH_CHECK(rows.dtype() == torch::kFloat32 && rows.is_contiguous() && rows.dim() == 4, "rows: contiguous float32 [B,H,R,D]");
  const int64_t B = rows.size(0), H = rows.size(1), R = rows.size(2), D = rows.size(3);
  const vq::Tier t = vq::read_tier(k_idx, k_planes, k_book, k_mean, k_rms, v_idx, v_planes, v_book, v_rms, v_mean,
                                   valid, fp8, B, H, D);
  auto out = torch::zeros({B, H, R, D}, rows.options());
  auto mean_out = torch::zeros({B, H, R}, rows.options());
  auto lse = torch::full({B, H, R}, NEG, rows.options());
  const float* q = rows.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* mo = mean_out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  const int64_t groups = (R + vq::G - 1) / vq::G;
  at::parallel_for(0, B * H * groups, 1, [&](int64_t begin, int64_t end) {
    vq::Work wk(t, D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / groups, r0 = (task % groups) * vq::G, g = std::min(vq::G, R - r0);
      const int64_t row = bh * R + r0;
      vq::attend(t, bh, bh / H, q + row * D, g, D, wk, o + row * D, mo + row, l + row);
    }
  });
  return {out, mean_out, lse};
}
