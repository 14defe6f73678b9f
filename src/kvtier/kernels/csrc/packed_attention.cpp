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

// Every part below is inlined into packed_attention()'s task loop (always_inline): the split costs
// no call, and the compiler sees one loop nest as before (an outlined split was 4-9 % slower).
#define KVTIER_INLINE inline __attribute__((always_inline))

namespace {

// Codes of one token, bit-plane term by term, as floats (channel order of the terms).
KVTIER_INLINE void unpack(const uint8_t* __restrict__ code, const Term* terms, int64_t nterms,
                          float* __restrict__ u) {
  for (int64_t i = 0; i < nterms; ++i) {
    const Term& t = terms[i];
    const uint8_t* by = code + t.start;
    const int sh = (int)t.shift, mk = (int)t.mask;
#pragma omp simd
    for (int64_t j = 0; j < t.nbytes; ++j) u[j] = float((by[j] >> sh) & mk);
    u += t.nbytes;
  }
}


// One tier's tensors of one call (packed_partial's arguments), with the strides of a (batch, KV
// head) task: codes [B,H,n,T,P] and their affine parameters, valid [B,n,T], the selected blocks
// [B,H,K] (sel) and the row mask [B,H,R,K] (rmask). Each task reads it from its own copy.
struct Tier {
  const uint8_t *kc, *vc;
  const float *ka, *kb, *va, *vb;
  const bool* ok;
  const int64_t* bl;
  const bool* rm;
  const Term* terms;  // the bit-plane terms, nterms of them
  int64_t nterms;
  int64_t H, R, D, n, T, P, NG, G, K, npos, KT;  // KT = K * T: one row's scores
  bool sel, rmask;
  KVTIER_INLINE int64_t block_of(int64_t bh, int64_t s) const { return sel ? bl[bh * K + s] : s; }
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

// One task's buffers, allocated once per task; Work holds their pointers.
struct Work {
  float *sc, *qs, *bias, *vacc, *zacc, *tot, *u, *ex;  // sc [R, K*T]: scores, then weights
  int* bk;                                             // mass buckets [K*T]
  uint8_t* read_tok;                                   // [K*T]: the token's value bytes are read
  std::vector<float>* tmp;                             // the quantile rule's scratch
};

struct Buffers {
  std::vector<float> sc, qs, bias, vacc, zacc, tot, tmp, u, ex;
  std::vector<int> bk;
  std::vector<uint8_t> read_tok;
  explicit Buffers(const Tier& t)
      : sc(t.R * t.KT), qs(t.R * t.npos), bias(t.R), vacc(t.R * t.npos), zacc(t.R * t.NG), tot(t.R),
        u(t.npos), ex(t.KT), bk(t.KT), read_tok(t.KT) {}
  Work work() {
    return {sc.data(), qs.data(), bias.data(), vacc.data(), zacc.data(), tot.data(), u.data(), ex.data(),
            bk.data(), read_tok.data(), &tmp};
  }
};

// Row r's query folded into one key block's affine (keys = a * codes + b): bias = q . b, and qs =
// q * a * weight in the terms' byte order (0 past D), so a token's score is bias + qs . codes.
KVTIER_INLINE void fold_query(const Tier& t, const float* __restrict__ qr, const float* __restrict__ a,
                              const float* __restrict__ bo, float* __restrict__ bias, float* __restrict__ qs) {
  const int64_t D = t.D;
  float acc = 0.f;
  for (int64_t c = 0; c < D; ++c) acc += qr[c] * bo[c];
  *bias = acc;
  int64_t pos = 0;
  for (int64_t i = 0; i < t.nterms; ++i) {
    const Term& term = t.terms[i];
    float* dst = qs + pos;
    for (int64_t j = 0; j < term.nbytes; ++j) {
      const int64_t c = j * term.per + term.i;
      dst[j] = c < D ? qr[c] * a[c] * term.weight : 0.f;
    }
    pos += term.nbytes;
  }
}

// Key scores sc[r * K * T + s * T + tt] = q_r . (a * codes + b) of each selected block's tokens
// (-inf where invalid, masked for the row, or the block slot is empty).
KVTIER_INLINE void key_scores(const Tier& t, int64_t bh, const float* __restrict__ qb, const Work& w) {
  const int64_t b = bh / t.H, R = t.R, D = t.D, KT = t.KT, T = t.T, P = t.P, npos = t.npos;
  for (int64_t s = 0; s < t.K; ++s) {
    const int64_t blk = t.block_of(bh, s);
    float* scs = w.sc + s * T;
    if (blk < 0) {
      for (int64_t r = 0; r < R; ++r) std::fill(scs + r * KT, scs + r * KT + T, NEG);
      continue;
    }
    const float* a = t.ka + (bh * t.n + blk) * D;
    const float* bo = t.kb + (bh * t.n + blk) * D;
    for (int64_t r = 0; r < R; ++r) fold_query(t, qb + r * D, a, bo, w.bias + r, w.qs + r * npos);
    const uint8_t* codes = t.kc + ((bh * t.n + blk) * T) * P;
    const bool* okb = t.ok + (b * t.n + blk) * T;
    for (int64_t tt = 0; tt < T; ++tt) {
      if (!okb[tt]) {
        for (int64_t r = 0; r < R; ++r) scs[r * KT + tt] = NEG;
        continue;
      }
      unpack(codes + tt * P, t.terms, t.nterms, w.u);
      for (int64_t r = 0; r < R; ++r) {
        float* dst = scs + r * KT + tt;
        if (t.rmask && !t.rm[(bh * R + r) * t.K + s]) { *dst = NEG; continue; }
        *dst = w.bias[r] + dot_reduce(w.qs + r * npos, w.u, npos);
      }
    }
  }
}

// select_tokens (kvtier.attention.sparse) over row r's scores with weights e (max m, sum): row[x] =
// e[x] where kept (quantile or mass rule, or the local window), else 0; returns the kept weight and
// adds the kept count to nkept.
KVTIER_INLINE float select_tokens(const Tier& t, const Select& sel, int64_t bh, int64_t r, float* __restrict__ row,
                                  const float* __restrict__ e, int64_t nvalid, float m, float sum, const Work& w,
                                  int64_t& nkept) {
  const int64_t N = t.KT, T = t.T;
  int* __restrict__ bk = w.bk;
  float thr = NEG;     // quantile: keep scores >= thr
  int64_t kstar = 64;  // mass: keep buckets <= kstar
  if (sel.method == 2) {
    thr = quantile_threshold(row, N, nvalid, sel.level, *w.tmp);
  } else {
    for (int64_t x = 0; x < N; ++x)
      bk[x] = row[x] == NEG ? 63 : (int)std::min(63.f, std::floor((m - row[x]) / sel.LN2));
    float bucket[64] = {0.f};
    for (int64_t x = 0; x < N; ++x) bucket[bk[x]] += e[x];
    // drop at most (1 - level) of the row's mass: this tier's plus the rest it attends
    kstar = mass_cut(bucket, sum, sel.rl ? std::exp(sel.rl[bh * t.R + r] - m) : 0.f, sel.level);
  }
  float kept = 0.f;
  for (int64_t x = 0; x < N; ++x) {
    if (row[x] == NEG) { row[x] = 0.f; continue; }
    bool keep = sel.method == 1 ? bk[x] <= kstar : row[x] >= thr;
    if (!keep) {
      const int64_t pos = sel.tier_start + t.block_of(bh, x / T) * T + x % T;
      keep = pos >= sel.ff[r];  // local window
    }
    row[x] = keep ? e[x] : 0.f;
    kept += row[x];
    if (keep) { w.read_tok[x] = 1; ++nkept; }
  }
  return kept;
}

// _block_softmax (kvtier.attention.partials): each row's unnormalized probabilities in sc (0 where
// masked or not selected), ls[r] = its log-sum-exp, tot[r] = the weight kept; cnt: pairs scored,
// pairs valued, tokens whose value bytes are read.
KVTIER_INLINE void block_softmax(const Tier& t, const Select& sel, int64_t bh, const Work& w, float* ls,
                                 int64_t* cnt) {
  const int64_t N = t.KT;
  std::fill(w.read_tok, w.read_tok + N, 0);
  for (int64_t r = 0; r < t.R; ++r) {
    float* row = w.sc + r * N;
    float m = NEG;
    int64_t nvalid = 0;
    for (int64_t x = 0; x < N; ++x) {
      m = std::max(m, row[x]);
      nvalid += row[x] != NEG;
    }
    cnt[0] += nvalid;
    if (m == NEG) { w.tot[r] = 0.f; ls[r] = NEG; std::fill(row, row + N, 0.f); continue; }
    float* e = sel.method ? w.ex : row;  // without selection: in place
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
    int64_t nkept = 0;
    w.tot[r] = select_tokens(t, sel, bh, r, row, e, nvalid, m, sum, w, nkept);
    cnt[1] += nkept;
  }
  for (int64_t x = 0; x < N; ++x) cnt[2] += w.read_tok[x];
}

// One token's value codes u (unpacked) added with weight p to row accumulators: acc += p * a * u
// (a per value group, term order), zacc[g] += p * b[g].
KVTIER_INLINE void add_value(const Tier& t, float p, const float* __restrict__ a, const float* __restrict__ bo,
                             const float* __restrict__ u, float* __restrict__ acc, float* __restrict__ zacc) {
  const int64_t NG = t.NG, npos = t.npos;
  for (int64_t g = 0; g < NG; ++g) zacc[g] += p * bo[g];
  if (NG == 1) {
    const float pa = p * a[0];
#pragma omp simd
    for (int64_t j = 0; j < npos; ++j) acc[j] += pa * u[j];
    return;
  }
  for (int64_t i = 0; i < t.nterms; ++i) {
    const Term& term = t.terms[i];
    for (int64_t g = 0; g < NG; ++g) {
      const float pa = p * a[g];
#pragma omp simd
      for (int64_t j = term.glo[g]; j < term.ghi[g]; ++j) acc[j] += pa * u[j];
    }
    acc += term.nbytes;
    u += term.nbytes;
  }
}

// _weighted_codes (kvtier.attention.partials): vacc[r] = sum of p * a * codes over the tokens with
// weight (term order), zacc[r, g] = sum of p * b per value group; a token's codes unpacked once.
KVTIER_INLINE void weighted_values(const Tier& t, int64_t bh, const Work& w) {
  const int64_t b = bh / t.H, R = t.R, KT = t.KT, T = t.T, P = t.P, NG = t.NG, npos = t.npos;
  std::fill(w.vacc, w.vacc + R * npos, 0.f);
  std::fill(w.zacc, w.zacc + R * NG, 0.f);
  for (int64_t s = 0; s < t.K; ++s) {
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
        const float p = w.sc[r * KT + s * T + tt];
        if (p == 0.f) continue;
        if (!unpacked) { unpack(codes + tt * P, t.terms, t.nterms, w.u); unpacked = true; }
        add_value(t, p, a, bo, w.u, w.vacc + r * npos, w.zacc + r * NG);
      }
    }
  }
}

