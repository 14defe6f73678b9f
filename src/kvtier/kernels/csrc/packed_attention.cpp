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

// One tier's tensors of one call (packed_partial's arguments): codes [B,H,n,T,P] and their affine
// parameters, valid [B,n,T], the selected blocks [B,H,K] (sel) and row mask [B,H,R,K] (rmask).
struct Tier {
  const uint8_t *kc, *vc;
  const float *ka, *kb, *va, *vb;
  const bool* ok;
  const int64_t* bl;
  const bool* rm;
  int64_t H, R, D, n, T, P, NG, G, K, npos;
  bool sel, rmask;
  std::vector<Term> terms;
  int64_t block_of(int64_t bh, int64_t s) const { return sel ? bl[bh * K + s] : s; }
};

// Token selection (kvtier.attention.sparse.select_tokens): method 0 none, 1 mass, 2 quantile.
struct Select {
  int64_t method;
  double level;
  const int64_t* ff;  // forced_from [R]: the first position of each row's local window
  const float* rl;    // rest_lse [B*H*R] or null
  int64_t tier_start;
  float LN2;
};

// One task's buffers.
struct Buffers {
  std::vector<float> sc, qs, bias, vacc, zacc, tot;
  std::vector<float> tmp, u, ex;
  std::vector<int> bk;
  std::vector<uint8_t> read_tok;
  explicit Buffers(const Tier& t)
      : sc(t.R * t.K * t.T), qs(t.R * t.npos), bias(t.R), vacc(t.R * t.npos), zacc(t.R * t.NG), tot(t.R),
        u(t.npos), ex(t.K * t.T), bk(t.K * t.T), read_tok(t.K * t.T) {}
};

// Key scores sc[r * K * T + s * T + tt] = q_r . (a * codes + b) of each selected block's tokens
// (-inf where invalid, masked for the row, or the block slot is empty).
void key_scores(const Tier& t, int64_t bh, const float* qb, Buffers& w) {
  const int64_t b = bh / t.H, R = t.R, D = t.D, K = t.K, T = t.T, P = t.P, npos = t.npos;
  for (int64_t s = 0; s < K; ++s) {
    const int64_t blk = t.block_of(bh, s);
    float* scs = w.sc.data() + s * T;
    if (blk < 0) {
      for (int64_t r = 0; r < R; ++r) std::fill(scs + r * K * T, scs + r * K * T + T, NEG);
      continue;
    }
    const float* a = t.ka + (bh * t.n + blk) * D;
    const float* bo = t.kb + (bh * t.n + blk) * D;
    for (int64_t r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t c = 0; c < D; ++c) acc += qb[r * D + c] * bo[c];
      w.bias[r] = acc;
      int64_t pos = 0;
      for (const auto& term : t.terms) {
        float* dst = w.qs.data() + r * npos + pos;
        for (int64_t j = 0; j < term.nbytes; ++j) {
          const int64_t c = j * term.per + term.i;
          dst[j] = c < D ? qb[r * D + c] * a[c] * term.weight : 0.f;
        }
        pos += term.nbytes;
      }
    }
    const uint8_t* codes = t.kc + ((bh * t.n + blk) * T) * P;
    const bool* okb = t.ok + (b * t.n + blk) * T;
    for (int64_t tt = 0; tt < T; ++tt) {
      if (!okb[tt]) {
        for (int64_t r = 0; r < R; ++r) scs[r * K * T + tt] = NEG;
        continue;
      }
      unpack(codes + tt * P, t.terms, w.u.data());
      for (int64_t r = 0; r < R; ++r) {
        float* dst = scs + r * K * T + tt;
        if (t.rmask && !t.rm[(bh * R + r) * K + s]) { *dst = NEG; continue; }
        *dst = w.bias[r] + dot_reduce(w.qs.data() + r * npos, w.u.data(), npos);
      }
    }
  }
}

