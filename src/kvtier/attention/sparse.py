"""Dynamic block-sparse selection over the warm and cold tiers, and exact work accounting.

Block score: Quest's upper bound of ``q . k`` over a block, ``sum_d max(q_d lo_d, q_d hi_d)``,
where ``lo, hi`` are the per-channel extremes of the block's *stored* keys. They come for free
from the quantization metadata (:meth:`~kvtier.codecs.AffineCodec.key_range`: a k-bit block
spans ``[-zero * scale, (qmax - zero) * scale]`` per channel, a sign block ``mean -/+ scale``).
The bound costs ``1 / block_tokens`` of the scores.

Each query row keeps the blocks its method selects (see :class:`~kvtier.policy.SparsePolicy`),
plus every block overlapping its local window. The attention then reads only the union of the
blocks a KV head's rows selected (gathered packed blocks), and masks per row within it.
"""

from __future__ import annotations

import math

import torch

from ..cache.tiers import BlockTier
from ..indexing import union_blocks
from ..policy import SparsePolicy
from ..quant import rotation

__all__ = ["block_bounds", "gather_fields", "select_blocks", "select_tokens", "union_blocks"]


def block_bounds(rows: torch.Tensor, tier: BlockTier) -> torch.Tensor:
    """Upper bound of ``row . k`` per block: ``rows [B,H,R,D]`` -> ``[B,H,R,n]`` (-inf: empty block)."""
    f = tier.fields
    lo, hi = tier.codec.key_range(f)  # [B,H,n,D]
    if tier.codec.rotate:  # bounds of the rotated keys: score the rotated rows
        rows = rows @ rotation(rows.shape[-1], rows.device)
    bound = rows.clamp(min=0) @ hi.transpose(-1, -2) + rows.clamp(max=0) @ lo.transpose(-1, -2)
    empty = ~f["valid"].any(-1)  # [B,1,n]
    return bound.masked_fill(empty.unsqueeze(2), float("-inf"))


