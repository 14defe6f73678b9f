// Codes of kvtier's packed vLLM pages (kvtier/codecs/pages.py) and the bf16 hi + lo split of a row scored
// against them, shared by the page and prefill kernels.
#pragma once
#include <c10/util/Exception.h>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvtier_pages {

// PageFormat.layout(): a page's shape, its field offsets in bytes and its value code width
struct Layout {
  int64_t H, D, T, kg, vg, s, page;
  int64_t kscale, kzero, vscale, vzero, sink, kcodes, vcodes;
  int64_t vb;  // value code width: 4 or 3
  int64_t vrow() const { return D * vb / 8; }  // bytes of one token's value codes
};

inline Layout read_layout(const std::vector<int64_t>& lay) {
  TORCH_CHECK(lay.size() == 15, "layout: 15 ints");
  const Layout L{lay[0], lay[1], lay[2], lay[3], lay[4], lay[5], lay[6], lay[7],
                 lay[8], lay[9], lay[10], lay[11], lay[12], lay[13], lay[14]};
  TORCH_CHECK(L.vb == 4 || (L.vb == 3 && L.D % 8 == 0), "layout: value codes of 4 or 3 bits (D % 8 == 0)");
  return L;
}

// Code of channel d of a D-channel row of vb-bit codes (kvtier.quant.pack_bits: 4 = nibbles, low
// first; 3 = a 2-bit plane of D/4 bytes, then a 1-bit plane of D/8 holding each code's bit 2)
inline int code_at(const uint8_t* row, int64_t d, int64_t vb, int64_t D) {
  if (vb == 4) return (row[d / 2] >> (4 * (d & 1))) & 15;
  return ((row[d / 4] >> (2 * (d & 3))) & 3) | (((row[D / 4 + d / 8] >> (d & 7)) & 1) << 2);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// 32 fp32 x as bf16 hi + lo, each 32 bf16 in order (hi = bf16(x), lo = bf16(x - hi): x to ~2^-17 of
// itself), so that hi . c + lo . c is x . c for codes c exact in bf16
inline void split_bf16_32(const float* x, __m512i& hi, __m512i& lo) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
  const __m512 hb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  hi = h;
  lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
}
#endif

}  // namespace kvtier_pages
