"""Index and mask helpers over token positions and block lists: leaf module (imports torch only).

Shared by the attention paths (:mod:`kvtier.attention`, :mod:`kvtier.attention.offloaded`) and the
offload block store's tier (:mod:`kvtier.offload.tier`), so that storage never imports attention
and the attention paths never import each other for a helper. Layers are read duck-typed: a
layer here is anything with ``hot.length``, ``hot_start`` and ``seen`` (a
:class:`kvtier.cache.state.LayerState`).
"""

from __future__ import annotations

from typing import Any

import torch


def hot_allowed(layer: Any, q_pos: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """bool ``[B or 1, q, L]``: which of the ``L`` hot tokens each query position may attend.

    Parameters
    ----------
    layer : the tiered layer (hot tokens occupy index range ``[hot_start, seen)``).
    q_pos : int ``[q]`` index-space positions of the queries.
    padding : bool ``[B, >= seen]`` real-token mask in index space, or None (no padding).
    """
    L = layer.hot.length
    k_pos = layer.hot_start + torch.arange(L, device=q_pos.device)
    allowed = (k_pos[None, :] <= q_pos[:, None])[None]  # [1, q, L]
    if padding is not None:
        allowed = allowed & padding[:, None, layer.hot_start : layer.seen].to(q_pos.device)
    return allowed


def hot_rows_allowed(layer: Any, q_pos: torch.Tensor, padding: torch.Tensor | None, groups: int) -> torch.Tensor:
    """bool ``[B or 1, 1, groups * q, L]``: :func:`hot_allowed` for the rows of a KV head, ordered
    (group, position) as :func:`kvtier.attention.partials.to_rows` lays them out."""
    allowed = hot_allowed(layer, q_pos, padding)
    Bm, q, L = allowed.shape
    return allowed.unsqueeze(1).expand(Bm, groups, q, L).reshape(Bm, 1, groups * q, L)


def union_blocks(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of kept blocks per (batch, head), in CSR-like padded form.

    Parameters
    ----------
    keep : bool ``[B, H, R, n]``: the blocks each of the ``R`` rows keeps.

    Returns
    -------
    blocks : int64 ``[B, H, k]`` block ids in ascending order, ``-1`` where a head keeps fewer.
    row_mask : bool ``[B, H, R, k]``: which listed blocks each row keeps.
    """
    union = keep.any(2)  # [B,H,n]
    k = max(1, int(union.sum(-1).max()))
    order = torch.arange(union.shape[-1], 0, -1, device=union.device, dtype=torch.float)
    idx = (union.float() * (union.shape[-1] + 1) + order).topk(k, dim=-1).indices.sort(dim=-1).values
    taken = union.gather(-1, idx)
    idx = torch.where(taken, idx, torch.full_like(idx, -1))
    row_mask = keep.gather(-1, idx.clamp(min=0).unsqueeze(2).expand(-1, -1, keep.shape[2], -1)) & taken.unsqueeze(2)
    return idx, row_mask
