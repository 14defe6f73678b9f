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

The CPU decode path (:func:`_attend_kernel`, where the plan says so:
:attr:`~kvtier.attention.plan.ChunkPlan.offload_kernel`, and ``offload_fused`` for sinks and hot)
does steps 2-4 in two calls per layer (:mod:`kvtier.kernels.offload_cpu`): a *two-level*
selection - a coarse per-block bound orders the blocks and only the blocks whose bound could still
matter are scored from their sketch (``OffloadPolicy.coarse_tol``) - and exact attention reading
each selected record where it lies in a host-RAM store (no gather copy), or in the buffers
:meth:`OffloadTier.sources` read (disk, prefetch), merged with the resident part.
A layer may reuse its previous selection for ``OffloadPolicy.reuse_every(n) - 1`` decode steps.
Its references are :func:`select_two_level_torch` and :func:`attend_blocks_torch`.
"""

from __future__ import annotations

import torch

from ..cache.state import LayerState
from ..indexing import hot_rows_allowed
from ..kernels import fused_cpu
from ..offload.sketch import KeySketch, block_lse, block_lse_torch, expand, nonempty, query_rows, unpack_valid
from ..offload.tier import OffloadTier
from ..policy import OffloadPolicy
from .mask import KVMask
from .partials import Partial, exact_partial, from_rows, merge, to_rows
from .plan import AttentionPlan, ChunkPlan, plan_for


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


def estimated_skipped(scores: torch.Tensor, keep: torch.Tensor, lse_resident: torch.Tensor) -> torch.Tensor:
    """``[B, H, R]``: each row's estimated share of its attention mass in the cold blocks it did
    not keep - the sketch estimates ``scores [B,H,R,n]`` (log mass; ``-inf``: empty or not scored)
    of the blocks outside ``keep [B,H,R,n]`` over the estimated total with the exact resident mass
    ``lse_resident [B,H,R]``."""
    total = torch.logaddexp(lse_resident, scores.logsumexp(-1))
    return torch.exp(scores.masked_fill(keep, float("-inf")).logsumexp(-1) - total)


def budget_binds(policy: OffloadPolicy, n: int) -> bool:
    """Whether the read budget ``max_blocks`` can cut a row's selection in a layer of ``n`` cold blocks."""
    return policy.max_blocks is not None and n > policy.max_blocks


def _cold_partials(
    tier: OffloadTier, rows: torch.Tensor, row_pos: torch.Tensor, resident: list[Partial], start: int, kernel: bool
) -> list[Partial]:
    """Select, fetch and attend the offloaded blocks for ``rows [B,H,R,D]``: one exact partial per
    source of :meth:`OffloadTier.sources` (staged hits, synchronous misses), each row masked to the
    blocks it selected."""
    policy = tier.policy
    T = tier.block_tokens
    B, H, R, D = rows.shape
    fields = expand(tier.fields, T)

    def fresh():
        scores = block_lse(rows, fields, tier.sketch, kernel)  # [B,H,R,n]
        forced = None
        if policy.local_window:
            ends = start + T * torch.arange(1, tier.nblocks + 1, device=rows.device)
            forced = ends[None, None, None, :] > (row_pos - policy.local_window)[None, None, :, None]
        if policy.unlimited:
            return torch.isfinite(scores), scores, 0, None
        lse_res = torch.stack([p.lse for p in resident]).logsumexp(0)  # hot is never empty
        keep = select_offloaded(scores, lse_res, policy, forced)
        skipped = estimated_skipped(scores, keep, lse_res) if budget_binds(policy, scores.shape[-1]) else None
        return keep, scores, 0, skipped

    keep = tier.select(B, H, R, fresh, reuse=False)
    valid = fields["valid"].expand(B, H, -1, -1)  # [B,H,n,T]
    parts = []
    for blocks, k, v in tier.sources(keep.any(2)):
        kk = blocks.shape[-1]
        idx = blocks.clamp(min=0)
        row_mask = keep.gather(-1, idx.unsqueeze(2).expand(-1, -1, R, -1)) & (blocks >= 0).unsqueeze(2)
        vg = valid.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, T))  # [B,H,k,T]
        allowed = (row_mask.unsqueeze(-1) & vg.unsqueeze(2)).reshape(B, H, R, kk * T)
        parts.append(exact_partial(rows, k.reshape(B, H, kk * T, D), v.reshape(B, H, kk * T, D), allowed))
    return parts


