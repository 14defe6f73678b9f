// vllm_paged_update: one layer's update of one vLLM step over kvtier's packed pages
// (kvtier/codecs/pages.py): packs the blocks this step fills (KIVI page of 4-bit keys and 4- or 3-bit
// values, the bytes of PageFormat.encode) and writes the other new tokens into the side buffer.
// Per (block, kv head) task: gather_rows, encode_keys, encode_values. Reference:
// kvtier.vllm.pages.paged.update_pages. Built with vllm_paged_attend.cpp (the page layout: vllm_paged.h).

#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include "codec_constants.h"
#include "page_codes.h"
#include "numeric.h"
#include "vllm_paged.h"

namespace {

// Inverse of code_at for a whole row: codes [D] (< 2**vb) into row [D * vb / 8]
inline void pack_row(const uint8_t* codes, int64_t D, int64_t vb, uint8_t* row) {
  if (vb == 4) {
    for (int64_t i = 0; i < D / 2; ++i) row[i] = codes[2 * i] | (codes[2 * i + 1] << 4);
    return;
  }
  std::memset(row, 0, D * vb / 8);
  for (int64_t d = 0; d < D; ++d) {
    row[d / 4] |= (codes[d] & 3) << (2 * (d & 3));
    row[D / 4 + d / 8] |= ((codes[d] >> 2) & 1) << (d & 7);
  }
}

// kvtier.quant.fit_scale_zero for one group: fp16 bits of (scale, zero) from fp32 min / max
// (mn > mx: a group without valid entries). The same fp32 operations, so the same fp16 values; its
// constants (ZERO_MAX, SCALE_EPS, SCALE_ROUND) come from Python (codec_constants.h, kvtier.codecs.constants).
inline void fit_scale_zero(float mn, float mx, float qmax, uint16_t& scale_h, uint16_t& zero_h, float& scale,
                           float& zero) {
  using namespace kvtier_codec;
  if (mn > mx) mn = mx = 0.f;
  const float amax = std::max(std::fabs(mn), std::fabs(mx));
  float s = std::max((mx - mn) / qmax, amax / kZeroMax);
  s = std::max(s, kScaleEps);
  scale_h = float_to_half_bits(s * (1.f + kScaleRound));
  scale = half_to_float(scale_h);
  zero_h = float_to_half_bits(-mn / scale);
  zero = half_to_float(zero_h);
}

inline uint8_t code_of(float x, float scale, float zero, float qmax) {
  const float c = std::nearbyint(x / scale + zero);  // torch.round: half to even
  return static_cast<uint8_t>(std::min(qmax, std::max(0.f, c)));
}

// The rows a step writes: its new keys and values [N, H, D] and the layer's side buffer.
template <typename scalar_t>
struct NewRows {
  scalar_t* sp;
  const scalar_t *kp, *vp;
  int64_t ks0, ks1, vs0, vs1;
  int64_t side_row;  // one token of a side slot: [2, H, D]
};

// Block rows of head h as fp32 k, v [T, D]: side rows of `slot` before `start`, then the new tokens
// from `first`; the first s (sink) rows also copied exact into the page.
template <typename scalar_t>
void gather_rows(const Layout& L, const NewRows<scalar_t>& N, int64_t h, int64_t slot, int64_t start, int64_t first,
                 uint8_t* page, float* k, float* v) {
  const int64_t H = L.H, D = L.D, T = L.T, s = L.s;
  for (int64_t t = 0; t < T; ++t) {
    const scalar_t* kr =
        t < start ? N.sp + (slot * T + t) * N.side_row + h * D : N.kp + (first + t - start) * N.ks0 + h * N.ks1;
    const scalar_t* vr =
        t < start ? N.sp + (slot * T + t) * N.side_row + H * D + h * D : N.vp + (first + t - start) * N.vs0 + h * N.vs1;
    load_row(kr, k + t * D, D);
    load_row(vr, v + t * D, D);
    if (t < s) {
      scalar_t* sk = reinterpret_cast<scalar_t*>(page + L.sink) + ((h * s + t) * 2) * D;
      std::memcpy(sk, kr, D * sizeof(scalar_t));
      std::memcpy(sk + D, vr, D * sizeof(scalar_t));
    }
  }
}

// Keys of head h: per channel over each group of kg tokens (the block's first s tokens left out of
// the range), 4-bit codes packed into the page.
void encode_keys(const Layout& L, int64_t h, const float* k, uint8_t* codes, uint8_t* page) {
  const int64_t D = L.D, T = L.T, s = L.s, kg = L.kg, nkg = T / kg, cb = D / 2;
  uint16_t* ksc = reinterpret_cast<uint16_t*>(page + L.kscale) + h * nkg * D;
  uint16_t* kzr = reinterpret_cast<uint16_t*>(page + L.kzero) + h * nkg * D;
  for (int64_t g = 0; g < nkg; ++g) {
    for (int64_t d = 0; d < D; ++d) {
      float mn = kInf, mx = -kInf;
      for (int64_t t = std::max(g * kg, s); t < (g + 1) * kg; ++t) {
        mn = std::min(mn, k[t * D + d]);
        mx = std::max(mx, k[t * D + d]);
      }
      float scale, zero;
      fit_scale_zero(mn, mx, 15.f, ksc[g * D + d], kzr[g * D + d], scale, zero);
      for (int64_t t = g * kg; t < (g + 1) * kg; ++t) codes[t * D + d] = code_of(k[t * D + d], scale, zero, 15.f);
    }
  }
  uint8_t* kc = page + L.kcodes + h * T * cb;
  for (int64_t t = 0; t < T; ++t) pack_row(codes + t * D, D, 4, kc + t * cb);
}

// Values of head h: per token over groups of vg channels, vb-bit codes packed into the page.
void encode_values(const Layout& L, int64_t h, const float* v, uint8_t* codes, uint8_t* page) {
  const int64_t D = L.D, T = L.T, vg = L.vg, nvg = D / vg, cv = L.vrow();
  const float vmax = static_cast<float>((1 << L.vb) - 1);
  uint16_t* vsc = reinterpret_cast<uint16_t*>(page + L.vscale) + h * T * nvg;
  uint16_t* vzr = reinterpret_cast<uint16_t*>(page + L.vzero) + h * T * nvg;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t gg = 0; gg < nvg; ++gg) {
      const float* x = v + t * D + gg * vg;
      float mn = kInf, mx = -kInf;
      for (int64_t d = 0; d < vg; ++d) {
        mn = std::min(mn, x[d]);
        mx = std::max(mx, x[d]);
      }
      float scale, zero;
      fit_scale_zero(mn, mx, vmax, vsc[t * nvg + gg], vzr[t * nvg + gg], scale, zero);
      for (int64_t d = 0; d < vg; ++d) codes[t * D + gg * vg + d] = code_of(x[d], scale, zero, vmax);
    }
  }
  uint8_t* vc = page + L.vcodes + h * T * cv;
  for (int64_t t = 0; t < T; ++t) pack_row(codes + t * D, D, L.vb, vc + t * cv);
}

