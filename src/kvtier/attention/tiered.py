"""Fast attention over a tiered layer: per-segment partials read from the stored tensors, merged by
log-sum-exp. No dense copy of the layer's K/V is built; transients are per bit-plane slice.

Everything that decides *how* is in the :class:`~kvtier.attention.plan.AttentionPlan` of the call
(built once per forward step, reused by every layer): the query chunks, the backend of each
segment (exact sinks and hot, each packed tier), whether the fused whole-layer call applies, and
the sparse selection (dense, blocks or tokens). This module follows it: it builds the
:class:`~kvtier.attention.backends.Selection` each tier reads (Quest block bounds for block
selection, the local window and the exact tokens' mass for token selection), calls the backends
and hands what they return to :mod:`.work`, which counts the work.
"""

from __future__ import annotations

import torch

from ..cache.state import LayerState
from ..indexing import hot_rows_allowed as _hot_allowed  # the name test_triton imports
from ..stats import SparseStats
from . import work
from .backends.base import DENSE, Selection
from .mask import KVMask
from .offloaded import offload_attention
from .partials import Partial, from_rows, merge, to_rows
from .plan import AttentionPlan, ChunkPlan, plan_for
from .reference import reference_attention
from .sparse import block_bounds, select_blocks, union_blocks


def _tier_starts(layer: LayerState, tiers) -> list[int]:
    """Index of each tier's first token slot (cold, then warm: consecutive ranges)."""
    starts, start = [], layer.evicted
    for t in tiers:
        starts.append(start)
        start += t.ntokens
    return starts