def select_blocks(
    bounds: torch.Tensor,
    policy: SparsePolicy,
    forced: torch.Tensor,
    block_tokens: int,
    counts: torch.Tensor | None = None,
    exact_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool ``[B,H,R,n]``: blocks each row keeps.

    Parameters
    ----------
    bounds : ``[B,H,R,n]`` block scores (-inf for empty blocks).
    forced : bool broadcastable to ``bounds``: blocks always kept (local window).
    counts : real tokens per block, broadcastable to ``bounds`` (``"bound"`` only).
    exact_lse : ``[B,H,R]`` log-sum-exp of the tokens attended exactly (sinks, hot) (``"bound"`` only).

    ``"bound"`` is a guarantee, not an estimate: since ``bounds`` are upper bounds of every score in
    their block, a block's softmax mass is at most ``counts * exp(bound - lse_total)`` and
    ``lse_total >= exact_lse``. Blocks are dropped from the lowest bound up while the sum of those
    upper bounds stays within ``1 - level``: the mass dropped is at most ``1 - level`` of the row's.
    """
    n = bounds.shape[-1]
    finite = torch.isfinite(bounds)
    if policy.method == "bound":
        if counts is None or exact_lse is None:
            raise ValueError("method='bound' needs counts and exact_lse")
        ub = torch.exp(bounds - exact_lse.unsqueeze(-1)) * counts  # upper bound of each block's mass
        ub = torch.where(finite, ub, torch.zeros_like(ub))
        order = bounds.masked_fill(~finite, float("-inf")).argsort(dim=-1)  # ascending
        cum = ub.gather(-1, order).cumsum(-1)
        drop_sorted = cum <= (1 - policy.level)
        keep = ~torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    elif policy.method == "topk":
        k = min(n, max(policy.min_blocks, math.ceil(policy.level * n)))
        kth = bounds.topk(k, dim=-1).values[..., -1:]
        keep = bounds >= kth
    elif policy.method == "quantile":
        filled = torch.where(finite, bounds, torch.full_like(bounds, float("nan")))
        thr = torch.nanquantile(filled, 1 - policy.level, dim=-1, keepdim=True)
        keep = bounds >= torch.nan_to_num(thr, nan=float("inf"))
    else:  # mass
        logits = bounds + math.log(block_tokens)
        p = torch.softmax(logits.masked_fill(~finite, float("-inf")), dim=-1).nan_to_num(0.0)
        order = p.argsort(dim=-1, descending=True)
        sorted_p = p.gather(-1, order)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the blocks ranked above
        keep_sorted = before < policy.level
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    if policy.min_blocks:
        k = min(n, policy.min_blocks)
        keep |= bounds >= bounds.topk(k, dim=-1).values[..., -1:]
    return (keep | forced) & finite


LN2 = math.log(2.0)
#: Weight buckets of the token mass rule: bucket k holds weights in (2^-(k+1), 2^-k] of the row max.
BUCKETS = 64


def select_tokens(
    scores: torch.Tensor, policy: SparsePolicy, forced: torch.Tensor | None, rest_lse: torch.Tensor | None = None
) -> torch.Tensor:
    """bool ``[..., N]``: tokens whose value work is done, from exact scores (-inf = invalid).

    ``mass``: with weights ``w = exp(s - max)`` and buckets ``k = floor((max - s) / ln 2)`` (capped
    at 63), keep buckets ``0..K``, ``K`` the first bucket at which the kept weight reaches
    ``sum(w) - (1 - level) * (sum(w) + exp(rest_lse - max))``: the dropped tokens carry at most
    ``1 - level`` of the row's mass, ``rest_lse [...]`` being the log mass of the row's other
    attended tokens (sinks, hot; None: the tier alone). Bucket 0 (the row's top token) is always kept.
    ``quantile``: keep the ``ceil(level * n_valid)`` highest scores (ties kept).
    ``forced`` tokens (local window) are always kept.
    """
    finite = torch.isfinite(scores)
    if policy.method == "mass":
        m = scores.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        w = torch.exp(scores - m)  # 0 where invalid
        k = ((m - scores) / LN2).floor().clamp(0, BUCKETS - 1).nan_to_num(BUCKETS - 1).long()
        mass = torch.zeros(*scores.shape[:-1], BUCKETS, device=scores.device).scatter_add_(-1, k, w)
        cum = mass.cumsum(-1)
        total = cum[..., -1:]
        rest = 0.0 if rest_lse is None else torch.exp(rest_lse.unsqueeze(-1) - m)
        target = total - (1 - policy.level) * (total + rest)
        kstar = (cum < target).sum(-1, keepdim=True)
        keep = k <= kstar
    else:  # quantile
        n_valid = finite.sum(-1, keepdim=True)
        rank = (policy.level * n_valid).ceil().long().clamp(min=1) - 1
        ordered = scores.sort(dim=-1, descending=True).values
        keep = scores >= ordered.gather(-1, rank.clamp(max=scores.shape[-1] - 1))
    if forced is not None:
        keep = keep | forced
    return keep & finite


def gather_fields(fields: dict[str, torch.Tensor], blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tier tensors restricted to ``blocks [B,H,k]`` (``-1`` entries read block 0; mask them)."""
    B, H, k = blocks.shape
    idx = blocks.clamp(min=0)
    out = {}
    for name, t in fields.items():
        if t.shape[1] != H:
            t = t.expand(t.shape[0], H, *t.shape[2:])
        view = idx.reshape(B, H, k, *([1] * (t.dim() - 3))).expand(B, H, k, *t.shape[3:])
        if t.dtype.is_floating_point and t.element_size() == 1:  # fp8 (e.g. cold_meta="fp8"): torch has
            out[name] = t.view(torch.uint8).gather(2, view).view(t.dtype)  # no fp8 gather; move the bytes
        else:
            out[name] = t.gather(2, view)
    return out
