"""CPU kernel: fused attention over one packed tier (k-bit or 1-bit), compiled on first use.

Decode is bound by the bytes it reads, and a chain of torch ops over 4-bit data (unpack, cast,
scale, matmul) reads and writes dense-sized temporaries several times, which is why unfused
quantized caches decode slower than fp16. This kernel reads each packed byte once: per KV head
(parallel over batch x heads) and per stored token it unpacks the codes in registers, scores all
query rows sharing the head, then accumulates the values the same way, with a safe two-pass
softmax. Only the blocks listed in ``blocks`` are read, so block-sparse selection skips real work.

Every stored value is ``x = a * code + b``: k-bit codes have ``a = scale, b = -scale * zero``,
sign codes ``a = 2 * scale, b = mean - scale``; keys carry ``a, b`` per block and channel, values
per token and channel group. The torch functions in :mod:`kvtier.attention.partials` are the
reference this kernel is tested against. It is built with ``torch.utils.cpp_extension`` (needs a
C++ compiler and ninja); when that is not possible :func:`available` is False and callers use
the torch path.
"""

from __future__ import annotations

import functools

import torch

from . import build

#: C++ shared by the CPU kernels. The bit-plane term table of :func:`kvtier.quant.pack_bits` codes:
#: a b-bit code is split into widths 4/2/1 (8 whole); a width-w plane packs 8/w channels per byte,
#: channel ``c = j * per + i`` in byte ``j`` of term ``i``; ``glo/ghi`` are each value group's bytes.
#: And the two token-selection cuts of :func:`kvtier.attention.sparse.select_tokens`.
COMMON_SOURCE = r"""
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
"""

_SOURCE = (
    r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace {

"""
    + COMMON_SOURCE
    + r"""
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

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += a[j] * b[j];
  return acc;
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
  const float NEG = -std::numeric_limits<float>::infinity();

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
            *dst = bias[r] + dot(qs.data() + r * npos, u.data(), npos);
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
"""
)


@functools.lru_cache(maxsize=1)
def _module():
    return build.load("kvtier_cpu_v6", _SOURCE, ["packed_attention"], ("-fno-math-errno",))


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the kernel compiled (once per machine; cached by torch)."""
    return build.check(_module, "kvtier CPU kernel", "the torch path")


def packed_attention(
    rows: torch.Tensor,
    k_codes: torch.Tensor,
    k_a: torch.Tensor,
    k_b: torch.Tensor,
    v_codes: torch.Tensor,
    v_a: torch.Tensor,
    v_b: torch.Tensor,
    valid: torch.Tensor,
    bits: int,
    dim: int,
    blocks: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    select: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``rows [B,H,R,D]`` (fp32, scaled) over a packed tier.

    Parameters
    ----------
    k_codes, v_codes : uint8 ``[B,H,n,T,P]``.
    k_a, k_b : fp32 ``[B,H,n,D]`` per-block, per-channel affine of the keys.
    v_a, v_b : fp32 ``[B,H,n,T,NG]`` per-token, per-group affine of the values.
    valid : bool ``[B,n,T]``.
    blocks : int64 ``[B,H,k]`` block ids to read (-1 = none), or None for all.
    row_mask : bool ``[B,H,R,k]`` blocks each row may read, or None.
    select : token selection on the exact scores, ``(method, level, forced_from, tier_start[,
        rest_lse])``: ``method`` ``"mass"`` or ``"quantile"`` (rules of
        :func:`kvtier.attention.sparse.select_tokens`), ``forced_from`` int64 ``[R]`` (tokens at
        index >= it are always kept), ``tier_start`` the index of the tier's first token slot,
        ``rest_lse`` fp32 ``[B,H,R]`` (optional) the log mass of the row's other attended tokens.
        Dropped tokens cost no value work; kept weights are renormalized while ``lse`` covers the
        full mass.

    Returns
    -------
    ``out [B,H,R,D]`` (normalized), ``lse [B,H,R]`` (fp32), and ``counts`` int64 ``[B*H, 3]``:
    pairs scored, pairs whose value was accumulated, tokens whose value bytes were read.
    """
    empty_l = torch.empty(0, dtype=torch.long)
    empty_b = torch.empty(0, dtype=torch.bool)
    rest = select[4] if select is not None and len(select) > 4 and select[4] is not None else None
    return tuple(
        _module().packed_attention(
            rows.contiguous(),
            k_codes.contiguous(),
            k_a.contiguous(),
            k_b.contiguous(),
            v_codes.contiguous(),
            v_a.contiguous(),
            v_b.contiguous(),
            valid.contiguous(),
            empty_l if blocks is None else blocks.contiguous(),
            empty_b if row_mask is None else row_mask.contiguous(),
            bits,
            dim,
            0 if select is None else {"mass": 1, "quantile": 2}[select[0]],
            1.0 if select is None else float(select[1]),
            empty_l if select is None else select[2].to(torch.long).contiguous(),
            0 if select is None else int(select[3]),
            torch.empty(0) if rest is None else rest.float().contiguous(),
        )
    )
