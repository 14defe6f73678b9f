"""Fast attention over a tiered layer: per-tier partials read from the stored tensors, merged by
log-sum-exp. No dense copy of the layer's K/V is built; transients are per bit-plane slice.

Long query chunks (prefill) are split so the score tensors stay bounded. A policy's sparse
attention applies to calls of at most ``SparsePolicy.max_query_tokens`` new tokens (decode);
longer calls attend densely and are counted apart (``SparseStats.dense_calls``). On CUDA, token
selection (``select="tokens"``) is not in the Triton kernels, so those calls attend densely there.

On the CPU, decode calls (few rows) of a layer whose tiers are all packed (k-bit or 1-bit) and
whose selection is dense or by tokens go through one fused C++ call for the whole layer
(:mod:`kvtier.kernels.fused_cpu`); the per-tier path below is its reference and the fallback.
"""

from __future__ import annotations

import torch

from ..cache.state import LayerState
from ..indexing import hot_rows_allowed as _hot_allowed  # the name test_triton imports
from ..kernels import fused_cpu
from ..kernels.cpu import available as cpu_kernel_available
from ..policy import SparsePolicy
from ..quant import rotation
from ..stats import SparseStats
from . import partials
from .mask import KVMask
from .partials import (
    Partial,
    exact_partial,
    from_rows,
    kernel_partial,
    merge,
    tier_partial,
    to_rows,
    use_kernel,
)
from .reference import reference_attention
from .sparse import block_bounds, gather_fields, select_blocks, select_tokens, union_blocks

#: Max score elements (rows x tokens) per pass; longer query chunks are split.
SCORE_BUDGET = 1 << 23


def _fused_ok(rows: torch.Tensor, sp: SparsePolicy | None) -> bool:
    """Decode rows on the CPU, dense or token selection, and the fused kernel built."""
    return (
        rows.is_cpu
        and rows.shape[2] <= partials.KERNEL_MAX_ROWS
        and (sp is None or sp.select == "tokens")
        and fused_cpu.available()
    )


def _count_tier(stats: SparseStats, t, B: int, H: int, D: int, scored: int, valued: int, read_tokens: int) -> None:
    """Add one tier's selected work to ``stats``: pairs scored and valued, bytes read of the
    tier's bytes (keys always, values only of the ``read_tokens`` some row kept)."""
    total = t.codec.nbytes(B, H, t.nblocks, t.block_tokens, D)
    real_tokens = int(t.fields["valid"].sum()) * H
    stats.pairs += scored
    stats.scored += scored
    stats.valued += valued
    stats.bytes_total += total
    stats.bytes_read += int(total - (real_tokens - read_tokens) * _value_bytes_per_token(t, D))


def _dense_call(stats: SparseStats, tiers, H: int, R: int) -> SparseStats:
    """A long call under a sparse policy (prefill): its pairs, counted apart from selection."""
    pairs = stats.pairs + sum(int(t.fields["valid"].sum()) for t in tiers) * H * R
    return SparseStats(dense_calls=1, dense_pairs=pairs)