// select_tokens (kvtier.attention.sparse) over row r's N scores with weights e: row[x] = e[x] where
// kept (quantile or mass rule, or the local window), else 0; returns the kept weight, adds the kept count.
float select_tokens(const Tier& t, int64_t bh, int64_t r, float* row, const float* e, int64_t N, int64_t nvalid,
                    float m, float sum, const Select& sel, Buffers& w, int64_t* cnt) {
  const int64_t T = t.T;
  float thr = NEG;     // quantile: keep scores >= thr
  int64_t kstar = 64;  // mass: keep buckets <= kstar
  if (sel.method == 2) {
    thr = quantile_threshold(row, N, nvalid, sel.level, w.tmp);
  } else {
    for (int64_t x = 0; x < N; ++x)
      w.bk[x] = row[x] == NEG ? 63 : (int)std::min(63.f, std::floor((m - row[x]) / sel.LN2));
    float bucket[64] = {0.f};
    for (int64_t x = 0; x < N; ++x) bucket[w.bk[x]] += e[x];
    // drop at most (1 - level) of the row's mass: this tier's plus the rest it attends
    kstar = mass_cut(bucket, sum, sel.rl ? std::exp(sel.rl[bh * t.R + r] - m) : 0.f, sel.level);
  }
  float kept = 0.f;
  int64_t nkept = 0;
  for (int64_t x = 0; x < N; ++x) {
    if (row[x] == NEG) { row[x] = 0.f; continue; }
    bool keep = sel.method == 1 ? w.bk[x] <= kstar : row[x] >= thr;
    if (!keep) {
      const int64_t pos = sel.tier_start + t.block_of(bh, x / T) * T + x % T;
      keep = pos >= sel.ff[r];  // local window
    }
    row[x] = keep ? e[x] : 0.f;
    kept += row[x];
    if (keep) { w.read_tok[x] = 1; ++nkept; }
  }
  cnt[1] += nkept;
  return kept;
}

// _block_softmax (kvtier.attention.partials): each row's unnormalized probabilities in sc (0 where
// masked or not selected), ls = its log-sum-exp, tot = the weight kept; cnt: pairs scored, valued.
void block_softmax(const Tier& t, int64_t bh, const Select& sel, Buffers& w, float* ls, int64_t* cnt) {
  std::fill(w.read_tok.begin(), w.read_tok.end(), 0);
  for (int64_t r = 0; r < t.R; ++r) {
    float* row = w.sc.data() + r * t.K * t.T;
    const int64_t N = t.K * t.T;
    float m = NEG;
    int64_t nvalid = 0;
    for (int64_t x = 0; x < N; ++x) {
      m = std::max(m, row[x]);
      nvalid += row[x] != NEG;
    }
    cnt[0] += nvalid;
    if (m == NEG) { w.tot[r] = 0.f; ls[r] = NEG; std::fill(row, row + N, 0.f); continue; }
    float* e = sel.method ? w.ex.data() : row;  // without selection: in place
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t x = 0; x < N; ++x) {
      e[x] = row[x] == NEG ? 0.f : std::exp(row[x] - m);
      sum += e[x];
    }
    ls[r] = m + std::log(sum);
    if (!sel.method) {
      w.tot[r] = sum;
      for (int64_t x = 0; x < N; ++x) w.read_tok[x] |= e[x] > 0.f;
      cnt[1] += nvalid;
      continue;
    }
    w.tot[r] = select_tokens(t, bh, r, row, e, N, nvalid, m, sum, sel, w, cnt);
  }
  for (int64_t x = 0; x < t.K * t.T; ++x) cnt[2] += w.read_tok[x];
}

