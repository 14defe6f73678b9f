// The pieces the three parts of the vLLM page kernel share (vllm_paged_attend.cpp,
// vllm_paged_encode.cpp, vllm_paged_decode.cpp, built as one module by kvtier/kernels/vllm_paged_cpu.py):
// rows of the model dtype to and from fp32, and the checks of the entry points' index tensors. The
// page itself (layout, code widths) is page_codes.h's; include it, and numeric.h, before this file.
//
// Page of one block (byte offsets given by the caller): kscale/kzero fp16 [H, T/kg, D],
// vscale/vzero fp16 [H, T, D/vg], sink [H, s, 2, D] (model dtype), kcodes uint8 [H, T, D/2] (4-bit
// codes, low nibble first), vcodes uint8 [H, T, D*vb/8] (vb = 4, or 3: kvtier.quant.pack_bits's
// planes, a 2-bit plane of D/4 bytes then a 1-bit plane of D/8). Keys are (c - z) * s per channel,
// values per token group.
#ifndef KVTIER_KERNELS_CSRC_VLLM_PAGED_H_
#define KVTIER_KERNELS_CSRC_VLLM_PAGED_H_

#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {
using kvtier_pages::code_at;
using kvtier_pages::Layout;
using kvtier_pages::read_layout;

constexpr float kInf = std::numeric_limits<float>::infinity();

// A row of D elements of the model dtype as fp32 (times mul).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t D, float mul = 1.f) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * mul;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t D, float mul) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d] * mul);
}

void check_rows(const torch::Tensor& x, const char* what, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.scalar_type() == dtype, what,
              ": [N, heads, D] with contiguous rows in the model dtype");
}

void check_index(const torch::Tensor& x, const char* what, int64_t cols) {
  TORCH_CHECK(x.scalar_type() == torch::kInt64 && x.is_contiguous() && (cols == 0 ? x.dim() == 1 : x.dim() == 2 && x.size(1) == cols),
              what, ": contiguous int64 index of the wrong shape");
}

// Every index the kernels follow lies in range: a wrong one is a one-line error naming it, never a
// read or write out of bounds. O(requests + pages) per call.
void check_pages(const torch::Tensor& pids, int64_t from, int64_t to, int64_t npages) {
  const int64_t* pid = pids.data_ptr<int64_t>();
  for (int64_t i = from; i < to; ++i)
    TORCH_CHECK(0 <= pid[i] && pid[i] < npages, "pids[", i, "] = ", pid[i], " is outside the ", npages, " pages");
}

}  // namespace

#endif  // KVTIER_KERNELS_CSRC_VLLM_PAGED_H_