// update_layer (kvtier.vllm.pages.paged): pack the blocks this step fills (gather_rows, encode_keys,
// encode_values; reads side rows: before any side write), then the other new tokens into their side rows.
template <typename scalar_t>
void update_impl(const Layout& L, torch::Tensor pages, torch::Tensor side, torch::Tensor key, torch::Tensor value,
                 torch::Tensor enc, torch::Tensor writes) {
  const int64_t H = L.H, D = L.D, T = L.T;
  const NewRows<scalar_t> N{side.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
                            key.stride(0), key.stride(1), value.stride(0), value.stride(1), 2 * H * D};
  uint8_t* pg = pages.data_ptr<uint8_t>();
  const int64_t* en = enc.data_ptr<int64_t>();
  const int64_t used = L.vcodes + H * T * L.vrow();
  at::parallel_for(0, enc.size(0) * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> k(T * D), v(T * D);
    std::vector<uint8_t> codes(T * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const int64_t* e = en + 4 * b;  // page, side slot, side rows, first new token
      uint8_t* page = pg + e[0] * L.page;
      if (h == 0) std::memset(page + used, 0, L.page - used);
      gather_rows(L, N, h, e[1], e[2], e[3], page, k.data(), v.data());
      encode_keys(L, h, k.data(), codes.data(), page);
      encode_values(L, h, v.data(), codes.data(), page);
    }
  });
  const int64_t* w = writes.data_ptr<int64_t>();
  for (int64_t i = 0; i < writes.size(0); ++i) {
    const int64_t row = w[2 * i], tok = w[2 * i + 1];
    scalar_t* dst = N.sp + row * N.side_row;
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(dst + h * D, N.kp + tok * N.ks0 + h * N.ks1, D * sizeof(scalar_t));
      std::memcpy(dst + H * D + h * D, N.vp + tok * N.vs0 + h * N.vs1, D * sizeof(scalar_t));
    }
  }
}

}  // namespace

