"""kvtier's attention function (the one registered with transformers as ``"kvtier"``).

It has transformers' attention-function signature but imports nothing of transformers: the
registration, ``enable`` and ``disable`` live in the adapter (:mod:`kvtier.hf.attention`).
May import: torch, ``kvtier.cache.state``, ``kvtier.attention`` (mask, tiered).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..cache.state import HANDLE_KEY, LayerState
from .mask import KVMask
from .tiered import tiered_attention


def dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, scaling: float | None
) -> torch.Tensor:
    """SDPA over dense K/V (layers that are not tiered). Returns ``[B, q, H, D]``."""
    if isinstance(attention_mask, KVMask):
        mask = attention_mask.dense()
    else:
        mask = attention_mask
    is_causal = mask is None and query.shape[2] > 1 and query.shape[2] == key.shape[2]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


def kvtier_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"kvtier"``.

    With a :class:`~kvtier.TieredLayer` handle in ``kwargs`` it attends over the layer's tiers (``key``
    and ``value`` are then only the new tokens, already stored in the hot tier) and moves the
    hot overflow down the tiers afterwards; without one it is plain SDPA.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer = kwargs.get(HANDLE_KEY)
    if not isinstance(layer, LayerState):
        return dense_attention(query, key, value, attention_mask, scaling), None
    if attention_mask is not None and not isinstance(attention_mask, KVMask):
        raise NotImplementedError("tiered layers need kvtier's mask function; got a precomputed mask tensor")
    try:
        out = tiered_attention(layer, query, attention_mask, scaling)  # the plan picks the path
    except BaseException as err:  # undo this call's changes to the cache, then let it through
        layer.abort(err)
        raise
    layer.settle(None if attention_mask is None else attention_mask.padding)  # all or nothing itself
    return out, None
