// vllm_paged_decode: whole pages of kvtier's packed vLLM pages (kvtier/codecs/pages.py) decoded into
// token-major rows of the model dtype (prefill chunks attend them through vLLM's own kernels:
// kvtier/vllm/pages/prefill.py). Reference: PageFormat.decode. Built with vllm_paged_attend.cpp (the page
// layout: vllm_paged.h).

#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include "page_codes.h"
#include "numeric.h"
#include "vllm_paged.h"

namespace {

// Decode whole pages into token-major rows of the model dtype: PageFormat.decode(pages, dtype), the
// same fp32 operations ((c - z) * s, then rounded once), written at out[i * T + t, h, :].
template <typename page_t, typename scalar_t>
void decode_impl(const Layout& L, torch::Tensor pages, torch::Tensor pids, torch::Tensor ko, torch::Tensor vo) {
  const int64_t H = L.H, D = L.D, T = L.T, s = L.s, nkg = T / L.kg, nvg = D / L.vg, cb = D / 2, cv = L.vrow();
  const uint8_t* pg = pages.data_ptr<uint8_t>();
  const int64_t* pid = pids.data_ptr<int64_t>();
  scalar_t* kp = ko.data_ptr<scalar_t>();
  scalar_t* vp = vo.data_ptr<scalar_t>();
  at::parallel_for(0, pids.size(0) * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / H, h = task % H;
      const uint8_t* page = pg + pid[i] * L.page;
      const uint16_t* ks = reinterpret_cast<const uint16_t*>(page + L.kscale) + h * nkg * D;
      const uint16_t* kz = reinterpret_cast<const uint16_t*>(page + L.kzero) + h * nkg * D;
      const uint16_t* vs = reinterpret_cast<const uint16_t*>(page + L.vscale) + h * T * nvg;
      const uint16_t* vz = reinterpret_cast<const uint16_t*>(page + L.vzero) + h * T * nvg;
      const page_t* sk = reinterpret_cast<const page_t*>(page + L.sink) + h * s * 2 * D;
      const uint8_t* kc = page + L.kcodes + h * T * cb;
      const uint8_t* vc = page + L.vcodes + h * T * cv;
      for (int64_t t = 0; t < T; ++t) {
        scalar_t* kr = kp + ((i * T + t) * H + h) * D;
        scalar_t* vr = vp + ((i * T + t) * H + h) * D;
        if (t < s) {  // exact sink token, stored in the model dtype
          for (int64_t d = 0; d < D; ++d) {
            kr[d] = static_cast<scalar_t>(static_cast<float>(sk[t * 2 * D + d]));
            vr[d] = static_cast<scalar_t>(static_cast<float>(sk[t * 2 * D + D + d]));
          }
          continue;
        }
        const int64_t g = t / L.kg;
        for (int64_t d = 0; d < D; ++d) {
          const float ck = static_cast<float>((kc[t * cb + d / 2] >> (4 * (d & 1))) & 15);
          const float cvd = static_cast<float>(code_at(vc + t * cv, d, L.vb, D));
          const float k = (ck - half_to_float(kz[g * D + d])) * half_to_float(ks[g * D + d]);
          const float v = (cvd - half_to_float(vz[t * nvg + d / L.vg])) * half_to_float(vs[t * nvg + d / L.vg]);
          kr[d] = static_cast<scalar_t>(k);
          vr[d] = static_cast<scalar_t>(v);
        }
      }
    }
  });
}

}  // namespace

void vllm_paged_decode(
    torch::Tensor pages,      // uint8 [B, page]
    torch::Tensor pids,       // int64 [n]: pages to decode
    torch::Tensor key,        // [n * T, H, D] contiguous, fp32 or the model dtype: written
    torch::Tensor value,      // [n * T, H, D]
    torch::Tensor like,       // any tensor of the model dtype (the dtype of the pages' sink tokens)
    std::vector<int64_t> lay  // as vllm_paged_attend
) {
  const Layout L = read_layout(lay);
  const auto dt = key.scalar_type();
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous() && value.scalar_type() == dt, "key, value: contiguous");
  TORCH_CHECK(key.numel() == pids.numel() * L.T * L.H * L.D && value.numel() == key.numel(), "key, value: [n * T, H, D]");
  TORCH_CHECK(pages.is_contiguous() && pages.size(1) == L.page, "pages: contiguous [B, page]");
  check_index(pids, "pids", 0);
  check_pages(pids, 0, pids.size(0), pages.size(0));
  TORCH_CHECK(dt == like.scalar_type() || dt == torch::kFloat32, "key, value: fp32 or the model dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, like.scalar_type(), "vllm_paged_decode", [&] {
    if (dt == torch::kFloat32)
      decode_impl<scalar_t, float>(L, pages, pids, key, value);
    else
      decode_impl<scalar_t, scalar_t>(L, pages, pids, key, value);
  });
}