void vllm_paged_update(
    torch::Tensor pages,      // uint8 [B, page]
    torch::Tensor side,       // [slots, T, 2, H, D]
    torch::Tensor key,        // [N, H, D]
    torch::Tensor value,      // [N, H, D]
    torch::Tensor enc,        // int64 [E, 4]: page, side slot, side rows, first new token of each block to pack
    torch::Tensor writes,     // int64 [W, 2]: side row (slot * T + offset), new token
    std::vector<int64_t> lay  // as vllm_paged_attend
) {
  const Layout L = read_layout(lay);
  const auto dt = key.scalar_type();
  check_rows(key, "key", dt);
  check_rows(value, "value", dt);
  TORCH_CHECK(side.is_contiguous() && side.scalar_type() == dt && side.dim() == 5, "side: contiguous [slots, T, 2, H, D]");
  TORCH_CHECK(pages.is_contiguous() && pages.size(1) == L.page, "pages: contiguous [B, page]");
  TORCH_CHECK(L.D % 2 == 0 && L.T % L.kg == 0 && L.D % L.vg == 0, "layout");
  check_index(enc, "enc", 4);
  check_index(writes, "writes", 2);
  TORCH_CHECK(key.size(1) == L.H && value.size(1) == L.H && key.size(2) == L.D && value.size(2) == L.D,
              "key, value: [N, H, D] of the layout's heads and head_dim");
  TORCH_CHECK(side.size(1) == L.T && side.size(2) == 2 && side.size(3) == L.H && side.size(4) == L.D,
              "side: [slots, T, 2, H, D] of the layout");
  {
    const int64_t N = std::min(key.size(0), value.size(0)), slots = side.size(0);
    const int64_t* en = enc.data_ptr<int64_t>();
    for (int64_t b = 0; b < enc.size(0); ++b) {
      const int64_t* e = en + 4 * b;  // page, side slot, side rows, first new token
      TORCH_CHECK(0 <= e[0] && e[0] < pages.size(0), "enc[", b, "]: page ", e[0], " is outside the ", pages.size(0),
                  " pages");
      TORCH_CHECK(0 <= e[2] && e[2] <= L.T && (e[2] == 0 || (0 <= e[1] && e[1] < slots)), "enc[", b, "]: side slot ",
                  e[1], " with ", e[2], " rows is outside ", slots, " slots of ", L.T, " rows");
      TORCH_CHECK(e[2] == L.T || (0 <= e[3] && e[3] + L.T - e[2] <= N), "enc[", b, "]: new tokens from ", e[3],
                  " run past the ", N, " rows of key and value");
    }
    const int64_t* wr = writes.data_ptr<int64_t>();
    for (int64_t i = 0; i < writes.size(0); ++i)
      TORCH_CHECK(0 <= wr[2 * i] && wr[2 * i] < slots * L.T && 0 <= wr[2 * i + 1] && wr[2 * i + 1] < N, "writes[", i,
                  "]: side row ", wr[2 * i], " / token ", wr[2 * i + 1], " outside ", slots * L.T, " side rows / ", N,
                  " new tokens");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "vllm_paged_update",
                                  [&] { update_impl<scalar_t>(L, pages, side, key, value, enc, writes); });
}