def _fused_attend(layer: LayerState, rows, q_pos, padding, tiers, plan: AttentionPlan, chunk: ChunkPlan, stats):
    """Every segment of the layer in one fused call (vq tiers included); the same result and work
    counts as the per-tier path of :func:`_attend`."""
    B, H, R, D = rows.shape
    q = q_pos.numel()
    exact = []
    if layer.sinks.k is not None:
        exact.append((layer.sinks.k, layer.sinks.v, layer.sinks.valid()[:, None, :]))
    hk, hv = layer.hot.view()
    if q == 1 and int(q_pos[0]) == layer.seen - 1:  # the last token: causal masks nothing, only padding
        if padding is None:
            allowed = torch.ones(1, 1, hk.shape[2], dtype=torch.bool)
        else:
            allowed = padding[:, None, layer.hot_start : layer.seen].to(torch.bool)
    else:
        allowed = _hot_allowed(layer, q_pos, padding, R // q)[:, 0]
    exact.append((hk, hv, allowed))
    starts = _tier_starts(layer, tiers)
    # the affine tiers first, as the call counts them (vq tiers last: dense, their policies refuse sparse)
    ordered = sorted(range(len(tiers)), key=lambda i: tiers[i].codec.AFFINE is None)
    segments = [(tiers[i].fields, tiers[i].codec, starts[i]) for i in ordered]
    sp = plan.sparse
    sel = DENSE if sp is None else Selection("tokens", sp.method, sp.level, q_pos.repeat(R // q) - sp.local_window + 1)
    out, _, counts = chunk.packed.layer(rows, exact, segments, sel)
    if stats is not None:
        stats = work.fused(stats, counts, [tiers[i] for i in ordered], B, H, D, R, sp is not None)
    return out, stats


def _attend(
    layer: LayerState, query: torch.Tensor, q_pos: torch.Tensor, padding, scaling: float, plan: AttentionPlan, chunk
) -> torch.Tensor:
    """One pass of a query chunk over every tier, as ``chunk`` says."""
    B, Hq, q, D = query.shape
    H = layer.kv_heads
    rows = to_rows(query, H, scaling)
    R = rows.shape[2]
    sp = plan.sparse
    stats = SparseStats(calls=1) if layer.policy.sparse is not None else None
    tiers = [t for t in (layer.cold, layer.warm) if t is not None and t.nblocks]
    if chunk.fused:
        out, stats = _fused_attend(layer, rows, q_pos, padding, tiers, plan, chunk, stats)
        if stats is not None:
            layer.sparse_stats.add(stats)
        return from_rows(out, Hq, q)
    parts: list[Partial] = []
    if layer.sinks.k is not None:
        sink_valid = layer.sinks.valid()
        parts.append(chunk.exact.exact(rows, layer.sinks.k, layer.sinks.v, sink_valid[:, None, None, :]))
        if stats is not None:
            work.exact(stats, int(sink_valid.sum()) * H * R)
    hk, hv = layer.hot.view()
    allowed = _hot_allowed(layer, q_pos, padding, Hq // H)
    parts.append(chunk.exact.exact(rows, hk, hv, allowed))
    if stats is not None:
        work.exact(stats, int(allowed.sum()) * H * (B if allowed.shape[0] == 1 else 1))
    row_pos = q_pos.repeat(Hq // H)  # position of each row
    if sp is not None and tiers:
        exact_lse = torch.logsumexp(torch.stack([p.lse for p in parts]), 0)  # sinks + hot
        if sp.select == "blocks":
            parts += _block_sparse_parts(layer, rows, row_pos, tiers, sp, stats, chunk, exact_lse)
        else:
            parts += _token_sparse_parts(layer, rows, row_pos, tiers, sp, stats, chunk, exact_lse)
    else:
        parts += [chunk.backend(t.codec).tier(rows, t.fields, t.codec, D) for t in tiers]
        if stats is not None and plan.dense_call:
            stats = work.dense_call(stats, tiers, H, R)
    if stats is not None:
        layer.sparse_stats.add(stats)
    return from_rows(merge(parts), Hq, q)


def _token_sparse_parts(layer, rows, row_pos, tiers, sp, stats: SparseStats, chunk: ChunkPlan, exact_lse):
    """Exact scores from the packed keys; value work only for tokens passing the row's threshold.
    ``exact_lse [B,H,R]``: log mass of the row's exact tokens (sinks, hot), part of the mass rule."""
    B, H, R, D = rows.shape
    forced_from = row_pos - sp.local_window + 1
    parts = []
    for t, start in zip(tiers, _tier_starts(layer, tiers)):
        sel = Selection("tokens", sp.method, sp.level, forced_from, start, exact_lse)
        part = chunk.backend(t.codec).tier(rows, t.fields, t.codec, D, sel)
        parts.append(part)
        work.tier_counts(stats, t, B, H, D, part.counts)
    return parts


def _block_sparse_parts(layer, rows, row_pos, tiers, sp, stats: SparseStats, chunk: ChunkPlan, exact_lse):
    """Partials over the blocks each row selects by Quest bounds (see :mod:`kvtier.attention.sparse`);
    ``exact_lse [B,H,R]`` is the log-sum-exp of the exact tokens (sinks, hot), for ``method="bound"``."""
    T = layer.policy.block_tokens
    B, H, R, D = rows.shape
    bounds, ends, sizes = [], [], []
    for t, start in zip(tiers, _tier_starts(layer, tiers)):
        bounds.append(block_bounds(rows, t))
        ends.append(start + T * torch.arange(1, t.nblocks + 1, device=rows.device))
        sizes.append(t.nblocks)
    forced = torch.cat(ends)[None, None, None, :] > (row_pos - sp.local_window)[None, None, :, None]
    counts = torch.cat([t.fields["valid"].sum(-1) for t in tiers], dim=-1).unsqueeze(2)  # [B,1,1,n]
    keep = select_blocks(torch.cat(bounds, dim=-1), sp, forced, T, counts=counts, exact_lse=exact_lse)
    parts = []
    for t, keep_t in zip(tiers, keep.split(sizes, dim=-1)):
        blocks, row_mask = union_blocks(keep_t)
        sel = Selection("blocks", blocks=blocks, row_mask=row_mask)
        parts.append(chunk.backend(t.codec).tier(rows, t.fields, t.codec, D, sel))
        work.tier_blocks(stats, t, keep_t, blocks, R, D)
    return parts


def tiered_attention(
    layer: LayerState,
    query: torch.Tensor,
    mask: KVMask | None,
    scaling: float,
    plan: AttentionPlan | None = None,
    *,
    force: str | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, Hq, q, D]`` over every tier of ``layer`` -> ``[B, q, Hq, D]``.

    ``plan``: the call's plan (default: :func:`~kvtier.attention.plan.plan_for`, memoized in
    ``mask``); ``force``: a backend name (see :mod:`kvtier.attention.plan`), overriding the layer's.
    """
    if layer.budget is not None:  # an adaptive layer measures its queries (warm-up, eviction rung)
        B, Hq, q, D = query.shape
        layer.observe_queries((query.float() * scaling).reshape(B, layer.kv_heads, (Hq // layer.kv_heads) * q, D), q)
    if plan is None:
        plan = plan_for(layer, query, mask, force)
    if plan.path in ("reference", "sdpa"):  # the oracle; or only exact hot tokens: the plain SDPA call
        return reference_attention(layer, query, mask, scaling)
    if plan.path == "offload":  # cold blocks in a block store: see kvtier.offload
        return offload_attention(layer, query, mask, scaling, plan)
    if mask is not None and not mask.causal:
        raise NotImplementedError("tiered layers support causal (+ padding) masks only")
    padding = None if mask is None else mask.padding
    first = layer.seen - query.shape[2]
    outs = []
    for c in plan.chunks:
        q_pos = first + torch.arange(c.start, c.stop, device=query.device)
        outs.append(_attend(layer, query[:, :, c.start : c.stop], q_pos, padding, scaling, plan, c))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.to(query.dtype).contiguous()