def coarse_bounds(qrot: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """Upper bound of each block's sketch log-sum-exp: ``qrot [B,H,R,D]`` (rotated like the sketch),
    ``fields`` the float view (:func:`kvtier.offload.sketch.expand`) -> ``[B,H,R,n]`` (``-inf``: no
    valid token). Every sketched key is ``mean + alpha_t * scale *
    (+-1)`` with ``0 <= alpha_t <= amax``, so its score is at most ``q . mean + amax * sum_c |q_c
    scale_c|``, and a block's log-sum-exp at most that plus ``log(valid tokens)``."""
    mean = fields["k_mean"].float().squeeze(3)  # [B,H,n,D]
    scale = fields["k_scale"].float().squeeze(3)
    amax = fields["k_amax"].float()  # [B,H,n]
    dm = qrot @ mean.transpose(-1, -2)  # [B,H,R,n]
    da = qrot.abs() @ scale.abs().transpose(-1, -2)
    count = fields["valid"].sum(-1).float()  # [B,1,n]
    return (dm + amax.unsqueeze(2) * da + count.log().unsqueeze(2)).masked_fill(
        (count == 0).unsqueeze(2), float("-inf")
    )


def select_two_level_torch(
    qrot: torch.Tensor,
    fields: dict[str, torch.Tensor],
    lse_res: torch.Tensor,
    forced_from: torch.Tensor,
    policy: OffloadPolicy,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of :func:`kvtier.kernels.offload_cpu.offload_select`: ``(keep [B,H,R,n], lse
    [B,H,R,n], scored [B*H])``. ``qrot`` are the rotated rows, ``fields`` the float view
    (:func:`kvtier.offload.sketch.expand`) of the coded fields the kernel reads; the sketch estimate is computed for
    every block here and masked to the blocks the walk scores."""
    B, H, R, _ = qrot.shape
    n = fields["valid"].shape[2]
    ub = coarse_bounds(qrot, fields)  # [B,H,R,n]
    lse_all = block_lse_torch(qrot, fields, KeySketch(rotate=False))  # rows already rotated  # [B,H,R,n]
    order = ub.amax(2).argsort(dim=-1, descending=True, stable=True)  # [B,H,n]
    idx = order.unsqueeze(2).expand(-1, -1, R, -1)
    ub_o, lse_o = ub.gather(-1, idx), lse_all.gather(-1, idx)
    # suffix log-sum-exp of the bounds from position p on; totals after scoring p blocks
    suf = torch.cat([ub_o.flip(-1).logcumsumexp(-1).flip(-1), torch.full_like(ub_o[..., :1], float("-inf"))], -1)
    tot = torch.cat([lse_res.unsqueeze(-1), torch.logaddexp(lse_res.unsqueeze(-1), lse_o.logcumsumexp(-1))], -1)
    tol = policy.coarse_tol
    log_tol = torch.tensor(tol).log() if tol > 0 else torch.tensor(float("-inf"))
    done = (suf <= log_tol + tot).all(2)  # [B,H,n+1]: the walk stops before position p
    nonempty = torch.isfinite(ub_o.amax(2))  # [B,H,n]
    done[..., :n] |= ~nonempty
    done[..., n] = True
    stop = done.float().argmax(-1)  # first p where the walk stops
    scored_o = torch.arange(n, device=qrot.device) < stop.unsqueeze(-1)  # [B,H,n] in walk order
    scored = torch.zeros_like(scored_o).scatter(-1, order, scored_o)
    lse = lse_all.masked_fill(~scored.unsqueeze(2), float("-inf"))
    ends = torch.arange(n, device=qrot.device)
    forced = (ends[None, :] >= forced_from[:, None])[None, None] & nonempty_blocks(fields).unsqueeze(2)
    keep = select_offloaded(lse, lse_res, policy, forced)
    return keep | forced, lse, stop.reshape(B * H)


def nonempty_blocks(fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """bool ``[B, 1, n]``: blocks holding a valid token (``fields``: the float view)."""
    return fields["valid"].any(-1)


def attend_blocks_torch(
    rows: torch.Tensor,
    keep: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    out_prev: torch.Tensor,
    lse_prev: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`kvtier.kernels.offload_cpu.offload_attend` over dense blocks ``k, v
    [B,H,n,T,D]`` (``keep [B,H,R,n]``, ``valid [B,1,n,T]``): exact attention over the kept blocks'
    valid tokens merged with ``(out_prev, lse_prev)`` -> ``(out [B,H,R,D], lse [B,H,R])``."""
    B, H, n, T, D = k.shape
    R = rows.shape[2]
    allowed = (keep.unsqueeze(-1) & valid.unsqueeze(2)).reshape(B, H, R, n * T)
    part = exact_partial(rows, k.reshape(B, H, n * T, D).float(), v.reshape(B, H, n * T, D).float(), allowed)
    prev = Partial(out_prev, lse_prev)
    lse = torch.logaddexp(prev.lse, part.lse)
    return merge([prev, part]), lse


def _attend_kernel(
    tier: OffloadTier,
    rows: torch.Tensor,
    row_pos: torch.Tensor,
    out_res: torch.Tensor,
    lse_res: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """The C++ path of :func:`_attend` for the cold tier: select (or reuse), attend in place,
    merge with the resident part (``out_res [B,H,R,D]``, ``lse_res [B,H,R]``). Returns ``out [B,H,R,D]``."""
    from ..kernels import offload_cpu

    policy = tier.policy
    T = tier.block_tokens
    B, H, R, D = rows.shape
    fields = tier.fields
    n = tier.nblocks
    tier.stats.blocks_total += B * H * n

    def fresh():
        if policy.local_window:
            forced_from = torch.div(row_pos - policy.local_window - start, T, rounding_mode="floor").clamp(min=0)
        else:
            forced_from = torch.full((R,), n, dtype=torch.long)
        if policy.unlimited:
            keep = nonempty(fields["valid_bits"]).unsqueeze(2).expand(B, H, R, n).contiguous()
            return keep, torch.zeros(keep.shape).masked_fill(~keep, float("-inf")), 0, None
        keep, scores, counts = offload_cpu.offload_select(
            query_rows(rows, tier.sketch),
            fields,
            lse_res,
            forced_from,
            policy.mass,
            policy.min_blocks,
            policy.max_blocks,
            policy.coarse_tol,
        )
        skipped = estimated_skipped(scores, keep, lse_res) if budget_binds(policy, n) else None
        return keep, scores, int(counts.sum()), skipped

    keep = tier.select(B, H, R, fresh, reuse=True)
    valid = fields["valid_bits"]
    if tier.in_place:
        kptr, vptr = tier.record_addresses()
        out, lse, _ = offload_cpu.offload_attend(rows, keep, kptr, vptr, valid, T, tier.layout.dtype, out_res, lse_res)
        union = int(keep.any(2).sum())
        tier.stats.needed += union
        tier.stats.in_place += union
    else:
        out, lse = out_res, lse_res
        for blocks, k, v in tier.sources(keep.any(2)):
            kptr, vptr = _source_addresses(blocks, k, v, n)
            out, lse, _ = offload_cpu.offload_attend(rows, keep, kptr, vptr, valid, T, k.dtype, out, lse)
    if tier.measure_skipped:
        tier.measure(rows, keep, lse_res)
    return out


def _source_addresses(blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int):
    """Address tables ``[B,H,n]`` of a gathered source (``blocks [B,H,kk]``, ``k, v [B,H,kk,T,D]``,
    each block's ``[T, D]`` contiguous); blocks not in the source get 0."""
    B, H, kk = blocks.shape
    present = blocks >= 0
    idx = torch.where(present, blocks, torch.full_like(blocks, n))
    out = []
    for t in (k, v):
        assert t.stride(-1) == 1 and t.stride(-2) == t.shape[-1], "a block's [T, D] must be contiguous"
        b = torch.arange(B).view(B, 1, 1) * t.stride(0)
        h = torch.arange(H).view(1, H, 1) * t.stride(1)
        i = torch.arange(kk).view(1, 1, kk) * t.stride(2)
        addr = (b + h + i) * t.element_size() + t.data_ptr()
        table = torch.zeros(B, H, n + 1, dtype=torch.long)
        table.scatter_(-1, idx, torch.where(present, addr, torch.zeros_like(addr)))
        out.append(table[..., :n])
    return out[0], out[1]


def _cold_dense(tier: OffloadTier, rows: torch.Tensor, chunk: ChunkPlan) -> list[Partial]:
    """Every cold block, exactly (a call longer than ``OffloadPolicy.max_query_tokens``): one
    partial per source of :meth:`OffloadTier.sources`, masked only by the blocks' valid tokens
    (every cold token precedes the call's queries)."""
    B, H, R, D = rows.shape
    T = tier.block_tokens
    valid = unpack_valid(tier.fields["valid_bits"], T).expand(B, H, -1, -1)  # [B,H,n,T]
    parts = []
    for blocks, k, v in tier.sources(valid.any(-1)):
        kk = blocks.shape[-1]
        idx = blocks.clamp(min=0)
        vg = valid.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, T)) & (blocks >= 0).unsqueeze(-1)
        allowed = vg.reshape(B, H, 1, kk * T)
        parts.append(chunk.exact.exact(rows, k.reshape(B, H, kk * T, D), v.reshape(B, H, kk * T, D), allowed))
    return parts


def _attend(
    layer: LayerState,
    query: torch.Tensor,
    q_pos: torch.Tensor,
    padding,
    scaling: float,
    chunk: ChunkPlan,
    dense: bool = False,
) -> torch.Tensor:
    B, Hq, q, D = query.shape
    H = layer.kv_heads
    rows = to_rows(query, H, scaling)
    tier = layer.cold
    parts: list[Partial] = []
    fast = not dense and tier.nblocks and chunk.offload_fused and not (layer.warm and layer.warm.nblocks)
    if layer.sinks.k is not None and not fast:
        parts.append(chunk.exact.exact(rows, layer.sinks.k, layer.sinks.v, layer.sinks.valid()[:, None, None, :]))
    if layer.warm is not None and layer.warm.nblocks:
        warm = layer.warm
        parts.append(chunk.backend(warm.codec).tier(rows, warm.fields, warm.codec, D))
    hk, hv = layer.hot.view()
    if fast:
        # sinks and hot in one fused call, then the cold tier: two more C++ calls
        exact = [] if layer.sinks.k is None else [(layer.sinks.k, layer.sinks.v, layer.sinks.valid()[:, None, :])]
        if padding is None and q == 1 and int(q_pos[0]) == layer.seen - 1:  # the last token: nothing masked
            allowed = torch.ones(1, 1, hk.shape[2], dtype=torch.bool)
        else:
            allowed = hot_rows_allowed(layer, q_pos, padding, Hq // H)[:, 0]
        out, lse, _ = fused_cpu.layer_attention(rows, [*exact, (hk, hv, allowed)], [])
        return from_rows(_attend_kernel(tier, rows, q_pos.repeat(Hq // H), out, lse, layer.evicted), Hq, q)
    parts.append(chunk.exact.exact(rows, hk, hv, hot_rows_allowed(layer, q_pos, padding, Hq // H)))
    if dense:
        if tier.nblocks:
            parts += _cold_dense(tier, rows, chunk)
        return from_rows(merge(parts), Hq, q)
    if tier.nblocks and chunk.offload_kernel:
        lse_res = torch.stack([p.lse for p in parts]).logsumexp(0)
        return from_rows(_attend_kernel(tier, rows, q_pos.repeat(Hq // H), merge(parts), lse_res, layer.evicted), Hq, q)
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
            outs.append(
                _attend(layer, query[:, :, c.start : c.stop], q_pos, padding, scaling, c, plan.selection == "dense")
            )
    finally:
        tier.end_step()
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.to(query.dtype).contiguous()