def _fused_attend(
    layer: LayerState, rows, q_pos, padding, tiers, sp: SparsePolicy | None, stats
) -> tuple[torch.Tensor, SparseStats | None]:
    """Every segment of the layer in one :func:`kvtier.kernels.fused_cpu.layer_attention` call;
    the same result and work counts as the per-tier path of :func:`_attend`."""
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
    args = []
    for t, start in zip(tiers, _tier_starts(layer, tiers)):
        f, c = t.fields, t.codec
        rot = rotation(D, rows.device) if c.rotate else None
        args.append(((*(f[n] for n in c.KERNEL_FIELDS), f["valid"].squeeze(1)), c.bits, start, c.AFFINE, rot))
    select = None if sp is None else (sp.method, sp.level, q_pos.repeat(R // q) - sp.local_window + 1)
    out, _, counts = fused_cpu.layer_attention(rows, exact, args, select)
    if stats is not None:
        c = counts.sum(0).tolist()  # [1 + tiers][scored, valued, read tokens]
        stats.dense(c[0][0])
        if sp is None:
            return out, _dense_call(stats, tiers, H, R)
        for t, (scored, valued, read_tokens) in zip(tiers, c[1:]):
            _count_tier(stats, t, B, H, D, scored, valued, read_tokens)
    return out, stats


def _attend(
    layer: LayerState, query: torch.Tensor, q_pos: torch.Tensor, padding, scaling: float, sp: SparsePolicy | None
) -> torch.Tensor:
    """One pass over every tier; ``sp`` is the sparse policy applied to this call (None: dense)."""
    B, Hq, q, D = query.shape
    H = layer.kv_heads
    rows = to_rows(query, H, scaling)
    R = rows.shape[2]
    stats = SparseStats(calls=1) if layer.policy.sparse is not None else None
    tiers = [t for t in (layer.cold, layer.warm) if t is not None and t.nblocks]
    if layer.fused and _fused_ok(rows, sp):
        out, stats = _fused_attend(layer, rows, q_pos, padding, tiers, sp, stats)
        if stats is not None:
            layer.sparse_stats.add(stats)
        return from_rows(out, Hq, q)
    parts: list[Partial] = []
    if layer.sinks.k is not None:
        sink_valid = layer.sinks.valid()
        parts.append(exact_partial(rows, layer.sinks.k, layer.sinks.v, sink_valid[:, None, None, :]))
        if stats is not None:
            stats.dense(int(sink_valid.sum()) * H * R)
    hk, hv = layer.hot.view()
    allowed = _hot_allowed(layer, q_pos, padding, Hq // H)
    parts.append(exact_partial(rows, hk, hv, allowed))
    if stats is not None:
        stats.dense(int(allowed.sum()) * H * (B if allowed.shape[0] == 1 else 1))
    row_pos = q_pos.repeat(Hq // H)  # position of each row
    exact_lse = torch.logsumexp(torch.stack([p.lse for p in parts]), 0) if sp is not None else None  # sinks + hot
    if sp is not None and sp.select == "blocks" and tiers:
        parts += _block_sparse_parts(layer, rows, row_pos, tiers, sp, stats, exact_lse)
    elif sp is not None and tiers:
        parts += _token_sparse_parts(layer, rows, row_pos, tiers, sp, stats, exact_lse)
    else:
        parts += [tier_partial(rows, t.fields, t.codec, D) for t in tiers]
        if stats is not None and sp is None:
            stats = _dense_call(stats, tiers, H, R)
    if stats is not None:
        layer.sparse_stats.add(stats)
    return from_rows(merge(parts), Hq, q)


def _tier_starts(layer: LayerState, tiers) -> list[int]:
    """Index of each tier's first token slot (cold, then warm: consecutive ranges)."""
    starts, start = [], layer.evicted
    for t in tiers:
        starts.append(start)
        start += t.ntokens
    return starts


def _value_bytes_per_token(t, D: int) -> float:
    """Bytes a tier holds per token for values (codes + per-token scale metadata)."""
    return (t.codec.nbytes(1, 1, 1, t.block_tokens, D) - t.codec.nbytes(1, 1, 1, 0, D)) / 2 / t.block_tokens


def _token_sparse_parts(
    layer: LayerState,
    rows: torch.Tensor,
    row_pos: torch.Tensor,
    tiers,
    sp: SparsePolicy,
    stats: SparseStats,
    exact_lse: torch.Tensor,
):
    """Exact scores from the packed keys; value work only for tokens passing the row's threshold.
    ``exact_lse [B,H,R]``: log mass of the row's exact tokens (sinks, hot), part of the mass rule."""
    B, H, R, D = rows.shape
    parts = []
    for t, start in zip(tiers, _tier_starts(layer, tiers)):
        if rows.is_cpu and cpu_kernel_available():  # the kernel selects in C++: faster at any row count
            forced_from = row_pos - sp.local_window + 1
            select = (sp.method, sp.level, forced_from, start, exact_lse)
            part = kernel_partial(rows, t.fields, t.codec, D, select=select)
            scored, valued, read_tokens = (int(x) for x in part.counts.sum(0))
        else:
            pos = start + torch.arange(t.ntokens, device=rows.device)
            forced = pos[None, None, None, :] > (row_pos - sp.local_window)[None, None, :, None]
            kept = {}

            def select(flat, forced=forced, kept=kept):
                keep = select_tokens(flat, sp, forced, exact_lse)
                kept["keep"], kept["valid"] = keep, torch.isfinite(flat)
                return keep

            part = tier_partial(rows, t.fields, t.codec, D, select=select)
            scored, valued = int(kept["valid"].sum()), int(kept["keep"].sum())
            read_tokens = int(kept["keep"].any(2).sum())
        parts.append(part)
        _count_tier(stats, t, B, H, D, scored, valued, read_tokens)
    return parts


def _block_sparse_parts(
    layer: LayerState,
    rows: torch.Tensor,
    row_pos: torch.Tensor,
    tiers,
    sp: SparsePolicy,
    stats: SparseStats,
    exact_lse: torch.Tensor,
):
    """Partials over the blocks each row selects by Quest bounds (see :mod:`kvtier.attention.sparse`);
    ``exact_lse [B,H,R]`` is the log-sum-exp of the exact tokens (sinks, hot), for ``method="bound"``."""
    T = layer.policy.block_tokens
    D = rows.shape[-1]
    B, H, R, _ = rows.shape
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
        k = blocks.shape[-1]
        if use_kernel(rows):
            parts.append(kernel_partial(rows, t.fields, t.codec, D, blocks, row_mask))
        else:
            parts.append(tier_partial(rows, gather_fields(t.fields, blocks), t.codec, D, row_mask))
        per_block = t.fields["valid"].sum(-1)  # [B,1,n] real tokens per block
        listed = per_block.expand(B, H, -1).gather(-1, blocks.clamp(min=0)) * (blocks >= 0)
        attended = int((keep_t * per_block.unsqueeze(2)).sum())
        stats.pairs += int(per_block.sum()) * H * R
        stats.scored += int(listed.sum()) * R  # the kernel scores the union of a head's rows
        stats.valued += attended
        stats.bounds += B * H * R * t.nblocks
        stats.bytes_total += t.codec.nbytes(B, H, t.nblocks, T, D)
        stats.bytes_read += t.codec.nbytes(B, H, k, T, D)
    return parts


def tiered_attention(layer: LayerState, query: torch.Tensor, mask: KVMask | None, scaling: float) -> torch.Tensor:
    """Attention of ``query [B, Hq, q, D]`` over every tier of ``layer`` -> ``[B, q, Hq, D]``."""
    has_prefix = layer.sinks.k is not None or any(t is not None and t.nblocks for t in (layer.warm, layer.cold))
    if not has_prefix:  # only exact hot tokens: the plain SDPA call (bit-identical to DynamicCache)
        return reference_attention(layer, query, mask, scaling)
    if getattr(layer.cold, "is_offloaded", False):  # cold blocks in a block store: see kvtier.offload
        from ..offload.attention import offload_attention

        return offload_attention(layer, query, mask, scaling)
    if mask is not None and not mask.causal:
        raise NotImplementedError("tiered layers support causal (+ padding) masks only")
    padding = None if mask is None else mask.padding
    B, Hq, q, D = query.shape
    sp = layer.policy.sparse
    if sp is not None and sp.max_query_tokens is not None and q > sp.max_query_tokens:
        sp = None  # a long chunk (prefill): dense
    if sp is not None and sp.select == "tokens" and query.is_cuda:
        from ..kernels.dispatch import use_triton

        if use_triton(query):  # the Triton kernels select blocks, not tokens: dense Triton beats torch ops
            sp = None
    first = layer.seen - q
    tokens = layer.seen - layer.evicted
    step = max(1, SCORE_BUDGET // max(1, tokens * Hq // layer.kv_heads))
    outs = []
    for s in range(0, q, step):
        q_pos = first + torch.arange(s, min(s + step, q), device=query.device)
        outs.append(_attend(layer, query[:, :, s : s + step], q_pos, padding, scaling, sp))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.to(query.dtype).contiguous()
