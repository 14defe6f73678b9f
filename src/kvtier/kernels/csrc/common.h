// Shared by the CPU kernels (packed_attention.cpp, layer_attention.cpp); included once per kernel.
//
// The bit-plane term table of kvtier.quant.pack_bits codes: a b-bit code is split into widths 4/2/1
// (8 whole); a width-w plane packs 8/w channels per byte, channel c = j * per + i in byte j of term i;
// glo/ghi are each value group's bytes. And the two token-selection cuts of
// kvtier.attention.sparse.select_tokens (quantile and mass rules).
//
// Everything here sits in an anonymous namespace: each kernel is its own module, built by
// kvtier/kernels/build.py, which puts this file's text in place of the line including it.
#ifndef KVTIER_KERNELS_CSRC_COMMON_H_
#define KVTIER_KERNELS_CSRC_COMMON_H_

#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace {

struct Term {
  int64_t start, nbytes, shift, mask, per, i;
  float weight;
  std::vector<int64_t> glo, ghi;  // byte range of each channel group
};

std::vector<Term> make_terms(int64_t bits, int64_t dim, int64_t group) {
  std::vector<int64_t> widths;
  switch (bits) {
    case 1: widths = {1}; break;
    case 2: widths = {2}; break;
    case 3: widths = {2, 1}; break;
    case 4: widths = {4}; break;
    case 5: widths = {4, 1}; break;
    case 6: widths = {4, 2}; break;
    case 7: widths = {4, 2, 1}; break;
    case 8: widths = {8}; break;
    default: TORCH_CHECK(false, "bits must be in 1..8");
  }
  const int64_t n_pad = bits == 8 ? dim : (dim + 7) / 8 * 8;
  std::vector<Term> terms;
  int64_t start = 0, off = 0;
  for (int64_t w : widths) {
    const int64_t per = 8 / w, size = n_pad / per;
    for (int64_t i = 0; i < per; ++i) {
      Term t{start, size, w * i, (1 << w) - 1, per, i, float(1 << off), {}, {}};
      const int64_t ng = dim / group;
      for (int64_t g = 0; g < ng; ++g) {
        auto ceil_div = [](int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); };
        int64_t lo = std::max<int64_t>(0, ceil_div(g * group - i, per));
        int64_t hi = std::min<int64_t>(size, ceil_div((g + 1) * group - i, per));
        t.glo.push_back(lo);
        t.ghi.push_back(std::max(lo, hi));
      }
      terms.push_back(t);
    }
    start += size;
    off += w;
  }
  return terms;
}

// Quantile rule: keep the scores >= the one at rank ceil(level * nvalid) (descending) of a row's
// valid (finite) scores.
float quantile_threshold(const float* row, int64_t N, int64_t nvalid, double level, std::vector<float>& tmp) {
  tmp.clear();
  for (int64_t x = 0; x < N; ++x) if (row[x] != -std::numeric_limits<float>::infinity()) tmp.push_back(row[x]);
  int64_t rank = std::max<int64_t>(1, (int64_t)std::ceil(level * (double)nvalid)) - 1;
  rank = std::min<int64_t>(rank, nvalid - 1);
  std::nth_element(tmp.begin(), tmp.begin() + rank, tmp.end(), std::greater<float>());
  return tmp[rank];
}

// Mass rule: the last factor-of-two weight bucket kept, dropping at most (1 - level) of the row's
// mass (``sum``: this tier's, ``rest``: the other tokens the row attends, both relative to one max).
int64_t mass_cut(const float* bucket, float sum, float rest, double level) {
  const float target = sum - (1.f - (float)level) * (sum + rest);
  float cum = 0.f;
  int64_t k = 0;
  for (; k < 63; ++k) {
    cum += bucket[k];
    if (cum >= target) break;
  }
  return k;
}

}  // namespace

#endif  // KVTIER_KERNELS_CSRC_COMMON_H_
