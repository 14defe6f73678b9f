"""Fast attention over a tiered layer: per-tier partials read from the stored tensors, merged by
log-sum-exp. No dense copy of the layer's K/V is built; transients are per bit-plane slice.

Long query chunks (prefill) are split so the score tensors stay bounded.
"""

from __future__ import annotations

import torch

from ..cache.layer import TieredLayer
from .mask import KVMask
from .partials import Partial, exact_partial, from_rows, merge, tier_partial, to_rows
from .reference import reference_attention

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
    parts: list[Partial] = []
    if layer.sinks.k is not None:
        parts.append(exact_partial(rows, layer.sinks.k, layer.sinks.v, layer.sinks.valid()[:, None, None, :]))
    for tier in (layer.cold, layer.warm):
        if tier is not None and tier.nblocks:
            parts.append(tier_partial(rows, tier.fields, tier.codec, D))
    hk, hv = layer.hot.view()
    parts.append(exact_partial(rows, hk, hv, _hot_allowed(layer, q_pos, padding, Hq // H)))
    return from_rows(merge(parts), Hq, q)


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
