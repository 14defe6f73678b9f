"""Adaptive precision under a byte budget: measured errors, a rate-distortion allocation of cold
widths per layer (keys and values apart), and the budget-driven warm window.

Owns :class:`LayerErrors` (what one layer measured during the warm-up), :func:`allocate` (the greedy
rule; :func:`allocate_families` when the family is chosen too) and :class:`Budget` (one per cache,
shared by its layers: the statistics, the allocation once made, and how many warm blocks the budget
allows at a length). The layer state machine
(:mod:`kvtier.cache.state`) asks the budget for its cold codec and its warm capacity; nothing here
moves blocks. May import torch, :mod:`kvtier.errors`, :mod:`kvtier.policy`, :mod:`kvtier.quant`,
:mod:`kvtier.codecs`; never transformers or attention.

How the allocation works (calibration-free: it measures the text being cached):

1. While ``seen < warmup_tokens`` every block entering the warm tier is also coded, rotated, at each
   candidate width (keys and values apart, :func:`kvtier.quant.quantize_ab` with the codec's
   parameter format). Attention hands the layer its latest (scaled) query rows
   (:meth:`LayerErrors.observe_queries`). What the measurement holds is real memory and is
   counted as such (``memory_report()``'s ``"measure"`` bytes, ``max_bytes``, ``kvtier plan``):
   fp64 accumulators per layer, plus a call's query rows until its settle ends; the allocation
   (step 3) frees all of it.
2. Distortion, per layer and width: the error of the attention output of those queries over the
   block (its own softmax), with the keys coded (values exact) and with the values coded (keys
   exact), relative to the output's energy - measured, not modelled: a first proxy (key error
   weighted by query energy times the spread of the values, against the values' own error)
   overrated keys by far on SmolLM2 (it gave values 1 bit in every layer: +13.9 % perplexity at
   4k where 2-bit values and 3-bit keys cost +2.9 %). Before any query is seen the proxy is used.
3. :func:`allocate` starts every (layer, keys / values) at the narrowest width and widens the one
   with the largest distortion drop per code byte until the cold rate reaches the budget's share:
   the bytes ``bits`` allows at ``fit_tokens`` tokens, less the exact sinks and hot ring (at their
   largest), less the metadata and validity masks of the block tiers.
4. From then on a layer keeps as many recent blocks in the warm tier (``warm_bits``) as the budget
   allows at the current length (:meth:`Budget.warm_blocks`); its oldest warm blocks step down to
   the layer's cold widths when the budget is reached.
   With ``codes="affine+vq"`` both families are measured and :func:`allocate_families` picks each
   layer's family with its widths: every (family, key width, value width) of a layer costs its codes
   plus the family's parameters, and the greedy steps along each layer's lower convex hull of
   (bytes, distortion).
5. The eviction rung (``keep < 1``): blocks step down ``g`` at a time and only ``keep * g`` blocks'
   worth of their tokens stay, chosen per sequence and KV head by :func:`select_by_attention` (the
   attention mass the queries of the step that demotes them give them, SnapKV-style); the rest are
   dropped. The cold code budget of step 3 is then spread over the kept tokens only, so what stays
   gets wider codes. Cold tokens are older than every query and stored post-RoPE, so keeping a
   subset in any order is only fewer tokens to attend to (no position or mask changes).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch

from ..codecs import META_DTYPES, MixedCodec, VqCodec, make_codecs, storage_dtype, value_group
from ..codecs.vq import SUBVECTOR, code_bytes_per_token
from ..errors import BudgetWarning
from ..policy import TierPolicy
from ..quant import packed_size, quantize_ab, rotation


class LayerErrors:
    """Squared coding errors of one layer's blocks at each candidate width (sums over valid tokens).

    Parameters
    ----------
    options : the ``(codes, width)`` candidates measured: ``codes`` ``"affine"`` (``quantize_ab``
        with ``meta`` parameters, clipped: :class:`~kvtier.codecs.MixedCodec`'s) or ``"vq"``
        (:class:`~kvtier.codecs.VqCodec`'s); both families for ``AdaptivePolicy(codes="affine+vq")``.
    meta : parameter format (a key of :data:`kvtier.codecs.META_DTYPES`).
    heads, dim, group : KV heads, head dim, value group size.
    """

    def __init__(self, options: tuple[tuple[str, int], ...], meta: str, heads: int, dim: int, group: int):
        self.options, self.meta, self.dim, self.group = options, meta, dim, group
        families = {c for c, _ in options}
        self.family = next(iter(families)) if len(families) == 1 else None  # the one family measured, if so
        self.key_err = {o: torch.zeros(heads, dim, dtype=torch.float64) for o in self.options}  # [H, D]
        self.value_err = {o: torch.zeros(heads, dtype=torch.float64) for o in self.options}  # [H]
        self.v_sum = torch.zeros(heads, dim, dtype=torch.float64)
        self.v_sq = torch.zeros(heads, dtype=torch.float64)
        self.tokens = 0  # valid token rows (per head)
        self.q_sq = torch.zeros(heads, dim, dtype=torch.float64)
        self.q_rows = 0
        self.queries: torch.Tensor | None = None  # this call's latest rows, rotated [H, R, D]
        self.out_err = {side: {o: 0.0 for o in self.options} for side in ("k", "v")}
        self.out_energy = 0.0
        self.frozen: dict[tuple[str, str, int], float] | None = None  # (side, codes, width): distortions, once frozen

    @staticmethod
    def nbytes(widths: int, heads: int, dim: int) -> int:
        """Bytes of the accumulators of :meth:`tensors` between calls (``widths`` candidate
        ``(codes, width)`` options)."""
        return 8 * (widths * heads * dim + widths * heads + 2 * heads * dim + heads)

    def tensors(self) -> list[torch.Tensor]:
        """The measurement tensors held now: the accumulators ([H, D] and [H] fp64 on the CPU: key and
        value errors per width, value sums, query energy) and, during a call, its query rows. Empty
        once :meth:`freeze` ran."""
        if self.frozen is not None:
            return []
        out = [*self.key_err.values(), *self.value_err.values(), self.v_sum, self.v_sq, self.q_sq]
        return out if self.queries is None else [*out, self.queries]

    def freeze(self) -> None:
        """The warm-up is over: keep the distortions (what :meth:`distortion` reads) as numbers and
        free every measurement tensor (idempotent)."""
        if self.frozen is None:
            self.frozen = {(side, *o): self._distortion(side, o) for side in ("k", "v") for o in self.options}
            self.key_err, self.value_err, self.queries = {}, {}, None
            self.v_sum = self.v_sq = self.q_sq = torch.zeros(0, dtype=torch.float64)

    @torch.no_grad()
    def observe_block(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        """Blocks ``k, v: [B, H, n, T, D]`` (any float dtype), ``valid: bool [B, 1, n, T]``."""
        if self.frozen is not None:
            return
        B, H, n, T, D = k.shape
        r = rotation(D, k.device)
        kr, vr = k.float() @ r, v.float() @ r
        tv = valid.unsqueeze(-1)  # [B,1,n,T,1]
        w_tok = tv.expand(B, H, n, T, 1).float()
        coded = {o: self._coded(k, v, kr, vr, valid, *o) for o in self.options}
        for o, (kh, vh) in coded.items():
            self.key_err[o] += ((kh - kr) ** 2 * w_tok).sum((0, 2, 3)).double().cpu()
            self.value_err[o] += ((vh - vr) ** 2 * w_tok).sum((0, 2, 3, 4)).double().cpu()
        if self.queries is not None:
            self._output_errors(kr, vr, valid, coded)
        self.v_sum += (vr * w_tok).sum((0, 2, 3)).double().cpu()
        self.v_sq += ((vr**2) * w_tok).sum((0, 2, 3, 4)).double().cpu()
        self.tokens += int(valid.sum()) * 1

    def _coded(self, k, v, kr, vr, valid, codes: str, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``k, v`` (as given) and ``kr, vr`` (rotated, fp32 ``[B,H,n,T,D]``) coded in the
        family ``codes`` at width ``w`` and decoded, in rotated coordinates: what the cold tier would hold."""
        B, H, n, T, D = kr.shape
        G = self.group
        tv = valid.unsqueeze(-1)
        if codes == "vq":
            codec = VqCodec(w, w, G)
            f = codec.encode(k, v, valid)
            return codec.stored_keys(f, D), codec.decode_values(f, D, torch.float32) @ rotation(D, k.device)
        dt = META_DTYPES[self.meta]
        q, a, b = quantize_ab(kr, w, dim=3, valid=tv, dtype=dt, clip=True)
        kh = q.float() * a.float() + b.float()
        vg = vr.reshape(B, H, n, T, D // G, G)
        q, a, b = quantize_ab(vg, w, dim=5, valid=tv.unsqueeze(-1), dtype=dt, clip=True)
        return kh, (q.float() * a.float() + b.float()).reshape(B, H, n, T, D)

    @torch.no_grad()
    def _output_errors(self, kr: torch.Tensor, vr: torch.Tensor, valid: torch.Tensor, coded: dict) -> None:
        """Attention-output errors of the stored queries over each block (rotated ``kr, vr [B,H,n,T,D]``;
        ``coded``: width -> the blocks coded at it, :meth:`_coded`)."""
        assert self.queries is not None
        q = self.queries.to(kr.device)[None, :, None]  # [1,H,1,R,D]
        mask = valid[:, :, :, None, :]  # [B,1,n,1,T]
        if not bool(valid.any()):
            return

        def attend(k, v):
            s = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))  # [B,H,n,R,T]
            p = torch.softmax(s, -1).nan_to_num(0.0)
            return p @ v  # [B,H,n,R,D]

        o = attend(kr, vr)
        self.out_energy += float((o**2).sum())
        for opt, (kh, vh) in coded.items():
            self.out_err["k"][opt] += float(((attend(kh, vr) - o) ** 2).sum())
            self.out_err["v"][opt] += float(((attend(kr, vh) - o) ** 2).sum())

    @torch.no_grad()
    def observe_queries(self, rows: torch.Tensor, keep: int = 32) -> None:
        """Scaled query rows ``[B, H, R, D]`` of one attention call: their energy per rotated channel,
        and the latest ``keep`` rows per KV head (of the first sequence) for the output errors (held
        until the call's settle ends: :meth:`Budget.end_call`)."""
        if self.frozen is not None:
            return
        qr = rows.float() @ rotation(rows.shape[-1], rows.device)
        self.q_sq += (qr**2).sum((0, 2)).double().cpu()
        self.q_rows += rows.shape[0] * rows.shape[2]
        self.queries = qr[0, :, -keep:].detach().clone()

    def distortion(self, side: str, width: int, codes: str | None = None) -> float:
        """Relative distortion of the layer's attention output with ``side`` (``"k"`` or ``"v"``) at
        ``width`` in the family ``codes`` (None: the one measured; see the module doc); 0 before any
        block was observed."""
        codes = codes or self.family
        if codes is None:
            raise ValueError("this layer measured both code families: name one (codes='affine' or 'vq')")
        if self.frozen is not None:
            return self.frozen[(side, codes, width)]
        return self._distortion(side, (codes, width))

    def _distortion(self, side: str, option: tuple[str, int]) -> float:
        if self.tokens == 0:
            return 0.0
        if self.out_energy > 0:
            return self.out_err[side][option] / self.out_energy
        n = float(self.tokens)
        energy = float(self.v_sq.sum()) / n
        if energy <= 0:
            return 0.0
        if side == "v":
            return float(self.value_err[option].sum()) / n / energy
        mean = self.v_sum / n
        var_v = (self.v_sq / n - (mean**2).sum(-1)).clamp_min(0.0)  # [H]
        qe = self.q_sq / self.q_rows if self.q_rows else torch.full_like(self.q_sq, 1.0 / self.dim)
        score_err = (qe * self.key_err[option] / n).sum(-1)  # [H]
        return float((score_err * var_v).sum()) / energy


def allocate(
    errors: dict[int, LayerErrors], widths: tuple[int, ...], code_bytes: dict[int, float], budget: float
) -> dict[int, tuple[int, int]]:
    """Greedy rate-distortion allocation of (key width, value width) per layer.

    Parameters
    ----------
    errors : measured errors per layer index.
    widths : candidate widths, ascending.
    code_bytes : code bytes per token of one side (keys or values) of one layer at each width.
    budget : code bytes per token for all layers together.

    Returns
    -------
    ``{layer: (key_bits, value_bits)}``: every side starts at ``widths[0]``; the side with the largest
    distortion drop per extra byte is widened to its next width while the total stays within
    ``budget`` (sides whose next width does not fit are skipped, so cheaper steps still happen).
    """
    state = {(layer, side): 0 for layer in errors for side in ("k", "v")}
    spent = sum(code_bytes[widths[0]] for _ in state)
    while True:
        best, best_gain = None, 0.0
        for (layer, side), i in state.items():
            if i + 1 >= len(widths):
                continue
            cost = code_bytes[widths[i + 1]] - code_bytes[widths[i]]
            if spent + cost > budget + 1e-9:
                continue
            drop = errors[layer].distortion(side, widths[i]) - errors[layer].distortion(side, widths[i + 1])
            gain = drop / cost
            if gain > best_gain:  # a step that buys nothing measured is not taken
                best, best_gain = (layer, side), gain
        if best is None:
            break
        i = state[best]
        spent += code_bytes[widths[i + 1]] - code_bytes[widths[i]]
        state[best] = i + 1
    return {layer: (widths[state[(layer, "k")]], widths[state[(layer, "v")]]) for layer in errors}


def allocate_families(
    errors: dict[int, LayerErrors],
    options: dict[str, tuple[int, ...]],
    code_bytes: dict[str, dict[int, float]],
    meta_bytes: dict[str, float],
    budget: float,
) -> dict[int, tuple[str, int, int]]:
    """Rate-distortion allocation of a code family and (key width, value width) per layer, the
    family shared by a layer's keys and values (one codec per tier).

    Parameters
    ----------
    errors : measured errors per layer index (:meth:`LayerErrors.distortion` by family).
    options : candidate widths of each family.
    code_bytes : code bytes per token of one side of one layer, per family and width.
    meta_bytes : parameter bytes per token of one layer, per family (both sides).
    budget : code + parameter bytes per token for all layers together.

    Returns
    -------
    ``{layer: (codes, key_bits, value_bits)}``. Per layer, every choice costs
    ``code(key) + code(value) + meta`` and distorts ``d_key + d_value``; the choices on the lower
    convex hull of (cost, distortion) are the layer's steps. Every layer starts at its cheapest
    choice (the least distorted among equally cheap ones); the step with the largest distortion drop
    per byte that fits is taken until none fits (so cheaper steps still happen).
    """
    hulls: dict[int, list[tuple[float, float, tuple[str, int, int]]]] = {}
    for layer, err in errors.items():
        points = sorted(
            (
                code_bytes[f][kw] + code_bytes[f][vw] + meta_bytes[f],
                err.distortion("k", kw, f) + err.distortion("v", vw, f),
                (f, kw, vw),
            )
            for f, widths in options.items()
            for kw in widths
            for vw in widths
        )
        hull: list[tuple[float, float, tuple[str, int, int]]] = []
        for pt in points:
            if hull and (pt[0] <= hull[-1][0] + 1e-12 or pt[1] >= hull[-1][1]):
                continue  # no cheaper than the last step, or no less distorted: never a step
            while len(hull) >= 2 and _turns_up(hull[-2], hull[-1], pt):
                hull.pop()  # the last step's drop per byte is below the next one's: off the hull
            hull.append(pt)
        hulls[layer] = hull
    at = {layer: 0 for layer in hulls}
    spent = sum(h[0][0] for h in hulls.values())
    while True:
        best, best_gain = None, 0.0
        for layer, i in at.items():
            h = hulls[layer]
            if i + 1 >= len(h):
                continue
            cost, drop = h[i + 1][0] - h[i][0], h[i][1] - h[i + 1][1]
            if spent + cost > budget + 1e-9:
                continue
            if drop / cost > best_gain:
                best, best_gain = layer, drop / cost
        if best is None:
            break
        spent += hulls[best][at[best] + 1][0] - hulls[best][at[best]][0]
        at[best] += 1
    return {layer: hulls[layer][i][2] for layer, i in at.items()}


def _turns_up(a, b, c) -> bool:
    """Whether ``b`` lies on or above the segment ``a``-``c`` of (cost, distortion) points (cost
    ascending): the drop per byte from ``a`` to ``b`` is no larger than from ``b`` to ``c``."""
    return (a[1] - b[1]) * (c[0] - b[0]) <= (b[1] - c[1]) * (b[0] - a[0])


#: Width of the average pooling of the per-token attention mass before the choice (SnapKV's
#: clustering: a token next to attended ones is kept with them); 1 = none.
SCORE_POOL = 7


@torch.no_grad()
def attention_mass(
    rows: torch.Tensor,
    k: torch.Tensor,
    valid: torch.Tensor,
    row_weight: torch.Tensor | None = None,
    context: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Attention mass each candidate token receives from the observation rows.

    Parameters
    ----------
    rows : scaled query rows ``[B, H, R, D]`` (the query heads of a KV head folded into ``R``).
    k : candidate keys ``[B, H, N, D]`` (as attention sees them).
    valid : bool ``[B, N]``: real candidates (pads and captured sinks are not).
    row_weight : ``[B, R]`` weight of each row (0 for queries at pad positions), or None (all 1).
    context : other ``(keys [B, H, M, D], valid bool [B, M])`` in each row's softmax (sinks, hot):
        the mass is the candidates' share of the row's attention over candidates and context.

    Returns
    -------
    ``[B, H, N]`` float32: summed over rows, 0 for invalid candidates.
    """
    rows = rows.float()
    s = rows @ k.float().transpose(-1, -2)  # [B,H,R,N]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    for ck, cv in context or []:
        cs = (rows @ ck.float().transpose(-1, -2)).masked_fill(~cv[:, None, None, :], float("-inf"))
        lse = torch.logaddexp(lse, torch.logsumexp(cs, -1))
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    if row_weight is not None:
        p = p * row_weight[:, None, :, None].float()
    return p.sum(2) * valid[:, None, :]


@torch.no_grad()
def select_by_attention(
    k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, mass: torch.Tensor | None, keep: int, pool: int = SCORE_POOL
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep ``keep`` of ``N`` tokens per sequence and KV head: the most attended (after average
    pooling over ``pool`` neighbours), valid before invalid, in time order.

    Parameters
    ----------
    k, v : ``[B, H, N, D]``; valid : bool ``[B, N]``.
    mass : ``[B, H, N]`` from :func:`attention_mass`, or None (no queries seen: the newest tokens).
    keep : tokens kept per row and head.

    Returns
    -------
    ``k, v: [B, H, keep, D]`` and ``valid: bool [B, keep]``. A row with fewer than ``keep`` real
    tokens keeps all of them and fills with invalid slots: every head of a row then has its real
    tokens first, so one validity row serves all heads.
    """
    B, H, N, D = k.shape
    if mass is None:
        score = torch.arange(N, device=k.device, dtype=torch.float32).expand(B, H, N)
    else:
        score = mass.float()
        if pool > 1:
            score = torch.nn.functional.avg_pool1d(
                score.reshape(B * H, 1, N), pool, stride=1, padding=pool // 2, count_include_pad=False
            ).reshape(B, H, N)
    score = score.masked_fill(~valid[:, None, :], float("-inf"))
    idx = score.topk(keep, dim=-1).indices  # [B,H,keep]
    picked_valid = valid[:, None, :].expand(B, H, N).gather(-1, idx)
    order = (idx + N * (~picked_valid).long()).argsort(-1)  # real tokens first, each in time order
    idx = idx.gather(-1, order)
    kept_valid = picked_valid.gather(-1, order)
    gi = idx.unsqueeze(-1).expand(B, H, keep, D)
    return k.gather(2, gi), v.gather(2, gi), kept_valid[:, 0]


@dataclass(frozen=True)
class Shape:
    """What the budget needs to know of the layers it covers: rows, KV heads, head dim, count, dtype."""

    batch: int
    heads: int
    dim: int
    layers: int
    dtype: torch.dtype


class Budget:
    """The byte budget of one cache's adaptive layers (see the module doc).

    Parameters
    ----------
    policy : the layers' policy (``policy.adaptive`` set; all adaptive layers share it).
    layers : how many layers the budget covers.
    """

    def __init__(self, policy: TierPolicy, layers: int):
        assert policy.adaptive is not None
        self.policy = policy
        self.adaptive = policy.adaptive
        self.layers = layers
        self.errors: dict[int, LayerErrors] = {}
        self.widths: dict[int, tuple[int, int]] | None = None  # the allocation, once made
        self.families: dict[int, str] = {}  # each allocated layer's code family (codes="affine+vq")
        self.shape: Shape | None = None
        self._rates: tuple[float, float, float] | None = None
        j, g = self.adaptive.keep_blocks
        self.keep = j / g  # cold tokens kept per token stepping down (the eviction rung)

    # --- all or nothing -------------------------------------------------------------------------
    def snapshot(self) -> object | None:
        """What a failed call must put back (:meth:`restore`): during the warm-up a copy of the
        measurements (fp64 ``[H, D]`` per width and layer: small) and the shape; None once allocated
        (nothing here changes after)."""
        if self.widths is not None:
            return None
        return copy.deepcopy(self.errors), self.shape

    def restore(self, snap: object | None) -> None:
        """Put back what :meth:`snapshot` took (a failed call's measurements and any allocation it
        made are forgotten)."""
        if snap is None:
            return
        self.errors, self.shape = snap  # type: ignore[misc]
        self.widths, self.families, self._rates = None, {}, None

    # --- what layers call ----------------------------------------------------------------------
    def join(self, layer_idx: int, batch: int, heads: int, dim: int, model_dtype: torch.dtype) -> None:
        """A layer's first call: its shape (the same for every layer of a cache)."""
        if self.shape is None:
            self.shape = Shape(batch, heads, dim, self.layers, storage_dtype(self.policy, model_dtype))
        g = value_group(self.policy, dim)
        if not self.candidates:
            raise ValueError(
                f"AdaptivePolicy(codes='vq', widths={self.adaptive.widths}): no width's sub-vectors tile "
                f"head_dim={dim} ({ {w: SUBVECTOR[w] for w in self.adaptive.widths} }); use codes='affine'"
            )
        options = tuple((f, w) for f, ws in self.family_widths.items() for w in ws)
        err = LayerErrors(options, self.adaptive.meta, heads, dim, g)
        self.errors.setdefault(layer_idx, err)

    @property
    def mixed(self) -> bool:
        """Whether the allocation also chooses each layer's code family (``codes="affine+vq"``)."""
        return "+" in self.adaptive.codes

    @property
    def family_widths(self) -> dict[str, tuple[int, ...]]:
        """The candidate cold widths of each code family: the policy's, less (vector codes) those
        whose sub-vectors do not tile the head dim (known once a layer joined); a family left with
        none is left out."""
        out = {}
        for f in self.adaptive.codes.split("+"):
            ws = self.adaptive.widths
            if f == "vq" and self.shape is not None:
                ws = tuple(w for w in ws if self.shape.dim % SUBVECTOR[w] == 0)
            if ws:
                out[f] = ws
        return out

    @property
    def candidates(self) -> tuple[int, ...]:
        """The candidate cold widths (of every family)."""
        return tuple(sorted({w for ws in self.family_widths.values() for w in ws}))

    @property
    def allocated(self) -> bool:
        return self.widths is not None

    def measuring(self, seen: int) -> bool:
        """True while the warm-up lasts (blocks entering warm are measured, nothing goes cold): until
        ``warmup_tokens`` are seen and every layer of the budget has measured a block."""
        if self.widths is not None:
            return False
        observed = sum(e.tokens > 0 for e in self.errors.values())
        return seen < self.adaptive.warmup_tokens or observed < self.layers

    def end_call(self, layer_idx: int, seen: int) -> None:
        """A layer's settle ends: its query rows go (they serve the blocks the same call measures),
        and once the warm-up is over the allocation is made, which frees every layer's measurement
        (see :meth:`allocate`), so no measurement tensor outlives the warm-up."""
        self.drop_queries(layer_idx)
        if self.widths is None and self.errors and not self.measuring(seen):
            self.allocate()

    def drop_queries(self, layer_idx: int) -> None:
        """Forget a layer's query rows (a call's settle ended, or failed)."""
        err = self.errors.get(layer_idx)
        if err is not None:
            err.queries = None

    def measure_tensors(self, layer_idx: int) -> list[torch.Tensor]:
        """The measurement tensors of one layer held now (empty after the warm-up)."""
        err = self.errors.get(layer_idx)
        return [] if err is None else err.tensors()

    def planned_measure_bytes(self, seen: int, moved_blocks: int) -> int:
        """Bytes of one layer's measurement between calls at length ``seen`` with ``moved_blocks``
        blocks past the hot window (what :func:`kvtier.sizing.estimate` prices): its accumulators
        while the warm-up lasts (``warmup_tokens`` and a first block of non-sink tokens measured)."""
        s = self.shape
        assert s is not None and self.policy.hot_tokens is not None
        first = self.policy.sink_tokens // self.policy.block_tokens  # blocks the sinks fill wholly
        if seen >= self.adaptive.warmup_tokens and moved_blocks > first:
            return 0
        return LayerErrors.nbytes(sum(len(ws) for ws in self.family_widths.values()), s.heads, s.dim)

    def cold_codec(self, layer_idx: int) -> MixedCodec | VqCodec:
        """The layer's cold codec (allocating first if needed)."""
        if self.widths is None:
            self.allocate()
        assert self.widths is not None and self.shape is not None
        if layer_idx in self.widths:
            kb, vb = self.widths[layer_idx]
            return self._codec(kb, vb, self.families.get(layer_idx))
        return self._codec(*self._cheapest()[1:])

    def _codec(self, kb: int, vb: int, codes: str | None = None) -> MixedCodec | VqCodec:
        """The cold codec at key / value widths ``kb`` / ``vb`` in the family ``codes`` (None: the
        policy's one family)."""
        assert self.shape is not None
        g = value_group(self.policy, self.shape.dim)
        if (codes or self.adaptive.codes) == "vq":
            return VqCodec(kb, vb, g)
        return MixedCodec(kb, vb, g, rotate=self.policy.cold_rotation, meta=self.adaptive.meta)

    # --- sizes ---------------------------------------------------------------------------------
    def exact_bytes(self) -> int:
        """Sinks and hot ring of all layers at their largest (bytes)."""
        s = self.shape
        assert s is not None
        p = self.policy
        elt = torch.empty(0, dtype=s.dtype).element_size()
        per_layer = 2 * s.batch * s.heads * (p.sink_tokens + p.hot_tokens + p.block_tokens) * s.dim * elt
        return s.layers * (per_layer + (8 * s.batch if p.sink_tokens else 0))

    def budget_bytes(self, tokens: int) -> float:
        """What ``bits`` allows for ``tokens`` tokens per row, all layers."""
        s = self.shape
        assert s is not None
        return self.adaptive.bits / 8 * 2 * s.batch * s.heads * s.dim * tokens * s.layers

    def _meta_bytes(self, codes: str) -> float:
        """Parameter bytes per token slot of one layer's cold tier in the family ``codes`` (both sides)."""
        s = self.shape
        assert s is not None
        T = self.policy.block_tokens
        if codes == "vq":  # the codec's bytes per token slot, less its codes
            w = self.family_widths["vq"][0]
            return self._codec(w, w, "vq").nbytes(s.batch, s.heads, 1, T, s.dim) / T - 2 * self.code_bytes("vq")[w]
        m = META_DTYPES[self.adaptive.meta].itemsize
        g = value_group(self.policy, s.dim)
        return (2 * m * s.batch * s.heads * s.dim) / T + 2 * m * s.batch * s.heads * (s.dim // g)

    def _fixed_rates(self) -> tuple[float, float]:
        """Per token slot of a block tier, all layers: the cold tier's metadata (with one family; a
        mixed allocation prices each layer's family with its widths) + validity bytes, and the warm
        tier's whole bytes."""
        s = self.shape
        assert s is not None
        T = self.policy.block_tokens
        meta = (0.0 if self.mixed else self._meta_bytes(self.adaptive.codes)) + s.batch
        warm, _ = make_codecs(self.policy, s.dim)
        warm_rate = warm.nbytes(s.batch, s.heads, 1, T, s.dim) / T + s.batch
        return meta * s.layers, warm_rate * s.layers

    def code_bytes(self, codes: str | None = None) -> dict[int, float]:
        """Code bytes per token of one side of one layer at each candidate width of the family
        ``codes`` (None: the policy's one family)."""
        s = self.shape
        assert s is not None
        codes = codes or self.adaptive.codes
        if codes == "vq":
            return {w: float(s.batch * s.heads * code_bytes_per_token(w, s.dim)) for w in self.family_widths["vq"]}
        return {w: float(s.batch * s.heads * packed_size(s.dim, w)) for w in self.family_widths[codes]}

    def _layer_cost(self, codes: str, kb: int, vb: int) -> float:
        """Code (and, mixed, parameter) bytes per token slot of one layer's cold tier at these widths."""
        cb = self.code_bytes(codes)
        return cb[kb] + cb[vb] + (self._meta_bytes(codes) if self.mixed else 0.0)

    def _cheapest(self) -> tuple[str, int, int]:
        """The cheapest ``(codes, key bits, value bits)`` of one layer (the narrowest width; mixed: of
        the family whose narrowest codes and parameters cost least)."""
        return min(((f, ws[0], ws[0]) for f, ws in self.family_widths.items()), key=lambda c: self._layer_cost(*c))

    def _dearest(self) -> tuple[str, int, int]:
        return max(((f, ws[-1], ws[-1]) for f, ws in self.family_widths.items()), key=lambda c: self._layer_cost(*c))

    def code_budget(self) -> float:
        """Code bytes per kept cold token slot, all layers, that ``bits`` leaves at ``fit_tokens``
        with no warm window (``keep`` of the tokens past the hot window kept), less what the up to
        ``g - 1`` blocks waiting in the warm tier for a whole eviction group hold there."""
        assert self.shape is not None and self.policy.hot_tokens is not None
        fit = self.adaptive.fit_tokens
        wait = (self.adaptive.keep_blocks[1] - 1) * self.policy.block_tokens
        meta_rate, warm_rate = self._fixed_rates()
        room = self.budget_bytes(fit) - self.exact_bytes() - wait * warm_rate
        slots = max(1.0, (fit - self.policy.hot_tokens - wait) * self.keep)
        return room / slots - meta_rate

    def allocate(self) -> dict[int, tuple[int, int]]:
        """Choose the cold widths from what was measured (see :func:`allocate`) and free the
        measurement tensors (:meth:`LayerErrors.freeze`); idempotent. Warns
        (:class:`~kvtier.errors.BudgetWarning`) when even the narrowest widths cannot hold ``bits``
        at ``fit_tokens``: the cache then holds more than asked, and says so once."""
        if self.widths is not None:
            return self.widths
        budget = self.code_budget()
        if self.mixed:
            fw = self.family_widths
            cb = {f: self.code_bytes(f) for f in fw}
            choice = allocate_families(self.errors, fw, cb, {f: self._meta_bytes(f) for f in fw}, budget)
            self.families = {layer: c[0] for layer, c in choice.items()}
            self.widths = {layer: (c[1], c[2]) for layer, c in choice.items()}
        else:
            self.widths = allocate(self.errors, self.candidates, self.code_bytes(), budget)
        for err in self.errors.values():  # measuring is over: its tensors go
            err.freeze()
        floor = self.floor_bits()
        if floor > self.adaptive.bits + 1e-9:
            warnings.warn(
                f"bits={self.adaptive.bits:g} cannot be held at fit_tokens={self.adaptive.fit_tokens}: the exact "
                f"sinks and hot ring with the narrowest cold codes take {floor:.2f} bits per element there "
                "(longer contexts come closer); raise bits or fit_tokens, or lower keep",
                BudgetWarning,
                stacklevel=2,
            )
        return self.widths

    def floor_bits(self) -> float:
        """The fewest bits per element the cache can hold at ``fit_tokens`` (no warm window past the
        blocks waiting for an eviction group, every layer at the narrowest widths)."""
        s = self.shape
        assert s is not None and self.policy.hot_tokens is not None
        fit = self.adaptive.fit_tokens
        wait = (self.adaptive.keep_blocks[1] - 1) * self.policy.block_tokens
        meta_rate, warm_rate = self._fixed_rates()
        narrow = self._layer_cost(*self._cheapest()) * self.layers
        slots = max(0.0, (fit - self.policy.hot_tokens - wait) * self.keep)
        held = self.exact_bytes() + wait * warm_rate + slots * (narrow + meta_rate)
        return held / (2 * s.batch * s.heads * s.dim * fit * s.layers) * 8

    def planned_rates(self) -> tuple[float, float]:
        """``(cold, warm)`` bytes per token slot stepping down from / held in the warm tier, all
        layers, as priced before a run (``kvtier plan``): the cold codes at the allocation's budget
        (which the greedy rule spends to within one width step), bounded by the narrowest and widest
        candidates, times ``keep``."""
        meta_rate, warm_rate = self._fixed_rates()
        lo, hi = (self._layer_cost(*c) * self.layers for c in (self._cheapest(), self._dearest()))
        return (min(max(self.code_budget(), lo), hi) + meta_rate) * self.keep, warm_rate

    def rates(self) -> tuple[float, float]:
        """``(cold, warm)`` bytes per token slot stepping down from / held in the warm tier, all
        layers, once allocated (the cold rate times ``keep``)."""
        assert self.widths is not None
        if self._rates is None:
            meta_rate, warm_rate = self._fixed_rates()
            f0 = self.adaptive.codes
            codes = sum(self._layer_cost(self.families.get(i, f0), k, v) for i, (k, v) in self.widths.items())
            codes += (self.layers - len(self.widths)) * self._layer_cost(*self._cheapest())
            self._rates = ((codes + meta_rate) * self.keep, warm_rate, 0.0)
        return self._rates[0], self._rates[1]

    def warm_blocks(self, seen: int, blocks: int, planned: bool = False) -> float:
        """How many of a layer's ``blocks`` block-tier blocks (cold ones counted before eviction)
        may be warm at length ``seen``: the
        most that keeps every layer's bytes (each layer holding the same counts) within the budget;
        unbounded during the warm-up. ``planned``: priced with :meth:`planned_rates` (no run)."""
        if planned:
            if seen < self.adaptive.warmup_tokens:
                return float("inf")
            cold, warm = self.planned_rates()
        else:
            if self.measuring(seen):
                return float("inf")
            self.allocate()
            cold, warm = self.rates()
        T = self.policy.block_tokens
        room = self.budget_bytes(seen) - self.exact_bytes() - blocks * T * cold
        step = T * (warm - cold)
        if step <= 0:
            return float(blocks)
        return float(max(0, min(blocks, int(room // step))))

    def report(self) -> dict:
        """The allocation and what it was chosen from: widths and distortion per layer."""
        out = {"bits": self.adaptive.bits, "keep": self.keep, "allocated": self.allocated, "layers": {}}
        for idx, err in sorted(self.errors.items()):
            kb, vb = (None, None) if self.widths is None else self.widths.get(idx, (None, None))
            out["layers"][idx] = {
                "codes": self.families.get(idx, None if self.mixed else self.adaptive.codes),
                "key_bits": kb,
                "value_bits": vb,
                "key_distortion": _by_option(err, "k"),
                "value_distortion": _by_option(err, "v"),
            }
        return out


def _by_option(err: LayerErrors, side: str) -> dict:
    """Distortions of one side per width (one family) or per ``"codes:width"`` (mixed)."""
    if err.family is not None:
        return {w: err.distortion(side, w) for _, w in err.options}
    return {f"{c}:{w}": err.distortion(side, w, c) for c, w in err.options}