// _weighted_codes (kvtier.attention.partials): vacc[r] = sum of p * a * codes over the tokens with
// weight (term order), zacc[r, g] = sum of p * b per value group.
void weighted_values(const Tier& t, int64_t bh, Buffers& w) {
  const int64_t b = bh / t.H, R = t.R, K = t.K, T = t.T, P = t.P, NG = t.NG, npos = t.npos;
  std::fill(w.vacc.begin(), w.vacc.end(), 0.f);
  std::fill(w.zacc.begin(), w.zacc.end(), 0.f);
  for (int64_t s = 0; s < K; ++s) {
    const int64_t blk = t.block_of(bh, s);
    if (blk < 0) continue;
    const uint8_t* codes = t.vc + ((bh * t.n + blk) * T) * P;
    const bool* okb = t.ok + (b * t.n + blk) * T;
    for (int64_t tt = 0; tt < T; ++tt) {
      if (!okb[tt]) continue;
      const float* a = t.va + ((bh * t.n + blk) * T + tt) * NG;
      const float* bo = t.vb + ((bh * t.n + blk) * T + tt) * NG;
      bool unpacked = false;
      for (int64_t r = 0; r < R; ++r) {
        const float p = w.sc[r * K * T + s * T + tt];
        if (p == 0.f) continue;
        if (!unpacked) { unpack(codes + tt * P, t.terms, w.u.data()); unpacked = true; }
        for (int64_t g = 0; g < NG; ++g) w.zacc[r * NG + g] += p * bo[g];
        float* acc = w.vacc.data() + r * npos;
        const float* uu = w.u.data();
        if (NG == 1) {
          const float pa = p * a[0];
#pragma omp simd
          for (int64_t j = 0; j < npos; ++j) acc[j] += pa * uu[j];
          continue;
        }
        for (const auto& term : t.terms) {
          for (int64_t g = 0; g < NG; ++g) {
            const float pa = p * a[g];
#pragma omp simd
            for (int64_t j = term.glo[g]; j < term.ghi[g]; ++j) acc[j] += pa * uu[j];
          }
          acc += term.nbytes;
          uu += term.nbytes;
        }
      }
    }
  }
}

// The normalized output o [R, D] in channel order: (sum over terms of weight * vacc + zacc) / tot.
void tier_output(const Tier& t, const Buffers& w, float* o) {
  const int64_t D = t.D, NG = t.NG, npos = t.npos;
  for (int64_t r = 0; r < t.R; ++r) {
    if (w.tot[r] == 0.f) continue;
    float* dst = o + r * D;
    const float* acc = w.vacc.data() + r * npos;
    for (const auto& term : t.terms) {
      for (int64_t j = 0; j < term.nbytes; ++j) {
        const int64_t c = j * term.per + term.i;
        if (c < D) dst[c] += acc[j] * term.weight;
      }
      acc += term.nbytes;
    }
    const float inv = 1.f / w.tot[r];
    for (int64_t c = 0; c < D; ++c) dst[c] = (dst[c] + w.zacc[r * NG + c / t.G]) * inv;
  }
}

}  // namespace

// packed_partial (kvtier.attention.partials) of one packed tier: key_scores, block_softmax (with
// select_tokens), weighted_values, tier_output per (batch, KV head).
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
  auto terms = make_terms(bits, dim, G);
  int64_t npos = 0;
  for (const auto& t : terms) npos += t.nbytes;
  const Tier t{k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(), k_a.data_ptr<float>(), k_b.data_ptr<float>(),
               v_a.data_ptr<float>(), v_b.data_ptr<float>(), valid.data_ptr<bool>(),
               sel ? blocks.data_ptr<int64_t>() : nullptr, rmask ? row_mask.data_ptr<bool>() : nullptr,
               H, R, D, n, T, P, NG, G, K, npos, sel, rmask, std::move(terms)};
  const Select s{sel_method, sel_level, sel_method ? forced_from.data_ptr<int64_t>() : nullptr,
                 rest_lse.numel() > 0 ? rest_lse.data_ptr<float>() : nullptr, tier_start, std::log(2.0f)};

  auto out = torch::zeros({B, H, R, D}, rows.options());
  auto lse = torch::empty({B, H, R}, rows.options());
  // per (b, h): pairs scored, pairs valued, tokens whose value bytes were read
  auto counts = torch::zeros({B * H, 3}, torch::kInt64);
  int64_t* cnt = counts.data_ptr<int64_t>();
  const float* q = rows.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* ls = lse.data_ptr<float>();

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    Buffers w(t);
    for (int64_t bh = begin; bh < end; ++bh) {
      key_scores(t, bh, q + bh * R * D, w);
      block_softmax(t, bh, s, w, ls + bh * R, cnt + bh * 3);
      weighted_values(t, bh, w);
      tier_output(t, w, o + bh * R * D);
    }
  });
  return {out, lse, counts};
}
