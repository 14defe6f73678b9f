// Codes of kvtier's packed vLLM pages (kvtier/vllm/pages.py), shared by the page and prefill kernels.
#pragma once
#include <cstdint>

namespace kvtier_pages {

// Code of channel d of a D-channel row of vb-bit codes (kvtier.quant.pack_bits: 4 = nibbles, low
// first; 3 = a 2-bit plane of D/4 bytes, then a 1-bit plane of D/8 holding each code's bit 2)
inline int code_at(const uint8_t* row, int64_t d, int64_t vb, int64_t D) {
  if (vb == 4) return (row[d / 2] >> (4 * (d & 1))) & 15;
  return ((row[d / 4] >> (2 * (d & 3))) & 3) | (((row[D / 4 + d / 8] >> (d & 7)) & 1) << 2);
}

}  // namespace kvtier_pages
