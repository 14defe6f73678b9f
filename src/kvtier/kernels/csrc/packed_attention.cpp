// packed_attention: fused attention over one packed tier (k-bit or 1-bit codes), built by
// kvtier/kernels/cpu.py (which documents the arguments and the torch reference it is tested against).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "common.h"
#include "numeric.h"

namespace {

// Codes of one token, bit-plane term by term, as floats (channel order of the terms).
inline void unpack(const uint8_t* code, const std::vector<Term>& terms, float* u) {
  for (const auto& t : terms) {
    const uint8_t* by = code + t.start;
    const int sh = (int)t.shift, mk = (int)t.mask;
#pragma omp simd
    for (int64_t j = 0; j < t.nbytes; ++j) u[j] = float((by[j] >> sh) & mk);
    u += t.nbytes;
  }
}

}  // namespace

std::vector<torch::Tensor> packed_attention(
    torch::Tensor rows, torch::Tensor k_codes, torch::Tensor k_a, torch::Tensor k_b,
    torch::Tensor v_codes, torch::Tensor v_a, torch::Tensor v_b, torch::Tensor valid,
    torch::Tensor blocks, torch::Tensor row_mask, int64_t bits, int64_t dim,
    int64_t sel_method, double sel_level, torch::Tensor forced_from, int64_t tier_start,
    torch::Tensor rest_lse) {
  TORCH_CHECK(rows.dtype() == torch::kFloat32 && rows.is_contiguous(), "rows: contiguous float32");
  const int64_t B = rows.size(0), H = rows.size(1), R = rows.size(2), D = rows.size(3);
  TORCH_CHECK(D == dim, "rows last axis must be dim");
  const int64_t n = k_codes.size(2), T = k_codes.size(3), P = k_codes.size(4);
  const int64_t NG = v_a.size(4), G = dim / NG;
  const bool sel = blocks.numel() > 0;
  const int64_t K = sel ? blocks.size(2) : n;
  const bool rmask = row_mask.numel() > 0;
  const auto terms = make_terms(bits, dim, G);
  int64_t npos = 0;
  for (const auto& t : terms) npos += t.nbytes;

  auto out = torch::zeros({B, H, R, D}, rows.options());
  auto lse = torch::empty({B, H, R}, rows.options());
  // per (b, h): pairs scored, pairs valued, tokens whose value bytes were read
  auto counts = torch::zeros({B * H, 3}, torch::kInt64);
  int64_t* cnt = counts.data_ptr<int64_t>();
  const int64_t* ff = sel_method ? forced_from.data_ptr<int64_t>() : nullptr;
  const float* rl = rest_lse.numel() > 0 ? rest_lse.data_ptr<float>() : nullptr;
  const float LN2 = std::log(2.0f);
  const float* q = rows.data_ptr<float>();
  const uint8_t* kc = k_codes.data_ptr<uint8_t>();
  const uint8_t* vc = v_codes.data_ptr<uint8_t>();
  const float* ka = k_a.data_ptr<float>();
  const float* kb = k_b.data_ptr<float>();
  const float* va = v_a.data_ptr<float>();
  const float* vb = v_b.data_ptr<float>();
  const bool* ok = valid.data_ptr<bool>();
  const int64_t* bl = sel ? blocks.data_ptr<int64_t>() : nullptr;
  const bool* rm = rmask ? row_mask.data_ptr<bool>() : nullptr;
  float* o = out.data_ptr<float>();
  float* ls = lse.data_ptr<float>();

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(R * K * T), qs(R * npos), bias(R), vacc(R * npos), zacc(R * NG), tot(R);
    std::vector<float> tmp, u(npos), ex(K * T);
    std::vector<int> bk(K * T);
    std::vector<uint8_t> read_tok(K * T);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H;
      const float* qb = q + bh * R * D;
      auto block_of = [&](int64_t s) { return sel ? bl[bh * K + s] : s; };
      // scores
      for (int64_t s = 0; s < K; ++s) {
        const int64_t blk = block_of(s);
        float* scs = sc.data() + s * T;
        if (blk < 0) {
          for (int64_t r = 0; r < R; ++r) std::fill(scs + r * K * T, scs + r * K * T + T, NEG);
          continue;
        }
        const float* a = ka + (bh * n + blk) * D;
        const float* bo = kb + (bh * n + blk) * D;
        for (int64_t r = 0; r < R; ++r) {
          float acc = 0.f;
          for (int64_t c = 0; c < D; ++c) acc += qb[r * D + c] * bo[c];
          bias[r] = acc;
          int64_t pos = 0;
          for (const auto& t : terms) {
            float* dst = qs.data() + r * npos + pos;
            for (int64_t j = 0; j < t.nbytes; ++j) {
              const int64_t c = j * t.per + t.i;
              dst[j] = c < D ? qb[r * D + c] * a[c] * t.weight : 0.f;
            }
            pos += t.nbytes;
          }
        }
        const uint8_t* codes = kc + ((bh * n + blk) * T) * P;
        const bool* okb = ok + (b * n + blk) * T;
        for (int64_t tt = 0; tt < T; ++tt) {
          if (!okb[tt]) {
            for (int64_t r = 0; r < R; ++r) scs[r * K * T + tt] = NEG;
            continue;
          }
          unpack(codes + tt * P, terms, u.data());
          for (int64_t r = 0; r < R; ++r) {
            float* dst = scs + r * K * T + tt;
            if (rmask && !rm[(bh * R + r) * K + s]) { *dst = NEG; continue; }
            *dst = bias[r] + dot_reduce(qs.data() + r * npos, u.data(), npos);
          }
        }
      }
      // softmax (unnormalized probabilities kept in sc); optional token selection
      std::fill(read_tok.begin(), read_tok.end(), 0);
      for (int64_t r = 0; r < R; ++r) {
        float* row = sc.data() + r * K * T;
        const int64_t N = K * T;
        float m = NEG;
        int64_t nvalid = 0;
        for (int64_t x = 0; x < N; ++x) {
          m = std::max(m, row[x]);
          nvalid += row[x] != NEG;
        }
        cnt[bh * 3 + 0] += nvalid;
        if (m == NEG) { tot[r] = 0.f; ls[bh * R + r] = NEG; std::fill(row, row + N, 0.f); continue; }
        float* e = sel_method ? ex.data() : row;  // without selection: in place
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t x = 0; x < N; ++x) {
          e[x] = row[x] == NEG ? 0.f : std::exp(row[x] - m);
          sum += e[x];
        }
        ls[bh * R + r] = m + std::log(sum);
        if (!sel_method) {
          tot[r] = sum;
          for (int64_t x = 0; x < N; ++x) read_tok[x] |= e[x] > 0.f;
          cnt[bh * 3 + 1] += nvalid;
          continue;
        }
        float thr = NEG;     // quantile: keep scores >= thr
        int64_t kstar = 64;  // mass: keep buckets <= kstar
        if (sel_method == 2) {
          thr = quantile_threshold(row, N, nvalid, sel_level, tmp);
        } else {
          for (int64_t x = 0; x < N; ++x)
            bk[x] = row[x] == NEG ? 63 : (int)std::min(63.f, std::floor((m - row[x]) / LN2));
          float bucket[64] = {0.f};
          for (int64_t x = 0; x < N; ++x) bucket[bk[x]] += e[x];
          // drop at most (1 - level) of the row's mass: this tier's plus the rest it attends
          kstar = mass_cut(bucket, sum, rl ? std::exp(rl[bh * R + r] - m) : 0.f, sel_level);
        }
        float kept = 0.f;
        int64_t nkept = 0;
        for (int64_t x = 0; x < N; ++x) {
          if (row[x] == NEG) { row[x] = 0.f; continue; }
          bool keep = sel_method == 1 ? bk[x] <= kstar : row[x] >= thr;
          if (!keep) {
            const int64_t pos = tier_start + block_of(x / T) * T + x % T;
            keep = pos >= ff[r];  // local window
          }
          row[x] = keep ? e[x] : 0.f;
          kept += row[x];
          if (keep) { read_tok[x] = 1; ++nkept; }
        }
        cnt[bh * 3 + 1] += nkept;
        tot[r] = kept;
      }
      for (int64_t x = 0; x < K * T; ++x) cnt[bh * 3 + 2] += read_tok[x];
      // values
      std::fill(vacc.begin(), vacc.end(), 0.f);
      std::fill(zacc.begin(), zacc.end(), 0.f);
      for (int64_t s = 0; s < K; ++s) {
        const int64_t blk = block_of(s);
        if (blk < 0) continue;
        const uint8_t* codes = vc + ((bh * n + blk) * T) * P;
        const bool* okb = ok + (b * n + blk) * T;
        for (int64_t tt = 0; tt < T; ++tt) {
          if (!okb[tt]) continue;
          const float* a = va + ((bh * n + blk) * T + tt) * NG;
          const float* bo = vb + ((bh * n + blk) * T + tt) * NG;
          bool unpacked = false;
          for (int64_t r = 0; r < R; ++r) {
            const float p = sc[r * K * T + s * T + tt];
            if (p == 0.f) continue;
            if (!unpacked) { unpack(codes + tt * P, terms, u.data()); unpacked = true; }
            for (int64_t g = 0; g < NG; ++g) zacc[r * NG + g] += p * bo[g];
            float* acc = vacc.data() + r * npos;
            const float* uu = u.data();
            if (NG == 1) {
              const float pa = p * a[0];
#pragma omp simd
              for (int64_t j = 0; j < npos; ++j) acc[j] += pa * uu[j];
              continue;
            }
            for (const auto& t : terms) {
              for (int64_t g = 0; g < NG; ++g) {
                const float pa = p * a[g];
#pragma omp simd
                for (int64_t j = t.glo[g]; j < t.ghi[g]; ++j) acc[j] += pa * uu[j];
              }
              acc += t.nbytes;
              uu += t.nbytes;
            }
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        if (tot[r] == 0.f) continue;
        float* dst = o + (bh * R + r) * D;
        const float* acc = vacc.data() + r * npos;
        for (const auto& t : terms) {
          for (int64_t j = 0; j < t.nbytes; ++j) {
            const int64_t c = j * t.per + t.i;
            if (c < D) dst[c] += acc[j] * t.weight;
          }
          acc += t.nbytes;
        }
        const float inv = 1.f / tot[r];
        for (int64_t c = 0; c < D; ++c) dst[c] = (dst[c] + zacc[r * NG + c / G]) * inv;
      }
    }
  });
  return {out, lse, counts};
}