// The normalized output o [R, D] in channel order: (sum over terms of weight * vacc + zacc) / tot.
KVTIER_INLINE void tier_output(const Tier& t, const Work& w, float* __restrict__ o) {
  const int64_t D = t.D, NG = t.NG, npos = t.npos;
  for (int64_t r = 0; r < t.R; ++r) {
    if (w.tot[r] == 0.f) continue;
    float* dst = o + r * D;
    const float* acc = w.vacc + r * npos;
    for (int64_t i = 0; i < t.nterms; ++i) {
      const Term& term = t.terms[i];
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

// packed_partial (kvtier.attention.partials) of one packed tier, per (batch, KV head): key_scores,
// block_softmax (with select_tokens), weighted_values, tier_output.
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
  const Tier tier{k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(), k_a.data_ptr<float>(),
                  k_b.data_ptr<float>(), v_a.data_ptr<float>(), v_b.data_ptr<float>(), valid.data_ptr<bool>(),
                  sel ? blocks.data_ptr<int64_t>() : nullptr, rmask ? row_mask.data_ptr<bool>() : nullptr,
                  terms.data(), (int64_t)terms.size(), H, R, D, n, T, P, NG, G, K, npos, K * T, sel, rmask};
  const Select select{sel_method, sel_level, sel_method ? forced_from.data_ptr<int64_t>() : nullptr,
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
    const Tier t = tier;
    const Select s = select;
    Buffers buffers(t);
    const Work w = buffers.work();
    for (int64_t bh = begin; bh < end; ++bh) {
      key_scores(t, bh, q + bh * R * D, w);
      block_softmax(t, s, bh, w, ls + bh * R, cnt + bh * 3);
      weighted_values(t, bh, w);
      tier_output(t, w, o + bh * R * D);
    }
  });
  return {out, lse, counts};
}
