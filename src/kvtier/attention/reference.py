"""Reference attention over a tiered layer: decode each tier to dense K/V, then one SDPA call.

This is the oracle every fast path is tested against. It builds a dense copy of one layer's
K/V transiently (never more than one layer at a time) and is deliberately simple.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.state import LayerState
from ..indexing import hot_allowed
from .mask import KVMask


def hot_mask(layer: LayerState, q_len: int, padding: torch.Tensor | None) -> torch.Tensor:
    """bool ``[B or 1, q, L]``: causal (by index) and padding mask over the hot tier, for the last
    ``q_len`` positions (see :func:`kvtier.indexing.hot_allowed`)."""
    q_pos = layer.seen - q_len + torch.arange(q_len, device=layer.device)
    return hot_allowed(layer, q_pos, padding)


def prefix_parts(layer: LayerState, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Decoded ``(k, v, valid)`` of sinks, cold and warm (tokens older than every query)."""
    parts = []
    if layer.sinks.k is not None:
        parts.append((layer.sinks.k.to(dtype), layer.sinks.v.to(dtype), layer.sinks.valid()))
    for tier in (layer.cold, layer.warm):
        if tier is not None and tier.nblocks:
            parts.append(tier.dense(dtype))
    return parts


def reference_attention(layer: LayerState, query: torch.Tensor, mask: KVMask | None, scaling: float) -> torch.Tensor:
    """Attention of ``query: [B, Hq, q, D]`` over all tiers of ``layer``.

    Returns
    -------
    ``[B, q, Hq, D]`` contiguous, in the query's dtype.
    """
    if mask is not None and not mask.causal:
        raise NotImplementedError("tiered layers support causal (+ padding) masks only")
    dt = query.dtype
    q_len = query.shape[2]
    padding = None if mask is None else mask.padding
    parts = prefix_parts(layer, dt)
    hk, hv = layer.hot.view()
    hk, hv = hk.to(dt), hv.to(dt)
    if not parts and padding is None:
        # Same call DynamicCache + SDPA makes, so an exact layer matches it bit for bit.
        if q_len == 1:
            out = F.scaled_dot_product_attention(query, hk, hv, scale=scaling, enable_gqa=True)
        elif q_len == hk.shape[2]:
            out = F.scaled_dot_product_attention(query, hk, hv, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            allowed = hot_mask(layer, q_len, None)[:, None]
            out = F.scaled_dot_product_attention(query, hk, hv, attn_mask=allowed, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    B = query.shape[0]
    k = torch.cat([p[0] for p in parts] + [hk], dim=2)
    v = torch.cat([p[1] for p in parts] + [hv], dim=2)
    masks = [p[2][:, None, :].expand(B, q_len, -1) for p in parts]
    masks.append(hot_mask(layer, q_len, padding).expand(B, q_len, -1))
    allowed = torch.cat(masks, dim=2)[:, None]
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()
