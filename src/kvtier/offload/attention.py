"""Attention over a layer whose cold tier is offloaded: sketch-scored block selection, exact attention
over the fetched blocks, merged by log-sum-exp with sinks, warm and hot.

Per query row (the ``Gq * q`` queries sharing a KV head) and call:

1. exact partials of sinks and hot (and the warm tier if the policy has one) give the row's exact
   resident mass ``lse_res``;
2. the 1-bit sketches give every cold block an estimated log mass ``lse_j``
   (:func:`kvtier.offload.sketch.block_lse`);
3. :func:`select_offloaded` keeps blocks in descending ``lse_j`` until the resident mass plus the
   kept blocks cover ``mass`` of the estimated total ``lse_res (+) lse_1 (+) ... (+) lse_n``, within
   ``[min_blocks, max_blocks]``, plus blocks in the row's local window;
4. the union of the kept blocks per (row, KV head) is fetched - used in place where the
   prefetcher staged it, read synchronously otherwise - and attended *exactly* with a per-row
   mask (:func:`exact_partial`, one partial per source): a row never sees a block it did not
   select, so the result equals exact attention with the unselected blocks removed (up to fp32
   summation order), and with an unlimited budget it equals exact attention.
"""

from __future__ import annotations

import torch

from ..attention.mask import KVMask
from ..attention.partials import Partial, exact_partial, from_rows, merge, to_rows
from ..attention.plan import AttentionPlan, ChunkPlan, plan_for
from ..cache.state import LayerState
from ..indexing import hot_rows_allowed
from ..policy import OffloadPolicy
from .sketch import block_lse
from .tier import OffloadTier


def select_offloaded(
    lse_blocks: torch.Tensor, lse_resident: torch.Tensor, policy: OffloadPolicy, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """bool ``[B, H, R, n]``: the cold blocks each query row keeps.

    Parameters
    ----------
    lse_blocks : ``[B, H, R, n]`` estimated log mass of each block (``-inf``: nothing valid).
    lse_resident : ``[B, H, R]`` exact log mass of the resident tokens (sinks, warm, hot).
    policy : the budget (``mass``, ``max_blocks``, ``min_blocks``).
    forced : bool broadcastable to ``lse_blocks``: blocks always kept (local window), or None.
    """
    finite = torch.isfinite(lse_blocks)
    n = lse_blocks.shape[-1]
    if n == 0:
        return finite
    order = lse_blocks.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))
    if policy.mass is None:
        keep = torch.ones_like(finite)
    else:
        total = torch.logaddexp(lse_resident, torch.logsumexp(lse_blocks, dim=-1))  # [B,H,R]
        total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
        p = torch.exp(lse_blocks.gather(-1, order) - total.unsqueeze(-1))  # sorted block shares
        covered = torch.exp(lse_resident - total).unsqueeze(-1) + p.cumsum(-1) - p  # before each block
        keep = torch.zeros_like(finite).scatter_(-1, order, covered < policy.mass)
    if policy.max_blocks is not None:
        keep &= rank < policy.max_blocks
    if policy.min_blocks:
        keep |= rank < policy.min_blocks
    if forced is not None:
        keep = keep | forced
    return keep & finite


def _cold_partials(
    tier: OffloadTier, rows: torch.Tensor, row_pos: torch.Tensor, resident: list[Partial], start: int, kernel: bool
) -> list[Partial]:
    """Select, fetch and attend the offloaded blocks for ``rows [B,H,R,D]``: one exact partial per
    source of :meth:`OffloadTier.gather` (staged hits, synchronous misses), each row masked to the
    blocks it selected."""
    policy = tier.policy
    T = tier.block_tokens
    B, H, R, D = rows.shape
    scores = block_lse(rows, tier.fields, tier.sketch, kernel)  # [B,H,R,n]
    forced = None
    if policy.local_window:
        ends = start + T * torch.arange(1, tier.nblocks + 1, device=rows.device)
        forced = ends[None, None, None, :] > (row_pos - policy.local_window)[None, None, :, None]
    if policy.unlimited:
        keep = torch.isfinite(scores)
    else:
        lse_res = torch.stack([p.lse for p in resident]).logsumexp(0)  # hot is never empty
        keep = select_offloaded(scores, lse_res, policy, forced)
    tier.observe(keep, scores)
    valid = tier.fields["valid"].expand(B, H, -1, -1)  # [B,H,n,T]
    parts = []
    for blocks, k, v in tier.gather(keep.any(2)):
        kk = blocks.shape[-1]
        idx = blocks.clamp(min=0)
        row_mask = keep.gather(-1, idx.unsqueeze(2).expand(-1, -1, R, -1)) & (blocks >= 0).unsqueeze(2)
        vg = valid.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, T))  # [B,H,k,T]
        allowed = (row_mask.unsqueeze(-1) & vg.unsqueeze(2)).reshape(B, H, R, kk * T)
        parts.append(exact_partial(rows, k.reshape(B, H, kk * T, D), v.reshape(B, H, kk * T, D), allowed))
    return parts


def _attend(
    layer: LayerState, query: torch.Tensor, q_pos: torch.Tensor, padding, scaling: float, chunk: ChunkPlan
) -> torch.Tensor:
    B, Hq, q, D = query.shape
    H = layer.kv_heads
    rows = to_rows(query, H, scaling)
    tier = layer.cold
    parts: list[Partial] = []
    if layer.sinks.k is not None:
        parts.append(chunk.exact.exact(rows, layer.sinks.k, layer.sinks.v, layer.sinks.valid()[:, None, None, :]))
    if layer.warm is not None and layer.warm.nblocks:
        warm = layer.warm
        parts.append(chunk.backend(warm.codec).tier(rows, warm.fields, warm.codec, D))
    hk, hv = layer.hot.view()
    parts.append(chunk.exact.exact(rows, hk, hv, hot_rows_allowed(layer, q_pos, padding, Hq // H)))
    if tier.nblocks:
        parts += _cold_partials(tier, rows, q_pos.repeat(Hq // H), parts, layer.evicted, chunk.sketch_kernel)
    return from_rows(merge(parts), Hq, q)


def offload_attention(
    layer: LayerState, query: torch.Tensor, mask: KVMask | None, scaling: float, plan: AttentionPlan | None = None
) -> torch.Tensor:
    """Attention of ``query [B, Hq, q, D]`` over a layer with an offloaded cold tier -> ``[B, q, Hq, D]``,
    in the query chunks and with the backends of ``plan`` (default: the call's plan, see
    :func:`kvtier.attention.plan.plan_for`)."""
    if mask is not None and not mask.causal:
        raise NotImplementedError("tiered layers support causal (+ padding) masks only")
    tier = layer.cold
    assert isinstance(tier, OffloadTier)
    padding = None if mask is None else mask.padding
    if plan is None:
        plan = plan_for(layer, query, mask)
    first = layer.seen - query.shape[2]
    tier.offloader.begin(tier)
    try:
        outs = []
        for c in plan.chunks:
            q_pos = first + torch.arange(c.start, c.stop, device=query.device)
            outs.append(_attend(layer, query[:, :, c.start : c.stop], q_pos, padding, scaling, c))
    finally:
        tier.end_step()
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.to(query.dtype).contiguous()
