"""Fast attention over a tiered layer: per-tier partials read from the stored tensors, merged by
log-sum-exp. No dense copy of the layer's K/V is built; transients are per bit-plane slice.

Long query chunks (prefill) are split so the score tensors stay bounded.
"""

from __future__ import annotations

import torch

from ..cache.layer import TieredLayer
from ..diagnostics import SparseStats
from .mask import KVMask
from .partials import Partial, exact_partial, from_rows, kernel_partial, merge, tier_partial, to_rows, use_kernel
from .reference import reference_attention
from .sparse import block_bounds, gather_fields, select_blocks, union_blocks

#: Max score elements (rows x tokens) per pass; longer query chunks are split.
SCORE_BUDGET = 1 << 23


def _hot_allowed(layer: TieredLayer, q_pos: torch.Tensor, padding: torch.Tensor | None, groups: int) -> torch.Tensor:
    """bool ``[B or 1, 1, Gq * len(q_pos), L]`` over hot tokens, rows ordered (group, position)."""
    L = layer.hot.length
    k_pos = layer.hot_start + torch.arange(L, device=q_pos.device)
    allowed = (k_pos[None, :] <= q_pos[:, None])[None]  # [1, q, L]
    if padding is not None:
        allowed = allowed & padding[:, None, layer.hot_start : layer.seen].to(q_pos.device)
    Bm, q = allowed.shape[:2]
    return allowed.unsqueeze(1).expand(Bm, groups, q, L).reshape(Bm, 1, groups * q, L)


def _attend(layer: TieredLayer, query: torch.Tensor, q_pos: torch.Tensor, padding, scaling: float) -> torch.Tensor:
    B, Hq, q, D = query.shape
    H = layer.kv_heads
    rows = to_rows(query, H, scaling)
    R = rows.shape[2]
    parts: list[Partial] = []
    stats = SparseStats(calls=1) if layer.policy.sparse is not None else None
    if layer.sinks.k is not None:
        sink_valid = layer.sinks.valid()
        parts.append(exact_partial(rows, layer.sinks.k, layer.sinks.v, sink_valid[:, None, None, :]))
        if stats is not None:
            n = int(sink_valid.sum()) * H * R
            stats.total += n
            stats.attended += n
            stats.computed += n
    tiers = [t for t in (layer.cold, layer.warm) if t is not None and t.nblocks]
    if stats is not None and tiers:
        parts += _sparse_parts(layer, rows, q_pos.repeat(Hq // H), tiers, stats)
    else:
        parts += [tier_partial(rows, t.fields, t.codec, D) for t in tiers]
    hk, hv = layer.hot.view()
    allowed = _hot_allowed(layer, q_pos, padding, Hq // H)
    parts.append(exact_partial(rows, hk, hv, allowed))
    if stats is not None:
        n = int(allowed.sum()) * H * (B if allowed.shape[0] == 1 else 1)
        stats.total += n
        stats.attended += n
        stats.computed += n
        layer.sparse_stats.add(stats)
    return from_rows(merge(parts), Hq, q)


def _sparse_parts(layer: TieredLayer, rows: torch.Tensor, row_pos: torch.Tensor, tiers, stats: SparseStats):
    """Partials over the blocks each row selects (see :mod:`kvtier.attention.sparse`)."""
    sp = layer.policy.sparse
    T = layer.policy.block_tokens
    D = rows.shape[-1]
    B, H, R, _ = rows.shape
    start = layer.evicted  # cold blocks first, then warm: consecutive token ranges
    bounds, ends, sizes = [], [], []
    for t in tiers:
        bounds.append(block_bounds(rows, t))
        ends.append(start + T * torch.arange(1, t.nblocks + 1, device=rows.device))
        sizes.append(t.nblocks)
        start += t.ntokens
    forced = torch.cat(ends)[None, None, None, :] > (row_pos - sp.local_window)[None, None, :, None]
    keep = select_blocks(torch.cat(bounds, dim=-1), sp, forced, T)
    parts = []
    for t, keep_t in zip(tiers, keep.split(sizes, dim=-1)):
        blocks, row_mask = union_blocks(keep_t)
        k = blocks.shape[-1]
        if use_kernel(rows):
            parts.append(kernel_partial(rows, t.fields, t.codec, D, blocks, row_mask))
        else:
            parts.append(tier_partial(rows, gather_fields(t.fields, blocks), t.codec, D, row_mask))
        per_block = t.fields["valid"].sum(-1)  # [B,1,n] real tokens per block
        listed = per_block.expand(B, H, -1).gather(-1, blocks.clamp(min=0)) * (blocks >= 0)
        stats.total += int(per_block.sum()) * H * R
        stats.attended += int((keep_t * per_block.unsqueeze(2)).sum())
        stats.computed += int(listed.sum()) * R + B * H * R * t.nblocks  # gathered pairs + bounds
        stats.bytes_total += t.codec.nbytes(B, H, t.nblocks, T, D)
        stats.bytes_read += t.codec.nbytes(B, H, k, T, D)
    return parts


def tiered_attention(layer: TieredLayer, query: torch.Tensor, mask: KVMask | None, scaling: float) -> torch.Tensor:
    """Attention of ``query [B, Hq, q, D]`` over every tier of ``layer`` -> ``[B, q, Hq, D]``."""
    has_prefix = layer.sinks.k is not None or any(t is not None and t.nblocks for t in (layer.warm, layer.cold))
    if not has_prefix:  # only exact hot tokens: the plain SDPA call (bit-identical to DynamicCache)
        return reference_attention(layer, query, mask, scaling)
    if mask is not None and not mask.causal:
        raise NotImplementedError("tiered layers support causal (+ padding) masks only")
    padding = None if mask is None else mask.padding
    B, Hq, q, D = query.shape
    first = layer.seen - q
    tokens = layer.seen - layer.evicted
    step = max(1, SCORE_BUDGET // max(1, tokens * Hq // layer.kv_heads))
    outs = []
    for s in range(0, q, step):
        q_pos = first + torch.arange(s, min(s + step, q), device=query.device)
        outs.append(_attend(layer, query[:, :, s : s + step], q_pos, padding, scaling))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.to(query.dtype).contiguous()
